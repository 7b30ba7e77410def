#!/usr/bin/env python3
"""Tokenizes RedPajama-style JSONL (.jsonl / .jsonl.gz / .jsonl.zst, v1 `text` or v2 `raw_content`;
one file or a directory or glob of thousands) into Megatron's indexed-dataset layout:
<output-prefix>_<key>_document.bin/.idx.

Every input file is first written as its own shard under <output-prefix>_shards/; a rerun after
an interruption skips the shards already finished. The shards are then merged (Megatron's merge)
or, with --per-shard, kept as one dataset per input file. RedPajama-V2 downloads (documents/,
quality_signals/, duplicates/) are joined by document id and can be filtered:

  --filter "rps_doc_word_count >= 50" --filter "ccnet_perplexity < 600" --drop-duplicates

Malformed lines, records without the key, non-UTF-8 bytes and empty documents are skipped and
counted by reason in the closing summary line, with the documents each filter rule dropped.
A corrupt or truncated input file is named with its last good line; the lines before the damage
are kept, and the run goes on.
"""

from __future__ import annotations

import argparse

from megazpp.cli import add_progress_flag, run_tool, wants_progress
from megazpp.preprocess.chunk_reader import DEFAULT_CHUNK_BYTES
from megazpp.preprocess.pipeline import preprocess
from megazpp.preprocess.signal_filter import FilterSpec, load_filter_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input",
        required=True,
        help="a JSONL file, a directory of them (searched recursively; for a RedPajama-V2 "
        "download, its documents/), or a glob (quote it; ** recurses)",
    )
    parser.add_argument("--tokenizer-model", required=True, help="SentencePiece .model file")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="record keys to tokenize, one dataset each (default: text; `text` also reads RedPajama v2's raw_content)",
    )
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    parser.add_argument(
        "--split-by-source",
        action="store_true",
        help="one dataset per source, <prefix>_<source>_<key>_document, to blend with weights: "
        "a record's meta.redpajama_set_name, else the top directory under the input that "
        "holds its file (RedPajama-V2: the snapshot), else the file's name",
    )
    parser.add_argument(
        "--per-shard",
        action="store_true",
        help="keep one dataset per input file under <prefix>_shards/ instead of merging",
    )
    parser.add_argument(
        "--keep-shards",
        action="store_true",
        help="keep <prefix>_shards/ after merging, so a later run over more files redoes only those",
    )
    parser.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="RULE",
        help="RedPajama-V2: keep only documents whose quality signals satisfy RULE, e.g. "
        "'rps_doc_word_count >= 50' or 'mean(rps_lines_num_words) > 3 and ccnet_perplexity < 600' "
        "(repeatable; all must hold)",
    )
    parser.add_argument("--filter-file", help="YAML file with `rules:` (a list of RULEs) and `drop_duplicates:`")
    parser.add_argument(
        "--drop-duplicates",
        action="store_true",
        help="RedPajama-V2: drop the documents its duplicates/*.duplicates.parquet lists "
        "(one copy of each duplicate cluster stays; needs pyarrow)",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=DEFAULT_CHUNK_BYTES,
        help=f"input bytes per unit of worker work (default {DEFAULT_CHUNK_BYTES})",
    )
    add_progress_flag(parser)
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.chunk_bytes < 1:
        parser.error(f"--chunk-bytes must be >= 1, got {args.chunk_bytes}")
    if args.per_shard and args.keep_shards:
        parser.error("--keep-shards applies to a merged run; --per-shard keeps the shards anyway")
    from_file = load_filter_file(args.filter_file) if args.filter_file else FilterSpec()
    filters = FilterSpec(from_file.rules + tuple(args.filter), from_file.drop_duplicates or args.drop_duplicates)
    summary = preprocess(
        args.input,
        args.tokenizer_model,
        args.output_prefix,
        workers=args.workers,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        chunk_bytes=args.chunk_bytes,
        progress=wants_progress(args),
        filters=filters,
        split_by_source=args.split_by_source,
        per_shard=args.per_shard,
        keep_shards=args.keep_shards,
    )
    for label, prefix in summary.outputs.items():
        print(f"{prefix}.bin/.idx: {summary.documents[label]} documents, {summary.tokens[label]} tokens")
    for label, prefixes in summary.shard_outputs.items():
        if not summary.outputs:
            print(
                f"{label}: {len(prefixes)} shard datasets under {args.output_prefix}_shards/, "
                f"{summary.documents[label]} documents, {summary.tokens[label]} tokens"
            )
    print(summary.line())
    return 0


if __name__ == "__main__":
    run_tool(main)
