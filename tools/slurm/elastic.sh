#!/usr/bin/env bash
# Submit an elastic two-level job (docs/arch/elastic.md): one lighthouse job and one SLURM job
# per island, each island an ordinary multi-node job that may fail, be requeued or be added
# later without stopping the others.
#
#   mkdir -p logs && bash tools/slurm/elastic.sh ISLANDS MIN_ISLANDS [run.sh / pretrain_gpt.py flags...]
#
# From the checkout's root, on storage every node sees. ELASTIC_DIR (elastic/<job name>) holds
# the lighthouse's address and each island's checkpoints (island<I>). More islands later: run
# again with FIRST_ISLAND=N and LIGHTHOUSE_JOB=<the lighthouse job id> (printed below), which
# submits islands N.. to the running job. Extra sbatch options for the islands: ISLAND_SBATCH
# (e.g. "--nodes=4 --partition=p2").
set -euo pipefail
islands=${1:?usage: elastic.sh ISLANDS MIN_ISLANDS [flags...]}
min_islands=${2:?usage: elastic.sh ISLANDS MIN_ISLANDS [flags...]}
shift 2
name=${JOB_NAME:-megazpp}
dir=${ELASTIC_DIR:-elastic/$name}
file="$dir/lighthouse.addr"
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dir"
first=${FIRST_ISLAND:-0}
lighthouse=${LIGHTHOUSE_JOB:-}
if [ -z "$lighthouse" ]; then
  rm -f "$file"  # a previous job's address
  lighthouse=$(sbatch --parsable --job-name="$name-lighthouse" --export="ALL,LIGHTHOUSE_FILE=$file" \
    "$here/lighthouse.sbatch" "$min_islands")
  echo "elastic.sh: lighthouse job $lighthouse (address in $file)"
fi
for ((i = first; i < first + islands; i++)); do
  # shellcheck disable=SC2086  # ISLAND_SBATCH is a list of sbatch options
  job=$(sbatch --parsable --job-name="$name-island$i" --dependency="after:$lighthouse" ${ISLAND_SBATCH:-} \
    --export="ALL,ISLAND_ID=$i,LIGHTHOUSE_FILE=$file,CKPT_DIR=$dir/island$i" "$here/island.sbatch" \
    --outer-min-islands "$min_islands" "$@")
  echo "elastic.sh: island $i: job $job (checkpoints in $dir/island$i)"
done
