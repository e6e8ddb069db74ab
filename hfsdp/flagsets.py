"""Megatron flags that several of our tools give a run: the max-pool double buffer and the
full-iteration CUDA graph. The benchmark's configurations (hfsdp/bench/configs.py) and the main job
(hfsdp/main_job/) both build on these; neither imports the other.
"""

from __future__ import annotations

MAXPOOL_FLAG = "--megatron-fsdp-max-pool-double-buffer"
LANES_FLAG = "--megatron-fsdp-max-pool-lanes"
# The max-pool double buffer as a run is given it.
MAXPOOL_FLAGS = ("--fsdp-double-buffer", MAXPOOL_FLAG)
# Full-iteration CUDA graph: Megatron's default 3 eager warm-up steps, capture on step 4.
GRAPH_FLAGS = ("--cuda-graph-impl", "full_iteration")
GRAPH_WARMUP_STEPS = 3
