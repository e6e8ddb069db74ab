# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""After a full-iteration capture: Megatron-FSDP max-pool home misses become fatal.

A home miss after capture means the graph replays against a buffer group that now holds another
unit (a stale pointer; [Note: double buffer] in megatron_fsdp/double_buffer/__init__.py, failure
modes: home drift).
"""

import logging
import sys

logger = logging.getLogger(__name__)

# The module whose allocators this acts on. It is looked up, never imported: no max-pool
# allocator can exist unless Megatron-FSDP imported it, and a graph without Megatron-FSDP
# should not load it.
MAX_POOL_MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.allocator"

_logged_strict_max_pool_homes = False


def make_max_pool_homes_strict(model) -> int:
    """After a capture, make Megatron-FSDP max-pool home misses fatal; returns the count.

    A home miss after capture means the graph replays against a buffer group that now holds
    another unit (stale pointer). Public so a training loop capturing by other means can
    call it too. Logs once per process.
    """
    global _logged_strict_max_pool_homes
    maxpool = sys.modules.get(MAX_POOL_MODULE)
    if maxpool is None:
        return 0
    allocators = maxpool.set_fail_on_home_miss(model)
    if allocators and not _logged_strict_max_pool_homes:
        _logged_strict_max_pool_homes = True
        logger.info(
            f"CUDA graph captured: {len(allocators)} Megatron-FSDP max-pool allocator(s) "
            f"({', '.join(a.name for a in allocators)}) now fail on a home miss"
        )
    return len(allocators)
