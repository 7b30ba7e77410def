#!/usr/bin/env bash
# The two-level quality experiments (issues 28 and 37): an experiment of benchmarks/outer_plan.py
# (its config, its runs' flags, its queue in priority order) trained through run.sh on 4 CPU
# ranks as 2 virtual nodes x 2 (synchronous ZeRO-2 over all 4, or 2 islands of 2), then
# benchmarks.outer_sweep's table and plots.
#
#   tools/run_outer_experiment.sh defaults600          # an experiment (list: python -m benchmarks.outer_plan list)
#   tools/run_outer_experiment.sh --smoke defaults600  # a tiny end-to-end check of the same pipeline (3 runs)
#   ONLY="sync defaults" SEEDS="4" tools/run_outer_experiment.sh defaults600   # a subset
#   nice -n 19 tools/run_outer_experiment.sh tune3000 &   # in the background, below other work
#
# Resumable: a finished run leaves $OUT/seed$S/$RUN/DONE and is not run again; an unfinished one
# resumes from its last checkpoint ($dir/ckpt, every 500 steps; deleted once the run is done),
# or starts over when it has none. While the file $OUT/PAUSE exists no new run starts (a quiet
# machine between runs). Each run's directory records the commit that trained it (COMMIT).
# Results: $OUT/seed$S/$RUN (TensorBoard), $OUT/sweep.md, $OUT/sweep.png, $OUT/sweep_curves.png;
# OUT is runs/outer/NAME.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
usage() {
  echo "usage: $0 [--smoke] EXPERIMENT (one of: $("$PYTHON" -m benchmarks.outer_plan names))" >&2
  exit 2
}
smoke=0
[[ "${1:-}" == --smoke ]] && { smoke=1; shift; }
[[ $# -eq 1 && "$1" != -* ]] || usage
name=$1
plan=$("$PYTHON" -m benchmarks.outer_plan queue "$name" 2>/dev/null) || usage
OUT=${OUT:-runs/outer/$name}
EXTRA=()
if ((smoke)); then
  OUT=runs/outer_smoke/$name
  EXTRA=(--num-layers 2 --hidden-size 64 --train-iters 10 --lr-warmup-iters 2 --eval-interval 5 --eval-iters 1
         --log-interval 1)
fi
config=$(head -n 1 <<< "$plan")
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)

free_port() {
  "$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

started=0
while read -r seed run flags; do
  [[ -n "${SEEDS:-}" && " $SEEDS " != *" $seed "* ]] && continue
  [[ -n "${ONLY:-}" && " $ONLY " != *" $run "* ]] && continue
  if ((smoke)); then
    ((started++ < 3)) || break
    [[ " $flags " == *" --outer-algorithm "* ]] && flags+=" --outer-sync-every 5"  # H within 10 steps
  fi
  dir="$OUT/seed$seed/$run"
  [[ -f "$dir/DONE" ]] && continue
  while [[ -e "$OUT/PAUSE" ]]; do sleep 10; done
  [[ -d "$dir/ckpt" ]] || rm -rf "$dir"
  mkdir -p "$dir"
  echo "$commit" >> "$dir/COMMIT"
  read -r -a argv <<< "$flags"
  echo "== $name: $run, seed $seed =="
  CONFIG="$config" NPROC_PER_NODE=4 MASTER_PORT=$(free_port) bash run.sh \
    --tensorboard-dir "$dir" --save "$dir/ckpt" --save-interval 500 --seed "$seed" --init-seed "$seed" \
    "${argv[@]}" "${EXTRA[@]}"
  rm -rf "$dir/ckpt"
  touch "$dir/DONE"
done < <(tail -n +2 <<< "$plan")

"$PYTHON" -m benchmarks.outer_sweep "$OUT" --experiment "$name" --out "$OUT/sweep.md" --plot "$OUT/sweep.png"
