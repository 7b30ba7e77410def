"""Benchmark harness: launching configurations on netlab, the DeepSpeed peer, result tables."""
