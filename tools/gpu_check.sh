#!/usr/bin/env bash
# One prepared device check on one GPU (tools/gpu_check.py says what it runs and how it judges):
#
#   tools/gpu_check.sh --out DIR [--wheels DIR] [--budget-s 470]   # on the GPU machine
#   tools/gpu_check.sh --dry-run                                    # the plan; no GPU needed
#
# The GPU machines have no network. Two dependencies are missing there: zstandard (the data
# pipeline reads .jsonl.zst) and torchft (elastic islands' membership, step elastic) with its
# OpenTelemetry requirements; carry their wheels (about 10 MB): on a machine with network,
#   W="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64"
#   python3 -m pip download $W -d wheels/ zstandard opentelemetry-api opentelemetry-sdk \
#     opentelemetry-exporter-otlp-proto-http
#   python3 -m pip download $W -d wheels/ --no-deps torchft==0.2.0   # --no-deps: not torch
# (for the GPU machine's Python version and platform), put wheels/ in the copied tree and pass
# --wheels wheels. What is missing is installed from that directory only (pip --no-index; torch
# is the machine's own) before anything imports it.
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

missing=()
for module in zstandard torchft; do
  "$PYTHON" -c "import $module" >/dev/null 2>&1 || missing+=("$module")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$dry" = 1 ]; then
    echo "note: ${missing[*]} not importable here; on the GPU machine pass --wheels DIR holding their wheels"
  elif [ -n "$wheels" ]; then
    if [ ! -d "$wheels" ]; then
      echo "gpu_check.sh: error: --wheels $wheels is not a directory" >&2
      exit 2
    fi
    "$PYTHON" -m pip install --quiet --no-index --find-links "$wheels" "${missing[@]}"
  else
    echo "gpu_check.sh: error: ${missing[*]} not installed and this machine may have no network:" \
         "carry their wheels and pass --wheels DIR (see the top of tools/gpu_check.sh)" >&2
    exit 2
  fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
exec "$PYTHON" tools/gpu_check.py "$@"
