# GPU image: NVIDIA's NGC PyTorch (CUDA, NCCL, apex with FusedAdam) plus megazpp.
#   docker build -t megazpp .
#   docker run --gpus all --ipc=host -v $PWD/runs:/workspace/megazpp/runs megazpp [flags]
# Extra arguments go to pretrain_gpt.py through run.sh; NNODES / NODE_RANK / MASTER_ADDR /
# MASTER_PORT / NPROC_PER_NODE (-e ...) launch across nodes (use --network=host).
FROM nvcr.io/nvidia/pytorch:25.01-py3

WORKDIR /workspace/megazpp
# Dependencies first (the base already has torch, triton, numpy, pyyaml, tensorboard);
# the project itself is installed without dependencies so pip never replaces NGC's torch.
RUN python -m pip install --no-cache-dir "sentencepiece>=0.2" "tensorboard>=2.14" \
        "pyyaml>=6.0" "tqdm>=4.60"
COPY . .
RUN python -m pip install --no-cache-dir --no-deps -e .

ENTRYPOINT ["bash", "run.sh"]
