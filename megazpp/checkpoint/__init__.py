"""Checkpoints: the format and its atomic save and verified load, the resume rule and what a
run starts from (`manager.py`), the one-writer lock, RNG state, adapters-only checkpoints'
frozen base, and resuming ZeRO state under another data-parallel layout (`reshard.py`,
`zero_shards.py`). Below the training loop, above the engines whose state it holds.
"""
