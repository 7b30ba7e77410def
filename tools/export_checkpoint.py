#!/usr/bin/env python3
"""Writes one safetensors file of full weights from any megazpp checkpoint.

  export_checkpoint.py --load CKPT --out FILE.safetensors [--dtype D] [--masters]
                       [--config FILE [flags...]]

The tensor- and pipeline-parallel pieces are glued back into the single-process model's
tensors, keyed by megazpp's parameter names; the model config is stored in the file's
metadata (key "megazpp_model_config", JSON). The model config comes from the checkpoint
(training and imports record it); a --config given after the options must agree with it.
An adapters-only checkpoint's frozen weights come from the base it records (checked unchanged).
An existing FILE is never overwritten (the same rule as convert_hf.py export).
"""

from __future__ import annotations

import argparse

from megazpp.cli import add_out_flag, run_tool
from megazpp.config.load import load_config
from megazpp.interop.consolidate import DTYPES, parse_dtype, two_level_note
from megazpp.interop.convert import export_safetensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load", required=True, help="save directory (its latest) or iter_N dir")
    add_out_flag(parser, required=True, help="the .safetensors file to write (must not exist)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: as stored")
    parser.add_argument("--masters", action="store_true", help="export the fp32 master weights of a bf16/fp16 run")
    args, rest = parser.parse_known_args(argv)
    cfg = load_config(rest).model if rest else None
    out = export_safetensors(args.load, args.out, cfg=cfg, dtype=parse_dtype(args.dtype), masters=args.masters)
    print(f"wrote {out}")
    note = two_level_note(args.load)
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    run_tool(main)
