"""The SentencePiece tokenizer every part of megazpp talks to.

Megatron's GPT datasets separate documents with an end-of-document token; for a Llama-style
SentencePiece model that is `</s>`, so `eod_id` is simply `eos_id`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from megazpp.errors import DataError


class Tokenizer:
    """A loaded SentencePiece `.model`; fails at construction, not at first use, if unusable."""

    def __init__(self, model_path: str | os.PathLike[str]):
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise DataError(f"tokenizer model {self.model_path} does not exist (expected a SentencePiece .model file)")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.model_path))
        except (OSError, RuntimeError) as e:
            raise DataError(f"tokenizer model {self.model_path} is not a valid SentencePiece model: {e}") from e
        self.vocab_size: int = self._sp.GetPieceSize()
        self.unk_id: int = self._sp.unk_id()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        self.pad_id: int = self._sp.pad_id()
        if self.eos_id < 0:
            raise DataError(
                f"tokenizer model {self.model_path} has no end-of-sequence token; "
                f"megazpp needs one to separate documents"
            )

    @property
    def eod_id(self) -> int:
        return self.eos_id

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._sp.EncodeAsIds(text)  # sentencepiece is untyped
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """One C++ call for many documents, single-threaded: parallelism belongs to the caller's
        worker processes, and hidden threads would make worker scaling unmeasurable."""
        batch: list[list[int]] = self._sp.Encode(list(texts), out_type=int, num_threads=1)
        return batch

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._sp.DecodeIds([int(i) for i in ids])
        return text
