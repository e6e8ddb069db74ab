# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Where reserved GPU memory sits around a full-iteration CUDA-graph capture.

[Note: reserved memory under full-iteration graphs]
A captured step keeps its activations in the graph's private memory pool for the life of the
graph; eager code that runs between replays (the optimizer step, logging) allocates from the
ordinary per-stream pools and cannot reuse that memory. Blocks cached for a stream serve only
that stream. So a graphed run can reserve more than an eager one although each step needs the
same tensors. ``log_capture_memory`` logs, once before capture, once after, and once after
the first graphed step has finished (its optimizer step included), how much the caching
allocator reserved in each place and how much of that is in use: graph pools, the default
stream, the capture stream (the warm-up cache), other streams (communication side streams), plus
the allocator's peaks. Reserved minus in-use is cached free memory. On the capture stream, in
the "before capture" line, it all sits in segments that a live block pins: the last warm-up
step's ``empty_cache`` already returned the rest, and ``empty_cache`` cannot return these. The
other places may still hold the last optimizer step's cache there, which ``torch.cuda.graph``
frees right after the line. In a graph pool, "in use" counts only
tensors alive between replays; every replay uses the whole pool. The numbers come from
``torch.cuda.memory_snapshot()`` (no allocation history is recorded).
"""

import logging
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)

MIB = 2**20
_DEFAULT_POOL = (0, 0)  # segment_pool_id of the ordinary (non-graph) pools


def memory_by_place(streams: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """(reserved, in-use) bytes per place: 'graph pools', each named stream, 'other streams'.

    ``streams`` maps a label to a raw ``cudaStream_t`` value (``Stream.cuda_stream``).
    """
    by_handle = {handle: name for name, handle in streams.items()}
    places = ["graph pools", *streams, "other streams"]
    reserved = dict.fromkeys(places, 0)
    in_use = dict.fromkeys(places, 0)
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", _DEFAULT_POOL)) != _DEFAULT_POOL:
            place = "graph pools"
        else:
            place = by_handle.get(segment["stream"], "other streams")
        reserved[place] += segment["total_size"]
        in_use[place] += segment["allocated_size"]
    return {place: (reserved[place], in_use[place]) for place in places}


def log_capture_memory(stage: str, point: str, capture_stream: "torch.cuda.Stream") -> None:
    """One INFO line: reserved memory by place at ``point`` of the ``stage`` capture."""
    if not logger.isEnabledFor(logging.INFO):
        return  # a snapshot walks every segment: skip it when nobody reads the line
    places = memory_by_place({
        "default stream": torch.cuda.default_stream().cuda_stream,
        "capture stream": capture_stream.cuda_stream,
    })
    parts = " | ".join(
        f"{name} {res / MIB:,.0f} ({used / MIB:,.0f} in use)" for name, (res, used) in places.items()
    )
    logger.info(
        f"full-iteration CUDA graph ({stage}) {point}: reserved "
        f"{torch.cuda.memory_reserved() / MIB:,.0f} MiB [{parts}], allocated "
        f"{torch.cuda.memory_allocated() / MIB:,.0f} MiB, peak reserved "
        f"{torch.cuda.max_memory_reserved() / MIB:,.0f} MiB, peak allocated "
        f"{torch.cuda.max_memory_allocated() / MIB:,.0f} MiB"
    )
