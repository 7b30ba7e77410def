"""Interoperability: Hugging Face Llama checkpoints in and out, consolidated weight export.

`hf_llama` maps configs, names and tensor layouts; `safetensors_io` reads and writes weight
files without executing code; `model_layout` knows how a full weight is cut into the
tensor-/pipeline-parallel pieces of a megazpp checkpoint; `checkpoint_io` reads a part's
weights of such checkpoints (through `megazpp.checkpoint.reader`, ZeRO shards reassembled by
`megazpp.checkpoint.zero_shards`) and writes weights-only ones, and `consolidate` turns a
checkpoint into full weights.
"""
