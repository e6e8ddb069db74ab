# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Stream discipline for the eager warm-up steps of full-iteration CUDA graphs.

[Note: warm-up on the capture stream]
``FullCudaGraphWrapper`` runs ``cuda_graph_warmup_steps`` eager iterations, then captures
one iteration on a dedicated capture stream. If the eager iterations run on the default
stream, autograd nodes built then (AccumulateGrad on Megatron-FSDP's parameters, the nodes
around its all-gather / reduce-scatter side streams) remember that stream. During capture
the autograd engine then orders the capturing stream against the remembered one, which is
not capturing, and the capture dies: ``cudaErrorStreamCaptureImplicit`` ("operation would
make the legacy stream depend on a capturing blocking stream") or
``cudaErrorStreamCaptureIsolation``.

Two remedies exist and we apply both:

* PyTorch builds with ``torch.autograd.graph.set_override_stale_capture_stream`` let
  autograd redirect a stale stream onto the capturing one (enabled right before capture,
  :func:`enable_stale_capture_stream_override`).
* The warm-up the CUDA-graph documentation prescribes for every torch: run the eager
  iterations on the capture stream itself. Nodes then remember the stream that later
  captures, and there is nothing stale to redirect. This works on builds without the
  override (torch 2.11), and it is what we run everywhere, so the path exercised on our
  GPU machines is the path users get on any torch.

Ordering: the capture stream first waits for the work already queued on the caller's
stream (data copied into the static buffers, the previous optimizer step), and the
caller's stream waits for the warm-up before anything after it (the optimizer step, loss
reporting) runs. Megatron-FSDP synchronises its side streams against "the current stream",
so inside the context it orders itself against the capture stream.

Memory: the activations a warm-up step frees stay cached for the capture stream, where the
caller's stream cannot reuse them; the optimizer step that follows on the caller's stream would
then reserve its own memory beside that cache, a peak eager training never has (the capture
memory report shows both). So after each warm-up step the context empties the allocator's cache: a
device-wide synchronisation and a cudaFree per cached segment, in the few eager steps only.
``torch.cuda.graph`` empties it again right before capture.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch

logger = logging.getLogger(__name__)


@contextmanager
def warmup_on_capture_stream(capture_stream: Optional["torch.cuda.Stream"]) -> Iterator[None]:
    """Run the body on ``capture_stream``, ordered after and before the caller's stream, then
    hand the memory the body cached for that stream back (see the module's Note).

    ``None`` (no CUDA, or a caller that opts out) runs the body unchanged.
    """
    if capture_stream is None:
        yield
        return
    caller = torch.cuda.current_stream()
    capture_stream.wait_stream(caller)
    with torch.cuda.stream(capture_stream):
        yield
    caller.wait_stream(capture_stream)
    torch.cuda.empty_cache()


# pytorch/pytorch#180090 added the override; older torch has no way to opt in.
_STALE_STREAM_OVERRIDE_FEATURE = (
    "torch.autograd.graph.set_override_stale_capture_stream (pytorch/pytorch#180090)"
)
_warned_missing_stale_stream_override = False


def enable_stale_capture_stream_override() -> bool:
    """Let autograd redirect stale non-capturing streams onto the capture stream.

    Eager warmup iterations run backward on the default stream, and autograd nodes
    (e.g. AccumulateGrad on Megatron-FSDP params, nodes around its side streams) cache
    that stream. During full-iteration capture the engine would then make the capture
    stream wait on a stale, non-capturing stream and invalidate the capture
    (cudaErrorStreamCaptureIsolation). The override is process-global and is left on.

    Returns True when the override was enabled. When the running torch lacks the API,
    logs one INFO line per process naming the missing feature and returns False.
    """
    global _warned_missing_stale_stream_override
    setter = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    if setter is not None:
        setter(True)
        return True
    if not _warned_missing_stale_stream_override:
        _warned_missing_stale_stream_override = True
        # Not needed by FullCudaGraphWrapper: its warm-up ran on the capture stream.
        logger.info(
            f"torch {torch.__version__} lacks {_STALE_STREAM_OVERRIDE_FEATURE}; not needed "
            "here: the eager warm-up steps ran on the capture stream, so autograd nodes "
            "remember that stream, not the default one (full_cuda_graph_warmup)."
        )
    return False
