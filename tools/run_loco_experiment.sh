#!/usr/bin/env bash
# The LoCo experiment: the same small Llama, seed and data order trained three ways on 4 CPU
# ranks (2 virtual nodes x 2) with ZeRO-2: full-precision gradient reduction, qgZ int4, and
# qgZ int4 + LoCo error feedback; then tools/compare_runs.py and the gap LoCo closes.
#
#   tools/run_loco_experiment.sh            # the experiment (configs/experiments/loco/)
#   tools/run_loco_experiment.sh --smoke    # a tiny end-to-end check of the same pipeline
#
# Each run goes through run.sh, the main job, which also builds the sample corpus, tokenizer
# and indexed dataset under $DATA_DIR (default data/) when they are missing. Results:
# $OUT/{fp32,qgz_int4,qgz_int4_loco} (TensorBoard), $OUT/compare/{loss.png,throughput.png,
# summary.md,loco_gap.md}; OUT is runs/loco (runs/loco_smoke with --smoke). A run's old
# TensorBoard directory is removed first, so curves never mix two attempts.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
OUT=runs/loco
EXTRA=()
case "${1:-}" in
  "") ;;
  --smoke)
    OUT=runs/loco_smoke
    EXTRA=(--num-layers 2 --hidden-size 64 --train-iters 6 --lr-warmup-iters 2
           --eval-interval 3 --eval-iters 1 --log-interval 1)
    ;;
  *) echo "usage: $0 [--smoke]" >&2; exit 2 ;;
esac

for run in fp32 qgz_int4 qgz_int4_loco; do
  rm -rf "$OUT/$run"
  echo "== $run =="
  CONFIG="configs/experiments/loco/$run.yaml" NPROC_PER_NODE=4 bash run.sh \
    --tensorboard-dir "$OUT/$run" "${EXTRA[@]}"
done

"$PYTHON" tools/compare_runs.py "$OUT/fp32" "$OUT/qgz_int4" "$OUT/qgz_int4_loco" \
  --labels fp32,qgz_int4,qgz_int4_loco --out "$OUT/compare"
"$PYTHON" -m megazpp.bench.loco_gap "$OUT/fp32" "$OUT/qgz_int4" "$OUT/qgz_int4_loco" \
  --out "$OUT/compare/loco_gap.md"
