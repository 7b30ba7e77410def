#!/usr/bin/env bash
# One prepared device check on one GPU (tools/gpu_check.py says what it runs and how it judges):
#
#   tools/gpu_check.sh --out DIR [--wheels DIR] [--budget-s 470]   # on the GPU machine
#   tools/gpu_check.sh --dry-run                                    # the plan; no GPU needed
#
# The GPU machines have no network. The one dependency seen missing there is zstandard (the
# data pipeline reads .jsonl.zst); carry its wheel: on a machine with network,
#   python3 -m pip download zstandard --only-binary=:all: -d wheels/
# (for the GPU machine's Python version and platform, e.g. --python-version 3.12
#  --platform manylinux2014_x86_64), put wheels/ in the copied tree and pass --wheels wheels.
# It is installed from that directory only (pip --no-index) before anything imports it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

wheels="" dry=0
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --wheels) wheels="${args[$((i + 1))]:-}" ;;
    --wheels=*) wheels="${args[$i]#--wheels=}" ;;
    --dry-run) dry=1 ;;
  esac
done

if ! "$PYTHON" -c "import zstandard" >/dev/null 2>&1; then
  if [ "$dry" = 1 ]; then
    echo "note: zstandard is not importable here; on the GPU machine pass --wheels DIR holding its wheel"
  elif [ -n "$wheels" ]; then
    if [ ! -d "$wheels" ]; then
      echo "gpu_check.sh: error: --wheels $wheels is not a directory" >&2
      exit 2
    fi
    "$PYTHON" -m pip install --quiet --no-index --find-links "$wheels" zstandard
  else
    echo "gpu_check.sh: error: zstandard is not installed and this machine may have no network:" \
         "carry its wheel and pass --wheels DIR (see the top of tools/gpu_check.sh)" >&2
    exit 2
  fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
exec "$PYTHON" tools/gpu_check.py "$@"
