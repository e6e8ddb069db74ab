"""Gradient buffers whose data-parallel group is one rank.

[Note: one-rank gradient groups]
A Megatron-FSDP gradient buffer whose data-parallel group has a single rank is never sharded:
expert parameters when expert parallelism spans the data-parallel group (EP = DP, so each expert
data-parallel group is one rank), and every parameter at DP = 1. Its parameters' main grads are
views of the persistent buffer, so micro-batches accumulate in place. A sharded buffer instead
hands each micro-batch a fresh bucket, reduce-scatters it and adds the shard to the buffer; the
sharded strategies (``optim_grads``, ``optim_grads_params``) therefore reduce after every
micro-batch. Applied to the accumulated one-rank buffer, that per-micro-batch reduction is wrong:

* the pre-scale (``gradient_scaling_factor``, 1/DP) multiplies the whole buffer each time, so
  micro-batch k of n is scaled n - k + 1 times;
* with a communication dtype other than the buffer's (``--grad-reduce-in-bf16`` over fp32 main
  grads), the buffer is copied, scaled, reduced over one rank and then *added* back onto itself:
  the buffer becomes (1 + 1/DP) times itself, once per micro-batch, instead of 1/DP times;
* TE's fused weight-gradient accumulation overwrites ``main_grad`` (``overwrite_main_grad``,
  right for a fresh bucket), discarding the earlier micro-batches.

Invariants kept here:

1. A one-rank buffer is reduced once per optimization cycle: at the end of the last
   micro-batch's backward (the root post-backward hook) when the caller marks it (``no_sync``,
   as Megatron's schedules do) or syncs every micro-batch (``model_auto_sync``), else in
   ``finish_grad_sync`` (``HeldGrads``). A one-rank reduction exchanges nothing, so holding it
   to the end of the backward hides no communication.
2. Its reduction is the pre-scale alone, in place and in the buffer's dtype (``scale_alone``): a
   group of one has nothing to exchange, so no collective runs and no communication copy is
   made. SUM and AVG over one rank are the identity; only a scaling factor (when
   ``average_in_collective`` is off) changes values, exactly as the multi-rank path scales.
3. Weight-gradient kernels add into a one-rank buffer, which holds the earlier micro-batches
   (``overwrites_main_grad``); a sharded bucket, fresh per micro-batch, is still overwritten.
4. First writes (``FirstWrites``, when the owner turns them on): ``zero_grad`` does not fill a
   one-rank buffer with zeros each cycle. It marks the buffer's parameters fresh instead; a
   parameter's first gradient write of the cycle overwrites (the fused weight-gradient GEMM's
   ``overwrite_main_grad``, ``copy_`` instead of ``add_`` for an autograd gradient) and clears
   the mark, later micro-batches add. A parameter still fresh when its buffer is reduced got
   no gradient this cycle and is zeroed then. The buffer is filled once, at its first
   ``zero_grad``, so padding between parameters is zero and stays zero. Values are those of the
   fill: ``0 + g`` is ``g``, and ``accumulate`` only sets the GEMM's beta.

   TE reads ``overwrite_main_grad`` when a layer's forward runs, so this holds only where each
   micro-batch's forward of a parameter follows the previous micro-batch's backward of it: no
   pipeline schedule (warm-up forwards run ahead of backwards), no delayed weight gradients, no
   overlapped expert-parallel forward and backward. The owner decides from its configuration
   (``first_write_refusal``); elsewhere the fill stays. An overwriting kernel must write every
   element of ``main_grad``, an expert with no tokens included: the contract upstream's sharded
   buckets (fresh per micro-batch, stale bytes) already rely on.

5. Batched writes (``GradWrites``): the autograd gradients written into one-rank buffers
   (parameters the fused weight-gradient GEMMs do not write: norms, biases, Mamba's small
   parameters, routers) are queued and written together at the end of the backward (the root
   post-backward hook, and ``finish_grad_sync`` before it reduces), before the reduction that
   reads them (1): ``copy_all`` for the first writes, ``add_all`` for the rest
   (foreach_copy.py), instead of one launch a parameter. Only held parameters are queued
   (``HeldGrads.holds``): any other unsharded buffer (``no_shard`` and ``optim`` at DP > 1,
   hybrid FSDP) may be reduced right after its hook, so its writes are done at once. Every value
   is that of the per-parameter ``copy_`` / ``add_``: the queued main grads are disjoint views,
   and a main grad already queued is written before it is queued again. The queue holds the
   gradients it has not written: a gradient of ``GradWrites.LARGE`` elements or more is written
   at once (its launch is not the cost), and the queue is written whenever it holds more than
   ``GradWrites.CAP_BYTES`` (counting the scratch an add widens into). Streams: a hook runs on
   the stream that produced its gradient; the queue holds one stream's writes (another stream's
   write flushes it first) and writes them on that stream, and the caller's stream then waits
   for it, so each write is ordered as the per-parameter one was, and a gradient is freed on the
   stream that made it. ``zero_grad`` discards what an interrupted backward left.

Hybrid FSDP (an outer data-parallel group) keeps upstream's path: its outer reduction runs on the
last micro-batch only, and a one-rank inner group is not special-cased there.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from typing import Any

import torch

from .foreach_copy import PER_PARAM_GRAD_WRITES_ENV, add_all, copy_all

# Diagnostic switch: "1" keeps upstream's per-cycle zero fill (first writes off), for comparisons.
ZERO_GRAD_FILL_ENV = "HFSDP_ZERO_GRAD_FILL"


def reduces_alone(gbuf: Any, use_hybrid_fsdp: bool) -> bool:
    """Whether ``gbuf`` is an unsharded gradient buffer reduced over a one-rank group (see the
    note), outside hybrid FSDP."""
    if use_hybrid_fsdp or gbuf is None or gbuf.is_data_distributed:
        return False
    group = gbuf.data_parallel_group
    return group is not None and group.size() == 1


def scale_alone(data: Any, scaling_factor: float | None, average_in_collective: bool) -> None:
    """The whole reduction of a one-rank buffer (invariant 2): ``data`` times the pre-scale, in
    place, unless the factor is absent, 1, or replaced by AVG (the identity on one rank)."""
    if scaling_factor is None or average_in_collective or scaling_factor == 1.0:
        return
    data.mul_(scaling_factor)


FRESH = "_hfsdp_fresh_grad"  # the parameter's first gradient write of the cycle is still to come


def overwrites_main_grad(param: Any) -> bool:
    """TE's ``overwrite_main_grad`` for ``param`` (invariants 3 and 4): overwrite a sharded
    bucket, fetched fresh per micro-batch, and a fresh parameter of an unsharded buffer; add into
    an unsharded buffer that holds this cycle's earlier micro-batches."""
    gbuf = getattr(param, "_gbuf", None)
    return gbuf is None or bool(gbuf.is_data_distributed) or bool(getattr(param, FRESH, False))


def take_first_write(param: Any) -> bool:
    """Whether this is ``param``'s first gradient write of the cycle (invariant 4); clears it."""
    if getattr(param, FRESH, False):
        setattr(param, FRESH, False)
        return True
    return False


def first_write_refusal(
    pipeline_parallel_size: int,
    delay_wgrad_compute: bool,
    overlap_moe_expert_parallel_comm: bool,
    environ: Mapping[str, str] = os.environ,
) -> str | None:
    """None when first writes are safe for this schedule (invariant 4) and not switched off
    (``HFSDP_ZERO_GRAD_FILL=1``), else why not."""
    if environ.get(ZERO_GRAD_FILL_ENV) == "1":
        return f"{ZERO_GRAD_FILL_ENV}=1 asks for the fill"
    if pipeline_parallel_size > 1:
        return f"pipeline parallelism ({pipeline_parallel_size} stages) runs forwards ahead of backwards"
    if delay_wgrad_compute:
        return "delayed weight gradients are written after the parameter's backward hook"
    if overlap_moe_expert_parallel_comm:
        return "overlapped expert-parallel schedules run one micro-batch's forward in another's backward"
    return None


class FirstWrites:
    """Invariant 4 for one gradient store: which one-rank buffers skip the per-cycle fill.

    ``enabled`` is the owner's decision (see :func:`first_write_refusal`). ``fill_or_mark``
    replaces a buffer's ``data.zero_()``: a buffer that is not one-rank, or first writes off, is
    filled as before; a one-rank buffer is filled at its first call (and again should its storage
    move) and from then on only has its parameters marked fresh."""

    FILLED = "_hfsdp_filled_ptr"  # the buffer storage's address when it was last filled

    def __init__(self) -> None:
        self.enabled = False

    def fill_or_mark(self, gbuf: Any, params: Iterable[Any], alone: bool) -> None:
        first_writes = self.enabled and alone
        ptr = gbuf.data.data_ptr()
        if not first_writes or getattr(gbuf, self.FILLED, None) != ptr:
            gbuf.data.zero_()
            setattr(gbuf, self.FILLED, ptr)
        if first_writes:
            for param in params:
                setattr(param, FRESH, True)

    @staticmethod
    def zero_unwritten(params: Iterable[Any], main_grad: Callable[[Any], Any]) -> None:
        """Zero the gradient of each parameter still fresh at its buffer's reduction (no
        gradient this cycle), through ``main_grad(param)``."""
        for param in params:
            if take_first_write(param):
                main_grad(param).zero_()


class HeldGrads:
    """The parameters of one-rank buffers whose reduction waits for the cycle's last backward
    (invariant 1). ``alone(param)`` says whether a parameter's buffer is one (cached here)."""

    def __init__(self, alone: Callable[[Any], bool]) -> None:
        self._alone = alone
        self._cache: dict[Any, bool] = {}
        self._held: dict[Any, None] = {}  # insertion-ordered set

    def holds(self, param: Any) -> bool:
        """Whether ``param``'s reduction waits for the cycle's end: its buffer reduces alone."""
        if param not in self._cache:
            self._cache[param] = self._alone(param)
        return self._cache[param]

    def select(self, params: Iterable[Any]) -> list[Any]:
        """The parameters to reduce now, those of multi-rank buffers; the others are held until
        :meth:`release` (at the end of the cycle's last backward, or in ``finish_grad_sync``)."""
        now = []
        for param in params:
            if self.holds(param):
                self._held[param] = None
            else:
                now.append(param)
        return now

    def release(self) -> list[Any]:
        """The held parameters, emptied: the root post-backward hook reduces them at the end of
        the cycle's last backward, ``finish_grad_sync`` when no backward was marked last."""
        held, self._held = list(self._held), {}
        return held

    def __len__(self) -> int:
        return len(self._held)


def _current_stream(device: Any) -> Any:
    """The current CUDA stream of ``device``; None off CUDA."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _on_stream(stream: Any) -> Any:
    """A context that makes ``stream`` current."""
    return torch.cuda.stream(stream)


class GradWrites:
    """Invariant 5: gradient writes into main grads, queued by :meth:`write` where ``holds(param)``
    (the parameter's reduction waits for the cycle's end, :meth:`HeldGrads.holds`) and done by
    :meth:`flush` as multi-tensor launches; other writes, and every write under
    ``HFSDP_PER_PARAM_GRAD_WRITES=1``, are done at once, as upstream does."""

    LARGE = 1 << 20  # elements: a gradient this large is written at once
    CAP_BYTES = 64 << 20  # the queue is written when its gradients (and scratch) hold more than this

    def __init__(self, holds: Callable[[Any], bool], environ: Mapping[str, str] = os.environ) -> None:
        self._holds = holds
        self._environ = environ
        self._now = environ.get(PER_PARAM_GRAD_WRITES_ENV) == "1"
        self._copies: list[tuple[Any, Any]] = []
        self._adds: list[tuple[Any, Any]] = []
        self._queued: set[int] = set()  # the queued main grads' addresses
        self._stream: Any = None  # the stream the queued writes were made on (None off CUDA)
        self._device: Any = None
        self._bytes = 0

    def write(self, param: Any, main_grad: Any, grad: Any, first: bool) -> None:
        """``main_grad.copy_(grad)`` when ``first`` (the cycle's first write of ``param``), else
        ``add_``: queued for a held parameter, at once otherwise, for a large gradient, or under
        the switch."""
        if self._now or grad.numel() >= self.LARGE or not self._holds(param):
            (main_grad.copy_ if first else main_grad.add_)(grad)
            return
        stream = _current_stream(grad.device)
        elsewhere = len(self) and (grad.device, stream) != (self._device, self._stream)
        if elsewhere or main_grad.data_ptr() in self._queued:
            self.flush()
        self._stream, self._device = stream, grad.device
        (self._copies if first else self._adds).append((main_grad, grad))
        self._queued.add(main_grad.data_ptr())
        # The gradient, and an add's widening scratch (foreach_copy.add_all), until the flush.
        widened = not first and main_grad.dtype != grad.dtype
        self._bytes += grad.numel() * (grad.element_size() + (main_grad.element_size() if widened else 0))
        if self._bytes > self.CAP_BYTES:
            self.flush()

    def flush(self) -> None:
        """Do the queued writes, first writes before adds, on the stream they were queued on; the
        current stream then waits for that one. The queue is empty afterwards."""
        copies, adds, stream, device = self._copies, self._adds, self._stream, self._device
        self.discard()
        if not (copies or adds):
            return
        current = _current_stream(device)
        with _on_stream(stream) if stream != current else nullcontext():
            if copies:
                copy_all(copies, self._environ, PER_PARAM_GRAD_WRITES_ENV)
            if adds:
                add_all(adds, self._environ)
        if stream != current:
            current.wait_stream(stream)

    def discard(self) -> None:
        """Empty the queue without writing (``zero_grad``: what an interrupted backward left)."""
        self._copies, self._adds, self._queued = [], [], set()
        self._stream = self._device = None
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._copies) + len(self._adds)
