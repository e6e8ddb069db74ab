# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Where a training step reads its own statistics on the host.

[Note: host reads in a step]
A host read of a device value (``.item()``, ``float(t)``, ``if t > x``, and ``torch.tensor([x],
device="cuda")``, whose copy waits for its stream) returns only when every kernel queued before it
has run. Upstream 0.18.2's step queues its work and then reads its statistics whether or not
anything writes them: the gradient norm against ``grad_norm_skip_threshold`` (between the norm and
the optimizer update); the update flag and the norm, reduced over the model-parallel group; the
loss scale; a fresh loss accumulator; the learning rate, reduced over the same group. Each read
drains the GPU, which then idles while the host runs the Python that queues what comes next. Under
a full-iteration CUDA graph the host so waits for the graph before it queues the optimizer update,
and for the update before it queues the next graph.

What the fork reads instead (patches ``optimizer-chained-skip-check-infinite-threshold``, 0.18.2
only, and ``training-step-stats-stay-on-device``):

* The skip check compares the norm only for a threshold other than +inf, the default, for which
  ``norm > threshold`` is False for every norm, NaN and inf included (:func:`norm_exceeds`;
  upstream 0.19.0 skips it for every infinite threshold).
* Over a model-parallel group of one rank a reduction is the identity: the update flag and the
  learning rate are host values already (the rate rounded to float32, as the reduction's tensor
  rounds it), the norm stays what the optimizer returned (:func:`all_ranks`, :func:`max_stat`,
  :func:`max_device_stat`). Over several ranks a norm that is a device tensor is reduced on the
  device (MAX; -1 stands for a rank without one, as upstream); host values keep upstream's
  reduction.
* The loss scale stays a device tensor (:func:`loss_scale`), and a new loss accumulator is a
  fill on the device (:func:`new_sum`).
* ``training_log`` reads the norm and the loss scale where it writes them, at a TensorBoard
  iteration or a log iteration (:func:`host_stat`, :func:`host_float`).
* ``--exit-duration-in-mins`` (the fork's Slurm launchers always pass it) all-reduces "is any rank
  over its time?" every step, as upstream, but reads the answer one step later, from a pinned
  copy behind an event (:class:`DurationVote`): the run exits, and saves, one step after the step
  upstream would exit at; every rank reads the same sequence of answers, so all exit together.

Invariants: every logged and written value is the number upstream logs (same reductions, same
float32 rounding); every rank issues upstream's collectives; between log iterations no read waits
for the step it follows (the exit vote waits for the step before), so the host queues step k+1
while the GPU runs step k (Megatron's ``--train-sync-interval`` bounds how far it runs ahead); a
log iteration reads, and so waits, at its timer's barrier. Options that read on the host by
design still do so every step: ``--log-params-norm``, ``--log-num-zeros-in-grad``,
``--exit-signal-handler``, ``--timing-log-level`` 1 or more, a TensorBoard writer at
``--tensorboard-log-interval 1``.
``HFSDP_HOST_READS_EVERY_STEP=1`` restores upstream's reads (any value but 0 or 1 is an error).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

ENV = "HFSDP_HOST_READS_EVERY_STEP"
NO_STAT = -1.0  # upstream's stand-in for a rank without the statistic


def every_step(environ: Mapping[str, str] = os.environ) -> bool:
    """True when ``HFSDP_HOST_READS_EVERY_STEP=1``: upstream's reads, every step."""
    value = environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 0 (read statistics where they are logged, the "
                         "default) or 1 (read them every step, as upstream)")
    return value == "1"


def norm_exceeds(grad_norm: Any, threshold: float, environ: Mapping[str, str] = os.environ) -> bool:
    """Megatron's skip check, ``grad_norm > threshold``; False without reading the norm when the
    threshold is +inf (the default), for which the comparison is False for every norm."""
    if threshold == math.inf and not every_step(environ):
        return False
    return bool(grad_norm > threshold)


def _model_parallel_group(group: torch.distributed.ProcessGroup | None) -> torch.distributed.ProcessGroup:
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_model_parallel_group()


def all_ranks(flag: bool, reduce: Callable[..., bool], *,
              group: torch.distributed.ProcessGroup | None = None,
              environ: Mapping[str, str] = os.environ) -> bool:
    """``reduce(flag)`` (upstream's logical AND over the model-parallel group, ``group`` or its
    default); over a group of one rank the same answer without a collective: upstream counts only
    ``flag is True`` as true."""
    kwargs = {} if group is None else {"group": group}
    if every_step(environ) or torch.distributed.get_world_size(_model_parallel_group(group)) != 1:
        return reduce(flag, **kwargs)
    return flag is True


def max_stat(stat: Any, reduce: Callable[..., Any], *,
             group: torch.distributed.ProcessGroup | None = None,
             environ: Mapping[str, str] = os.environ) -> Any:
    """``reduce(stat)`` for a host number or None (upstream's MAX over the model-parallel group:
    a float, or None where no rank has the statistic). Over a group of one rank the same answer
    without a collective or a read: the number rounded to float32, as upstream's tensor rounds it,
    and None for None or -1. A tensor (a learning rate that a captured optimizer step keeps on the
    device) takes upstream's reduction."""
    kwargs = {} if group is None else {"group": group}
    if (every_step(environ) or isinstance(stat, torch.Tensor)
            or torch.distributed.get_world_size(_model_parallel_group(group)) != 1):
        return reduce(stat, **kwargs)
    if stat is None:
        return None
    with np.errstate(over="ignore"):  # float32's overflow is inf, as upstream's tensor makes it
        rounded = float(np.float32(stat))
    return None if rounded == NO_STAT else rounded


def max_device_stat(stat: Any, reduce: Callable[..., Any], *,
                    group: torch.distributed.ProcessGroup | None = None,
                    environ: Mapping[str, str] = os.environ) -> Any:
    """:func:`max_stat` for a statistic the optimizer may return as a device tensor (the gradient
    norm), without a host read: over a group of one rank a tensor or None is returned unchanged;
    over several, a tensor or None is reduced on the device into a float32 tensor of one element,
    -1 where no rank has the statistic (the collective upstream's reduction issues, so ranks that
    hold host numbers take upstream's). Read it with :func:`host_stat`."""
    if every_step(environ) or (stat is not None and not isinstance(stat, torch.Tensor)):
        return max_stat(stat, reduce, group=group, environ=environ)
    mp_group = _model_parallel_group(group)
    if torch.distributed.get_world_size(mp_group) == 1:
        return stat
    if stat is None:
        value = torch.full((1,), NO_STAT, dtype=torch.float32, device=torch.cuda.current_device())
    else:
        device = torch.cuda.current_device() if torch.cuda.is_available() else stat.device  # as upstream's
        value = stat.detach().reshape(1).to(device=device, dtype=torch.float32, copy=True)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=mp_group)
    return value


def host_stat(stat: Any) -> float | None:
    """A statistic from :func:`max_stat` as upstream's reduction returns it: a float, or None where
    no rank has it. Reads a device tensor (the one wait)."""
    if stat is None:
        return None
    if isinstance(stat, torch.Tensor):
        value = float(stat.float().reshape(()).item())
        return None if value == NO_STAT else value
    return stat


def loss_scale(scale: torch.Tensor, environ: Mapping[str, str] = os.environ) -> Any:
    """The optimizer's loss scale (a device tensor of one element) for ``training_log``: read on
    the host only with ``HFSDP_HOST_READS_EVERY_STEP=1``; else read it with :func:`host_float`."""
    return scale.item() if every_step(environ) else scale


def host_float(value: Any) -> Any:
    """A device tensor of one element as a float (the one wait); anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def new_sum(environ: Mapping[str, str] = os.environ) -> torch.Tensor:
    """A loss accumulator's first value, ``[0.0]`` in float32 on the current device: a fill, where
    upstream's ``torch.tensor([0.0], device="cuda")`` copies from the host and waits. ``training_log``
    makes one per loss every step, as upstream (the default of a ``dict.get``)."""
    if every_step(environ):
        return torch.tensor([0.0], dtype=torch.float, device="cuda")
    return torch.zeros(1, dtype=torch.float, device="cuda")


class DurationVote:
    """Megatron's ``--exit-duration-in-mins`` vote: "is any rank past the limit?" (MAX over the
    default group), read one step late. :meth:`__call__` starts this step's all-reduce and copies
    its answer to pinned host memory behind an event, then returns the previous step's answer,
    waiting only for that step's copy (which the host has long passed when it runs one step ahead
    of the GPU). ``train()`` calls :meth:`reset` first: a training (a restart in the same process
    included) starts with no answer, so its ranks agree."""

    def __init__(self) -> None:
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def reset(self) -> None:
        self._pending = None

    def __call__(self, over: bool, environ: Mapping[str, str] = os.environ) -> bool:
        if every_step(environ):  # upstream's read, this step
            done = torch.tensor([over], dtype=torch.int, device="cuda")
            torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MAX)
            return bool(done.item())
        vote = torch.full((1,), int(over), dtype=torch.int, device=torch.cuda.current_device())
        torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX)
        host = torch.empty(1, dtype=torch.int, pin_memory=True)
        host.copy_(vote, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self._pending = self._pending, (host, event)
        if previous is None:
            return False
        previous[1].synchronize()
        return bool(previous[0].item())  # a host tensor: no device read


duration_vote = DurationVote()
