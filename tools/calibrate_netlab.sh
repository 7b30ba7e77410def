#!/usr/bin/env bash
# Calibrate the planner on netlab: 2 nodes x 2 CPU ranks joined by a link shaped to RATE, every
# strategy of tools/calibrate_planner.py trained and timed, predicted vs measured printed by
# node 0. Needs root (network namespaces) and a quiet machine.
#
#   sudo tools/calibrate_netlab.sh 1gbit [calibrate_planner.py flags...]
#   sudo tools/calibrate_netlab.sh 10gbit --breakdown
#   sudo TOOL=tools/bench_netlab_check.py tools/calibrate_netlab.sh 1gbit runs/bench28/1gbit.json
#
# TOOL (default tools/calibrate_planner.py) is the script the ranks run: tools/bench_netlab_check.py
# predicts the two-level rows of a tools/bench_netlab.py results file measured at RATE.
#
# The ranks start as every CPU rank does (run.sh, benchmarks.launch.CPU_RANK_ENV): one
# OpenMP thread, glibc malloc keeping freed large blocks. The link's rate is probed, not
# given, unless a flag says --inter-gbit. netlab is taken down on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:?usage: $0 RATE [arguments of TOOL...]}
TOOL=${TOOL:-tools/calibrate_planner.py}
shift
export NETLAB_PREFIX=${NETLAB_PREFIX:-mzcal} NETLAB_SUBNET=${NETLAB_SUBNET:-10.79.0}
PORT=${PORT:-29556}
LOGS=${LOGS:-runs/calibrate_$RATE}
mkdir -p "$LOGS"
trap 'tools/netlab.sh down >/dev/null' EXIT
tools/netlab.sh up 2 "$RATE" 0
MASTER=$(tools/netlab.sh addr 0)
pids=()
for node in 0 1; do
  tools/netlab.sh run "$node" env OMP_NUM_THREADS=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \
    "${PYTHON:-python3}" -m torch.distributed.run --nnodes 2 --node-rank "$node" --nproc-per-node 2 \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER:$PORT" "$TOOL" "$@" \
    > "$LOGS/node$node.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
grep -v -e "Warning" -e "warn(" -e "socket.cpp" "$LOGS/node0.log" | sed -n '/^Llama/,$p'
[ "$status" -eq 0 ] || { echo "calibration failed (exit $status); logs in $LOGS/" >&2; exit "$status"; }
