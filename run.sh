#!/usr/bin/env bash
# The main job: `bash run.sh [extra pretrain_gpt.py flags]`, the same command on every node.
#
# 1. installs what is missing (torch 2.13.0, the CPU wheel when there is no GPU; the project);
# 2. says what DATA_DIR (default data/) holds, then builds the sample corpus, the tokenizer and
#    the indexed dataset there if absent (each into a temporary name, renamed when complete, so
#    an interrupted build is redone); a DATA_DIR holding other data is refused, never written;
# 3. launches pretrain_gpt.py with torchrun on every GPU of this node, or one CPU rank.
#    NPROC_PER_NODE larger than the GPUs with --distributed-backend gloo puts several ranks on
#    each GPU (round robin); NCCL is refused there, before any rank starts.
#
# Multi-node: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE become torchrun's
# --nnodes/--node-rank/--rdzv-endpoint/--nproc-per-node; MAX_RESTARTS its --max-restarts
# (default 0); RDZV_TIMEOUT the seconds a node waits for the others (default 600). A
# restarted attempt given --save resumes from that directory's latest complete checkpoint by
# itself (the resume rule: megazpp/training/startup.py, the README).
# CONFIG picks the YAML (default configs/llama_tiny.yaml). Data and logs stay in this checkout
# (data/, runs/, checkpoints/), which must be on storage every node sees for checkpoints.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
CONFIG=${CONFIG:-configs/llama_tiny.yaml}
DATA_DIR=${DATA_DIR:-data}
VOCAB_SIZE=${VOCAB_SIZE:-2048}

has_cuda() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

# The pinned wheel comes from the package registry: the CPU build on the CPU machines this
# project targets, the default (CUDA) build where the registry serves that. The project is
# imported without the working directory, which would find megazpp whether or not it is
# installed, and the tools (python tools/x.py) need it installed.
has_torch() { "$PYTHON" -c "import torch" >/dev/null 2>&1; }
has_project() {
  "$PYTHON" -c "import sys; sys.path.remove(''); import megazpp, sentencepiece, tensorboard, yaml, numpy, matplotlib" \
    >/dev/null 2>&1
}
# Several run.sh start together on one machine (virtual nodes, elastic islands): pip's reinstall
# removes the install before writing it again, so one run's check can fail while another's pip
# runs; under one lock a run re-checks once the other's install is done, and only one installs.
if ! has_torch || ! has_project; then
  exec 9>"${TMPDIR:-/tmp}/megazpp-run-sh-install.lock"
  flock 9
  has_torch || "$PYTHON" -m pip install --quiet torch==2.13.0
  has_project || "$PYTHON" -m pip install --quiet -e .
  exec 9>&-
fi
# Under SLURM (srun, one task per node) NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT and
# NPROC_PER_NODE come from the job unless set (megazpp/launch/slurm.py); on the hosts of a
# hostfile, tools/launch_hosts.sh sets them.
slurm_exports=$("$PYTHON" -m megazpp.launch.slurm)
eval "$slurm_exports"

# --help: run.sh's own variables (with the values this shell gives them), then pretrain_gpt.py's
# flags with CONFIG's values as their defaults, as this command would run them.
usage() {
  cat <<EOF
usage: [VARIABLE=value ...] bash run.sh [pretrain_gpt.py flags]

Builds the sample data into DATA_DIR if absent, checks the configuration once, then starts
pretrain_gpt.py --config CONFIG --data-path DATA_DIR/corpus_text_document
--tokenizer-model DATA_DIR/tokenizer.model [flags] on NPROC_PER_NODE ranks (torchrun).

environment variables (the value each has now):
  CONFIG          the YAML config (${CONFIG}); a DeepSpeed JSON goes in --deepspeed_config FILE
  DATA_DIR        sample data: corpus, tokenizer, indexed dataset (${DATA_DIR})
  VOCAB_SIZE      vocabulary of the sample tokenizer run.sh trains (${VOCAB_SIZE})
  PYTHON          the interpreter (${PYTHON})
  NPROC_PER_NODE  ranks on this node (${NPROC_PER_NODE:-unset: every GPU, or 1 CPU rank})
  NNODES          nodes of the job (${NNODES:-unset: 1})
  NODE_RANK       this node's index, 0 on the first (${NODE_RANK:-unset: 0})
  MASTER_ADDR     node 0's address (${MASTER_ADDR:-unset: 127.0.0.1})
  MASTER_PORT     node 0's rendezvous port (${MASTER_PORT:-unset: a free port on one node, 29500 on several})
  RDZV_TIMEOUT    seconds a node waits for the others (${RDZV_TIMEOUT:-unset: 600})
  MAX_RESTARTS    torchrun restarts of a failed attempt; one given --save resumes (${MAX_RESTARTS:-unset: 0})
  OMP_NUM_THREADS threads per CPU rank (${OMP_NUM_THREADS:-unset: 1 on CPU ranks})
  TMPDIR          where the job's checked config waits for its ranks, removed at the end (${TMPDIR:-unset: /tmp})
  MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_, TORCH_DISABLE_SHARE_RDZV_TCP_STORE: set by run.sh
                  unless given (why: the comments in run.sh)
Under SLURM (srun, one task per node) NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT and
NPROC_PER_NODE come from the job unless set; tools/launch_hosts.sh sets them from a hostfile.

EOF
}
for arg in "$@"; do
  case "$arg" in -h|--help) usage; exec "$PYTHON" pretrain_gpt.py --config "$CONFIG" "$@" ;; esac
done

# The node variables, checked before anything is built or started: one line each, not bash's
# "unbound variable" (NPROC_PER_NODE=abc) or a ZeroDivisionError traceback (0).
need_count() {  # NAME MIN WHAT: $NAME is a whole number >= MIN
  local value=${!1}
  if ! [[ $value =~ ^[0-9]+$ ]] || (( 10#$value < $2 )); then
    echo "run.sh: error: $1 = '$value': expected a whole number >= $2 ($3)" >&2
    exit 2
  fi
  printf -v "$1" '%d' "$((10#$value))"
}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
need_count NNODES 1 "the number of nodes of the job"
need_count NODE_RANK 0 "this node's index, 0 on the first node"
if (( NODE_RANK >= NNODES )); then
  echo "run.sh: error: NODE_RANK = $NODE_RANK: expected 0..$((NNODES - 1)) (NNODES = $NNODES)" >&2
  exit 2
fi
if [ -n "${NPROC_PER_NODE:-}" ]; then
  need_count NPROC_PER_NODE 1 "ranks on this node: GPUs, or CPU processes"
fi

# What DATA_DIR holds and what the job uses; run.sh builds its sample data only into an absent
# or empty directory or its own earlier build (megazpp/preprocess/sample_dir.py), never among other data.
"$PYTHON" -m megazpp.preprocess.sample_dir "$DATA_DIR" "$@"
mkdir -p "$DATA_DIR"
if [ ! -d "$DATA_DIR/corpus" ]; then
  rm -rf "$DATA_DIR/corpus.tmp"
  "$PYTHON" tools/make_sample_corpus.py --out "$DATA_DIR/corpus.tmp"
  mv "$DATA_DIR/corpus.tmp" "$DATA_DIR/corpus"
fi
if [ ! -f "$DATA_DIR/tokenizer.model" ]; then
  rm -f "$DATA_DIR"/tokenizer.tmp.{model,vocab}  # an interrupted rename's leftovers
  "$PYTHON" tools/train_tokenizer.py --input "$DATA_DIR/corpus" --vocab-size "$VOCAB_SIZE" \
    --out "$DATA_DIR/tokenizer.tmp"
  mv "$DATA_DIR/tokenizer.tmp.vocab" "$DATA_DIR/tokenizer.vocab"
  mv "$DATA_DIR/tokenizer.tmp.model" "$DATA_DIR/tokenizer.model"
fi
if [ ! -f "$DATA_DIR/corpus_text_document.idx" ]; then
  # a temp dataset left by an interrupted rename (its shards directory, if any, is resumed)
  rm -f "$DATA_DIR"/corpus.tmp_text_document.{bin,idx,tokenizer.json}
  "$PYTHON" tools/preprocess_data.py --input "$DATA_DIR/corpus" \
    --tokenizer-model "$DATA_DIR/tokenizer.model" --output-prefix "$DATA_DIR/corpus.tmp" \
    --workers 2 --append-eod
  for suffix in tokenizer.json bin idx; do  # the .idx last: its presence means a finished build
    mv "$DATA_DIR/corpus.tmp_text_document.$suffix" "$DATA_DIR/corpus_text_document.$suffix"
  done
fi

if has_cuda && "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  DEFAULT_NPROC=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
else
  DEFAULT_NPROC=1
  # One intra-op thread per CPU rank: on a shared or small machine, oversubscribed OpenMP
  # threads cost far more than the second core gives.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  # glibc malloc: serve large blocks from the heap and keep freed ones, rather than mapping
  # fresh pages for every gathered bucket and faulting them in 4 KiB at a time (a 100 MB copy:
  # 51 ms on fresh pages, 9 ms on reused ones). benchmarks.launch.CPU_RANK_ENV: the same.
  export MALLOC_MMAP_MAX_=${MALLOC_MMAP_MAX_:-0}
  export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-1099511627776}
fi
# torchrun >= 2.4 lets the workers' process group reuse the rendezvous store, which outlives
# a restart: a restarted rank can then read a dead peer's address left by the failed attempt
# and fail with "connectFullMesh ... Connection refused". A fresh store per attempt avoids it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
NPROC_PER_NODE=${NPROC_PER_NODE:-$DEFAULT_NPROC}

TRAIN_ARGS=(--config "$CONFIG" --data-path "$DATA_DIR/corpus_text_document"
            --tokenizer-model "$DATA_DIR/tokenizer.model" "$@")

# Check the whole configuration (which checkpoint it would resume and whether that can start
# it, the memory per rank it needs against this node's, on node 0 that no other job writes
# --save) once per node, before torchrun starts any rank: a refused input is then one line,
# not an error and a launcher traceback per rank. The ranks take what it decided from the
# handoff file (MEGAZPP_CHECKED_RUN) and check nothing again (megazpp/training/startup.py).
HANDOFF=$(mktemp "${TMPDIR:-/tmp}/megazpp-checked-run.XXXXXX")
"$PYTHON" -m megazpp.training.startup --world-size $((NNODES * NPROC_PER_NODE)) \
  --ranks-on-node "$NPROC_PER_NODE" --node-rank "$NODE_RANK" --handoff "$HANDOFF" "${TRAIN_ARGS[@]}" \
  || { status=$?; rm -f "$HANDOFF"; exit "$status"; }
export MEGAZPP_CHECKED_RUN=$HANDOFF

# torchrun behind megazpp.launch.node_launcher: MASTER_PORT unset is a free port on one node
# (29500 on several); RDZV_TIMEOUT (600 s) bounds the wait for node 0 and for every node,
# with a line every 30 s saying what is awaited and a one-line error at the end.
exec "$PYTHON" -m megazpp.launch.node_launcher \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-}" \
  --rdzv-timeout "${RDZV_TIMEOUT:-600}" --max-restarts "${MAX_RESTARTS:-0}" --remove-after "$HANDOFF" \
  pretrain_gpt.py "${TRAIN_ARGS[@]}"
