#!/usr/bin/env python3
"""Converts Hugging Face Llama checkpoints to megazpp checkpoints and back.

  convert_hf.py import --hf-dir DIR --save OUT [--tp N] [--pp N] [--seq-length N] [--dtype D]
  convert_hf.py export --load CKPT --hf-dir OUT [--config FILE [flags...]] [--dtype D] [--masters]

`import` reads config.json and *.safetensors or pytorch_model*.bin (never executing code) and
writes a weights-only checkpoint (iteration 0) split for tensor x pipeline parallel sizes;
a tokenizer.model in the HF directory is checked against the model and copied to OUT.
`export` reads any megazpp checkpoint (a save directory or one iter_N directory) and writes
config.json + model.safetensors (sharded above --max-shard-gb) loadable by transformers'
LlamaForCausalLM, with the run's tokenizer.model when the checkpoint's saved config names one
that exists (or --tokenizer-model). The model config comes from the checkpoint (training and
imports record it); a --config given after the export options must agree with it. LoRA
adapters are folded into their weights; an adapters-only checkpoint (--save-adapters-only)
takes its frozen weights from the base it records, refused when that base is gone or changed.
Neither command overwrites: an existing --save checkpoint or --hf-dir model is refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megazpp.cli import run_tool
from megazpp.config.load import load_config
from megazpp.interop.checkpoint_io import saved_tokenizer
from megazpp.interop.consolidate import DTYPES, parse_dtype, two_level_note
from megazpp.interop.convert import export_hf, import_hf
from megazpp.interop.safetensors_io import CONFIG_FILE, read_json


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face Llama directory -> megazpp checkpoint")
    imp.add_argument("--hf-dir", required=True, help="directory with config.json and weights")
    imp.add_argument("--save", required=True, help="new megazpp save directory")
    imp.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    imp.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    imp.add_argument("--seq-length", type=int, help="default: max_position_embeddings")
    imp.add_argument("--dtype", choices=sorted(DTYPES), help="default: as stored")
    imp.add_argument(
        "--tokenizer-model", help="check and copy this tokenizer.model (default: the HF directory's, if any)"
    )
    exp = sub.add_parser("export", help="megazpp checkpoint -> Hugging Face Llama directory")
    exp.add_argument("--load", required=True, help="save directory (its latest) or iter_N dir")
    exp.add_argument("--hf-dir", required=True, help="new output directory")
    exp.add_argument("--dtype", choices=sorted(DTYPES), help="default: as stored")
    exp.add_argument("--masters", action="store_true", help="export the fp32 master weights of a bf16/fp16 run")
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    exp.add_argument(
        "--tokenizer-model", help="check and copy a tokenizer.model alongside (default: the run's, from the checkpoint)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    if args.command == "import":
        if rest:
            _parser().error(f"unrecognized arguments: {' '.join(rest)}")
        path = import_hf(
            args.hf_dir,
            args.save,
            tp=args.tp,
            pp=args.pp,
            seq_length=args.seq_length,
            dtype=parse_dtype(args.dtype),
            tokenizer_model=args.tokenizer_model,
        )
        print(f"wrote {path} (tp={args.tp}, pp={args.pp})")
        trained = read_json(Path(args.hf_dir) / CONFIG_FILE).get("max_position_embeddings")
        if args.seq_length and isinstance(trained, int) and args.seq_length > trained:
            print(
                f"note: --seq-length {args.seq_length} exceeds the model's "
                f"max_position_embeddings {trained}: RoPE runs at any length, but positions "
                f"beyond {trained} were never trained (expect worse loss there until the "
                "model is trained at the new length)"
            )
        return 0
    cfg = load_config(rest).model if rest else None
    tokenizer = args.tokenizer_model or saved_tokenizer(args.load)
    out = export_hf(
        args.load,
        args.hf_dir,
        cfg=cfg,
        dtype=parse_dtype(args.dtype),
        masters=args.masters,
        max_shard_bytes=int(args.max_shard_gb * 1024**3),
        tokenizer_model=tokenizer,
    )
    print(
        f"wrote {out}" + (f" (with {tokenizer})" if tokenizer else " (no tokenizer: give --tokenizer-model to add one)")
    )
    note = two_level_note(args.load)
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    run_tool(main)
