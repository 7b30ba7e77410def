"""The prepared one-GPU device check behind `tools/gpu_check.sh` (the tool says what it runs and
how it judges): its settings and bounds, running its commands, reading their output, its steps
and its report, one module each."""
