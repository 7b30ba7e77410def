#!/usr/bin/env bash
# The LoCo experiment: the same small Llama, seed and data order trained three ways on 4 CPU
# ranks (2 virtual nodes x 2) with ZeRO-2: full-precision gradient reduction, qgZ int4, and
# qgZ int4 + LoCo error feedback, once per seed (the same seeds for all three); then
# tools/compare_runs.py and the gap LoCo closes, as the mean over seeds.
#
#   tools/run_loco_experiment.sh            # the experiment (configs/experiments/loco/)
#   tools/run_loco_experiment.sh --smoke    # a tiny end-to-end check of the same pipeline
#   SEEDS="1 2 3 4" tools/run_loco_experiment.sh   # other seeds (default: 1 2 3)
#
# A seed sets both the data order (--seed) and the initialisation (--init-seed). Each run goes
# through run.sh, the main job, which also builds the sample corpus, tokenizer and indexed
# dataset under $DATA_DIR (default data/) when they are missing; each on a free port. Results:
# $OUT/seed$S/{fp32,qgz_int4,qgz_int4_loco} (TensorBoard), $OUT/compare/{loss.png,
# throughput.png,summary.md,loco_gap.md,loco_seeds.png}; OUT is runs/loco (runs/loco_smoke with --smoke). A
# run's old TensorBoard directory is removed first, so curves never mix two attempts.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
SEEDS=${SEEDS:-1 2 3}
OUT=runs/loco
EXTRA=()
case "${1:-}" in
  "") ;;
  --smoke)
    OUT=runs/loco_smoke
    SEEDS=${SEEDS%% *}
    EXTRA=(--num-layers 2 --hidden-size 64 --train-iters 6 --lr-warmup-iters 2
           --eval-interval 3 --eval-iters 1 --log-interval 1)
    ;;
  *) echo "usage: $0 [--smoke]" >&2; exit 2 ;;
esac

free_port() {
  "$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

RUNS=(fp32 qgz_int4 qgz_int4_loco)
declare -A DIRS LABELS
for seed in $SEEDS; do
  for run in "${RUNS[@]}"; do
    dir="$OUT/seed$seed/$run"
    rm -rf "$dir"
    echo "== $run, seed $seed =="
    CONFIG="configs/experiments/loco/$run.yaml" NPROC_PER_NODE=4 MASTER_PORT=$(free_port) bash run.sh \
      --tensorboard-dir "$dir" --seed "$seed" --init-seed "$seed" "${EXTRA[@]}"
    DIRS[$run]+="${DIRS[$run]:+,}$dir"
    LABELS[$run]+="${LABELS[$run]:+,}$run/s$seed"
  done
done

IFS=, read -r -a ALL <<< "${DIRS[fp32]},${DIRS[qgz_int4]},${DIRS[qgz_int4_loco]}"
"$PYTHON" tools/compare_runs.py "${ALL[@]}" \
  --labels "${LABELS[fp32]},${LABELS[qgz_int4]},${LABELS[qgz_int4_loco]}" --out "$OUT/compare"
"$PYTHON" -m benchmarks.loco_gap "${DIRS[fp32]}" "${DIRS[qgz_int4]}" "${DIRS[qgz_int4_loco]}" \
  --train-window 100 --out "$OUT/compare/loco_gap.md" --plot "$OUT/compare/loco_seeds.png"
