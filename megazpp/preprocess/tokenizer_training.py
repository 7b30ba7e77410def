"""Training a Llama-style SentencePiece BPE model on JSONL or plain-text files.

Choices, and why:
- BPE with byte fallback: no input byte is ever unknown, so code and odd Unicode survive.
- ids unk=0, bos=1, eos=2 as in Llama, plus pad=3 for padded evaluation batches.
- identity normalization, no dummy prefix, whitespace kept: source code's indentation and
  newlines are content, and decode(encode(text)) must give the text back.
- `input_sentence_size` bounds training time: SentencePiece samples that many lines.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm
from tqdm import tqdm

from megazpp.errors import DataError, refuse_existing
from megazpp.preprocess.jsonl import JSONL_SUFFIXES, SkipReason, extract_text, iter_line_chunks

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
DEFAULT_INPUT_SENTENCE_SIZE = 200_000
# SentencePiece's own default: longer "sentences" (long code lines) are dropped from training.
MAX_SENTENCE_BYTES = 4192


def iter_training_lines(files: Iterable[Path], key: str, skipped: Counter[str]) -> Iterator[str]:
    """Non-empty lines of every document: SentencePiece trains on lines, not whole documents."""
    for path in files:
        if path.name.endswith(JSONL_SUFFIXES):
            for chunk in iter_line_chunks(path, 1 << 20):
                for raw in chunk:
                    text = extract_text(raw, key)
                    if isinstance(text, SkipReason):
                        skipped[text.value] += 1
                        continue
                    yield from (line for line in text.split("\n") if line.strip())
        else:
            with open(path, encoding="utf-8-sig", errors="replace") as f:  # -sig: a leading BOM is no text
                yield from (line.rstrip("\n") for line in f if line.strip())


def _announce_end(lines: Iterable[str], log: Callable[[str], None] | None) -> Iterator[str]:
    count = 0
    for count, line in enumerate(lines, 1):  # noqa: B007 (count is read after the loop)
        yield line
    if log is not None:
        log(f"read {count} lines; SentencePiece is sampling them and learning the BPE merges")


def train_tokenizer(
    files: Sequence[str | os.PathLike[str]],
    vocab_size: int,
    output_prefix: str | os.PathLike[str],
    key: str = "text",
    input_sentence_size: int = DEFAULT_INPUT_SENTENCE_SIZE,
    seed: int = 1234,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> tuple[Path, Counter[str]]:
    """Trains and writes `<output_prefix>.model` / `.vocab`; returns the model path and skip counts.

    SentencePiece reads every line first, then learns its merges without reporting progress;
    `log` (when given) is told when the reading ends, so a log shows which phase is running.
    """
    paths = [Path(f) for f in files]
    for p in paths:
        if not p.is_file():
            raise DataError(f"tokenizer training input {p} does not exist")
    if vocab_size < 260:
        raise DataError(f"--vocab-size {vocab_size} is too small: byte fallback alone needs 256 + 4 special ids")
    prefix = Path(output_prefix)
    for suffix in (".model", ".vocab"):  # the rule of every tool that writes a result
        refuse_existing(f"{prefix}{suffix}", DataError, instead="give another --out prefix or remove it")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    skipped: Counter[str] = Counter()
    tmp_prefix = prefix.with_name(prefix.name + f".tmp{os.getpid()}")
    spm.set_random_generator_seed(seed)  # the line sample, hence the model, follows the seed
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=_announce_end(
                tqdm(
                    iter_training_lines(paths, key, skipped), desc="reading lines", unit=" line", disable=not progress
                ),
                log,
            ),
            model_prefix=str(tmp_prefix),
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=0.9995,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            max_sentence_length=MAX_SENTENCE_BYTES,
            seed_sentencepiece_size=200_000,
            hard_vocab_limit=False,
            num_threads=max(1, min(os.cpu_count() or 1, 8)),
            minloglevel=2,
        )
        for suffix in (".vocab", ".model"):  # the .model last: its presence means a finished build
            os.replace(f"{tmp_prefix}{suffix}", f"{prefix}{suffix}")
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"{prefix}.model and {prefix}.vocab were not written (the partial files were removed)"
        ) from None
    except RuntimeError as e:  # SentencePiece reports bad settings for this corpus this way
        raise DataError(
            f"SentencePiece training on {[str(p) for p in paths]} with vocab size {vocab_size} failed: {e}"
        ) from e
    finally:
        for suffix in (".model", ".vocab"):
            Path(f"{tmp_prefix}{suffix}").unlink(missing_ok=True)
    return Path(f"{prefix}.model"), skipped
