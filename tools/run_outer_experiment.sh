#!/usr/bin/env bash
# The two-level quality experiment (issue 28): the LoCo experiment's model, data and schedule
# (configs/experiments/loco/fp32.yaml: ZeRO-2 on 4 CPU ranks as 2 virtual nodes x 2, 600 steps)
# trained synchronously and as 2 islands x 2 ranks with outer steps every H inner steps (bf16
# outer gradients, H = 1, 5, 10, 25, 50), and with int4 outer gradients at H = 25 with and
# without error feedback; then benchmarks.outer_sweep's table and plot (final losses against
# inter-node bytes, mean over seeds). Every run reads the same global batches: each island
# takes its half of each one, so the runs are at equal tokens.
#
# The outer optimizer of the sweep is plain averaging (outer lr 1, momentum 0): on seed 4, which
# no reported run uses, it beat DiLoCo's lr 0.7 / Nesterov 0.9 and the other settings tried
# (docs/benchmarks.md, "Two-level training: quality"); the `*_diloco` runs keep DiLoCo's.
#
#   tools/run_outer_experiment.sh            # the whole experiment, in priority order
#   tools/run_outer_experiment.sh --smoke    # a tiny end-to-end check of the same pipeline
#   ONLY="sync h10" SEEDS="1" tools/run_outer_experiment.sh   # a subset
#
# Runs go in priority order (the runs the target names over seeds 1-3 first, then the int4
# ablation, then the rest of the sweep), so a stopped experiment has the most useful ones. A
# finished run leaves $OUT/seed$S/$RUN/DONE and is not run again; an unfinished one is removed
# and rerun. While the file $OUT/PAUSE exists no new run starts (for a quiet machine between
# runs). Results: $OUT/seed$S/$RUN (TensorBoard), $OUT/sweep.md, $OUT/sweep.png and
# $OUT/sweep_curves.png; OUT is runs/outer.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
OUT=${OUT:-runs/outer}
BASE=configs/experiments/loco/fp32.yaml
EXTRA=()
declare -A FLAGS=(
  [sync]=""
  [h1]="--outer-sync-every 1"
  [h5]="--outer-sync-every 5"
  [h10]="--outer-sync-every 10"
  [h25]="--outer-sync-every 25"
  [h50]="--outer-sync-every 50"
  [h25_int4]="--outer-sync-every 25 --outer-quantize int4"
  [h25_int4_noef]="--outer-sync-every 25 --outer-quantize int4 --no-outer-error-feedback"
  [h1_diloco]="--outer-sync-every 1 --outer-lr 0.7 --outer-momentum 0.9"
  [h10_diloco]="--outer-sync-every 10 --outer-lr 0.7 --outer-momentum 0.9"
  [h25_diloco]="--outer-sync-every 25 --outer-lr 0.7 --outer-momentum 0.9"
)
TWO_LEVEL="--outer-algorithm diloco --outer-quantize bf16 --outer-lr 1.0 --outer-momentum 0"  # later flags win
QUEUE=(1:sync 1:h10 1:h25 2:sync 2:h10 2:h25 3:sync 3:h10 3:h25
       1:h25_int4 1:h25_int4_noef 2:h25_int4 2:h25_int4_noef 3:h25_int4 3:h25_int4_noef
       1:h1 1:h5 1:h50 2:h1 2:h5 2:h50 3:h1 3:h5 3:h50
       1:h1_diloco 1:h10_diloco 1:h25_diloco)
case "${1:-}" in
  "") ;;
  --smoke)
    OUT=runs/outer_smoke
    QUEUE=(1:sync 1:h5 1:h25_int4)
    EXTRA=(--num-layers 2 --hidden-size 64 --train-iters 10 --lr-warmup-iters 2
           --eval-interval 5 --eval-iters 1 --log-interval 1)
    FLAGS[h25_int4]="--outer-sync-every 5 --outer-quantize int4"
    ;;
  *) echo "usage: $0 [--smoke]" >&2; exit 2 ;;
esac

free_port() {
  "$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

for item in "${QUEUE[@]}"; do
  seed=${item%%:*} run=${item#*:}
  [[ -n "${SEEDS:-}" && " $SEEDS " != *" $seed "* ]] && continue
  [[ -n "${ONLY:-}" && " $ONLY " != *" $run "* ]] && continue
  dir="$OUT/seed$seed/$run"
  [[ -f "$dir/DONE" ]] && continue
  while [[ -e "$OUT/PAUSE" ]]; do sleep 10; done
  rm -rf "$dir"
  flags=()
  [[ $run != sync ]] && read -r -a flags <<< "$TWO_LEVEL ${FLAGS[$run]}"
  echo "== $run, seed $seed =="
  CONFIG="$BASE" NPROC_PER_NODE=4 MASTER_PORT=$(free_port) bash run.sh \
    --tensorboard-dir "$dir" --seed "$seed" --init-seed "$seed" "${flags[@]}" "${EXTRA[@]}"
  touch "$dir/DONE"
done

"$PYTHON" -m benchmarks.outer_sweep "$OUT" --out "$OUT/sweep.md" --plot "$OUT/sweep.png"
