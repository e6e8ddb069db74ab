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

1. A one-rank buffer is reduced once per optimization cycle: at the backward of the last
   micro-batch when the caller marks it (``no_sync``, as Megatron's schedules do) or syncs
   every micro-batch (``model_auto_sync``), else in ``finish_grad_sync`` (``HeldGrads``).
2. Its reduction is the pre-scale alone, in place and in the buffer's dtype (``scale_alone``): a
   group of one has nothing to exchange, so no collective runs and no communication copy is
   made. SUM and AVG over one rank are the identity; only a scaling factor (when
   ``average_in_collective`` is off) changes values, exactly as the multi-rank path scales.
3. Weight-gradient kernels add into a one-rank buffer, which holds the earlier micro-batches
   (``overwrites_main_grad``); a sharded bucket, fresh per micro-batch, is still overwritten.

Hybrid FSDP (an outer data-parallel group) keeps upstream's path: its outer reduction runs on the
last micro-batch only, and a one-rank inner group is not special-cased there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


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


def overwrites_main_grad(param: Any) -> bool:
    """TE's ``overwrite_main_grad`` for ``param`` (invariant 3): overwrite a sharded bucket,
    fetched fresh per micro-batch; add into an unsharded buffer, which accumulates them."""
    gbuf = getattr(param, "_gbuf", None)
    return gbuf is None or bool(gbuf.is_data_distributed)


class HeldGrads:
    """The parameters of one-rank buffers whose reduction waits for the cycle's last backward
    (invariant 1). ``alone(param)`` says whether a parameter's buffer is one (cached here)."""

    def __init__(self, alone: Callable[[Any], bool]) -> None:
        self._alone = alone
        self._cache: dict[Any, bool] = {}
        self._held: dict[Any, None] = {}  # insertion-ordered set

    def _is_alone(self, param: Any) -> bool:
        if param not in self._cache:
            self._cache[param] = self._alone(param)
        return self._cache[param]

    def select(self, params: Iterable[Any], final: bool) -> list[Any]:
        """The parameters to reduce now: all of them on the cycle's last backward (``final``),
        else those of multi-rank buffers; the others are held."""
        params = list(params)
        if final:
            for param in params:
                self._held.pop(param, None)
            return params
        now = []
        for param in params:
            if self._is_alone(param):
                self._held[param] = None
            else:
                now.append(param)
        return now

    def release(self) -> list[Any]:
        """The held parameters, emptied: ``finish_grad_sync`` reduces them when no backward was
        marked last."""
        held, self._held = list(self._held), {}
        return held

    def __len__(self) -> int:
        return len(self._held)
