"""Flags the CUDA-graph argument tests share: a tiny Megatron-FSDP model, and full-iteration graphs."""

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --bf16 --lr 1e-4 --train-iters 2 "
    "--ckpt-format fsdp_dtensor --no-check-for-nan-in-loss-and-grad "
    "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
    "--use-distributed-optimizer"
).split()
FULL = "--cuda-graph-impl full_iteration".split()
