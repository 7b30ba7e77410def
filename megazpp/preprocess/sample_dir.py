"""What run.sh's DATA_DIR holds, said before run.sh builds or trains on anything there.

Why: `DATA_DIR=<a directory of one's own data> bash run.sh` used to build the sample corpus and
tokenizer into that directory and train on them without a word. run.sh builds the sample data
(corpus, tokenizer, indexed dataset) only into an absent or empty directory, or one that holds
run.sh's sample build and nothing else (its files, temp names and index caches, finished or
not); a directory holding anything else is refused in one line naming what was found. Either
way, the line printed says which dataset and tokenizer the job will use.

    python -m megazpp.preprocess.sample_dir DATA_DIR [pretrain_gpt.py flags]
                                      (run.sh runs it; exit 2 with one line to refuse)

A `--data-path` or `--tokenizer-model` among the job's flags wins over DATA_DIR's; the line
says so.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from megazpp.errors import DataError
from megazpp.preprocess.sample_corpus import CODE_SOURCE, DOCS_SOURCE

CORPUS, TOKENIZER, DATASET = "corpus", "tokenizer.model", "corpus_text_document"
# Everything run.sh's build writes under DATA_DIR: the finished names, the temp names each step
# writes before its rename (".tmp" and a pid), and the training job's index caches.
_SAMPLE_NAMES = re.compile(
    r"""(
    corpus(\.tmp)?                                      # the JSONL corpus directory
  | tokenizer(\.tmp)?(\.tmp\d+)?\.(model|vocab)          # SentencePiece's two files
  | corpus(\.tmp)?_text_document\.(bin|idx|tokenizer\.json)(\.tmp\d+)?
  | corpus\.tmp_shards                                  # preprocessing's resumable shards
  | corpus_text_document_\w+\.npy(\.tmp\d+)?            # sample / max-token index caches
)""",
    re.VERBOSE,
)
_CORPUS_FILES = {f"{source}.jsonl" for source in (CODE_SOURCE, DOCS_SOURCE)}
_SHOWN = 5


def foreign_entries(data_dir: Path) -> list[str]:
    """The entries of `data_dir` that run.sh's sample build does not write (sorted)."""
    foreign = [p.name for p in data_dir.iterdir() if not _SAMPLE_NAMES.fullmatch(p.name)]
    for corpus in (data_dir / CORPUS, data_dir / f"{CORPUS}.tmp"):
        if corpus.is_dir():
            foreign += [f"{corpus.name}/{p.name}" for p in corpus.iterdir() if p.name not in _CORPUS_FILES]
        elif corpus.exists():
            foreign.append(corpus.name)
    return sorted(foreign)


def describe(
    data_dir: str | os.PathLike[str], data_path: list[str] | None = None, tokenizer_model: str | None = None
) -> str:
    """The line run.sh prints: what DATA_DIR holds and what the job will use (the job's own
    `data_path` / `tokenizer_model` when given); a DataError when run.sh must not build or
    train there."""
    line = _holds(Path(data_dir))
    given = [f"--data-path {' '.join(data_path)}"] if data_path else []
    given += [f"--tokenizer-model {tokenizer_model}"] if tokenizer_model else []
    if given:
        line += f"; but the command line's {' and '.join(given)} {'win' if len(given) > 1 else 'wins'} over it"
    return line


def _holds(root: Path) -> str:
    dataset, tokenizer = root / DATASET, root / TOKENIZER
    if root.exists() and not root.is_dir():
        raise DataError(f"DATA_DIR={root} is not a directory: give run.sh a directory for its sample data")
    if not root.exists() or not any(root.iterdir()):
        return (
            f"DATA_DIR={root} is {'empty' if root.exists() else 'absent'}: building the sample data there "
            f"(a corpus from Python's standard library, its tokenizer {tokenizer}, the dataset {dataset})"
        )
    foreign = foreign_entries(root)
    if foreign:
        shown = ", ".join(foreign[:_SHOWN]) + (f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else "")
        raise DataError(
            f"DATA_DIR={root} holds files that are not run.sh's sample data ({shown}): run.sh builds "
            "and trains on its sample data only in an empty directory or one it built; give another "
            "DATA_DIR (your own data goes in with --data-path PREFIX --tokenizer-model FILE)"
        )
    done = tokenizer.is_file() and Path(f"{dataset}.idx").is_file() and Path(f"{dataset}.bin").is_file()
    if done:
        return f"DATA_DIR={root} holds run.sh's sample data: training on {dataset} with the tokenizer {tokenizer}"
    return (
        f"DATA_DIR={root} holds an unfinished build of run.sh's sample data: finishing it (tokenizer "
        f"{tokenizer}, dataset {dataset})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("data_dir")
    parser.add_argument("--data-path", nargs="+")
    parser.add_argument("--tokenizer-model")
    args, _ = parser.parse_known_args(argv)
    print(f"run.sh: {describe(args.data_dir, args.data_path, args.tokenizer_model)}", flush=True)
    return 0


if __name__ == "__main__":
    from megazpp.cli import run_tool

    run_tool(main, prog="run.sh")
