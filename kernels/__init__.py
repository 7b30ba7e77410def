"""Triton quantization kernels, each with a pure-torch reference used on CPU and as the test oracle."""
