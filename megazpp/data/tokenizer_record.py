"""Which tokenizer made a dataset: a small JSON file beside its `.bin/.idx`.

Why: two SentencePiece models of the same vocabulary size yield token ids in the same range, so
data tokenized by one and trained with the other passes every other check and trains on
nonsense. Megatron's `.idx` has no room for the tokenizer, so preprocessing writes
`<prefix>.tokenizer.json` (the model's SHA-256, its path and vocabulary size) next to
`<prefix>.bin/.idx`; readers of the pair (Megatron's included) never open it. Before any rank
starts, the job compares each dataset's record with `--tokenizer-model` and refuses a mismatch
unless `--allow-tokenizer-mismatch`. A dataset without a record (made before records existed, or
by Megatron) is accepted with a note, since nothing can be checked.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megazpp.data.indexed_dataset import index_file
from megazpp.errors import DataError

RECORD_SUFFIX = ".tokenizer.json"
RECORD_VERSION = 1
_READ_BLOCK = 1 << 20


def record_file(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{prefix}{RECORD_SUFFIX}")


def model_sha256(tokenizer_model: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(tokenizer_model, "rb") as f:
        for block in iter(lambda: f.read(_READ_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class TokenizerRecord:
    sha256: str
    model: str  # the model's path when the data was made (for the message; the digest decides)
    vocab_size: int

    @classmethod
    def of(cls, tokenizer_model: str | os.PathLike[str], vocab_size: int) -> TokenizerRecord:
        return cls(model_sha256(tokenizer_model), str(Path(tokenizer_model).resolve()), vocab_size)


def write_record(prefix: str | os.PathLike[str], record: TokenizerRecord) -> None:
    """Written atomically (temp name, then rename) after the dataset itself is in place."""
    path = record_file(prefix)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(
        json.dumps(
            {
                "version": RECORD_VERSION,
                "tokenizer_sha256": record.sha256,
                "tokenizer_model": record.model,
                "vocab_size": record.vocab_size,
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    os.replace(tmp, path)


def read_record(prefix: str | os.PathLike[str]) -> TokenizerRecord | None:
    """The dataset's record; None when it has none; DataError when the file is unreadable."""
    path = record_file(prefix)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return TokenizerRecord(str(data["tokenizer_sha256"]), str(data["tokenizer_model"]), int(data["vocab_size"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{path}: not a tokenizer record ({type(e).__name__}: {e}); remove it "
            "to train without the check, or preprocess the data again"
        ) from None


def check_tokenizer_records(
    prefixes: Sequence[str], tokenizer_model: str | os.PathLike[str], allow_mismatch: bool
) -> list[str]:
    """Compare every dataset's record with `tokenizer_model`: a DataError for a mismatch unless
    `allow_mismatch`; notes (for the start-up banner) for what was accepted without a check.
    Datasets or a model that do not exist are left to the readers that report them."""
    if not Path(tokenizer_model).is_file():
        return []
    digest = model_sha256(tokenizer_model)
    notes, unrecorded = [], []
    for prefix in dict.fromkeys(prefixes):
        if not index_file(prefix).is_file():
            continue
        record = read_record(prefix)
        if record is None:
            unrecorded.append(prefix)
        elif record.sha256 != digest:
            what = (
                f"dataset {prefix!r} was tokenized by {record.model} (sha256 {record.sha256[:16]}, "
                f"{record_file(prefix)}), but --tokenizer-model {tokenizer_model} is sha256 "
                f"{digest[:16]}"
            )
            if not allow_mismatch:
                raise DataError(
                    f"{what}: train with the tokenizer that made the data, or pass "
                    "--allow-tokenizer-mismatch to accept it"
                )
            notes.append(f"{what} (accepted: --allow-tokenizer-mismatch)")
    if unrecorded:
        notes.append(
            f"{', '.join(repr(p) for p in unrecorded)}: no tokenizer record "
            f"({RECORD_SUFFIX}; made before megazpp wrote one, or by Megatron), so "
            f"--tokenizer-model {tokenizer_model} cannot be checked against it"
        )
    return notes
