"""Interoperability: Hugging Face Llama checkpoints in and out, consolidated weight export.

`hf_llama` maps configs, names and tensor layouts; `safetensors_io` reads and writes weight
files without executing code; `model_layout` knows how a full weight is cut into the
tensor-/pipeline-parallel pieces of a megazpp checkpoint; `checkpoint_io` reads such
checkpoints (and writes weights-only ones), `zero_shards` reassembles ZeRO shards from all
data-parallel ranks, `consolidate` turns a checkpoint into full weights, and `reshard`
resumes a ZeRO checkpoint under another data-parallel size or PaRO strategy.
"""
