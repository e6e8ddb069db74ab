"""Per-step digests of weights and optimizer state, to find where two runs part ways.

``HFSDP_DIGEST_STEPS=11,12,13`` (training steps as Megatron logs them, 1-based) prints, for
each listed step:

* ``HFSDP-DIGEST fwd step=S rank=R idx=I <Module> <shape> sum=... sumsq=...`` for every
  parameter of every module the first time it runs in that step, in call order. The hook is a
  global forward *post*-hook: it runs right after the module's forward and before the module's
  own hooks, so these are the weights the forward just computed with, and Megatron-FSDP has
  not released them yet (a global *pre*-hook would run before FSDP's unshard hook of a
  non-unit module and read freed memory: an illegal address on the GPU). Printed on rank 0
  only (the unsharded weights are the same on all).
* ``HFSDP-DIGEST opt step=S rank=R when=pre|post params_sumsq=... exp_avg=... exp_avg_sq=...
  [grad_groups=numel:sumsq,...] steps=[...] lr=[...]`` around every ``torch.optim`` step taken
  during that step, per rank: the sum of squares of the (fp32 main) parameters, the sums of
  Adam's moments, before the step each parameter group's gradient size and sum of squares
  (after clipping), the set of step counts and the learning rates (each rank holds its own
  shards), and ``state=key:dtype:bytes,...``: every tensor the optimizer keeps per parameter
  (Adam's moments, a master copy where one exists), summed over this rank's shards. Step 0 is
  the optimizer steps taken before training (the ``fsdp_dtensor`` loader's dummy step).

Diffing two runs' lines (``grep HFSDP-DIGEST run1.log``) names the first module, or the
first optimizer quantity, that differs. Diagnostics only: each record syncs the GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

ENV = "HFSDP_DIGEST_STEPS"


def parse_steps(value: str) -> frozenset[int]:
    """``"11,12,13"`` or ``"11-13"`` -> {11, 12, 13}; a clear error for anything else."""
    steps: set[int] = set()
    for part in filter(None, (p.strip() for p in value.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"{ENV}={value!r}: expected steps like '11,12' or '11-13'") from None
        if first < 0 or last < first:
            raise ValueError(f"{ENV}={value!r}: bad range {part!r}")
        steps.update(range(first, last + 1))
    if not steps:
        raise ValueError(f"{ENV}={value!r}: no steps listed")
    return frozenset(steps)


def tensor_stats(t: Any) -> tuple[float, float]:
    """(sum, sum of squares) in float64 of a tensor or of a DTensor's local shard.

    Accumulates in float64 without a float64 copy of the tensor (an embedding's would be GBs).
    """
    import torch

    local = getattr(t, "_local_tensor", t).detach()
    norm = torch.linalg.vector_norm(local, dtype=torch.float64)
    return float(local.sum(dtype=torch.float64)), float(norm * norm)


class Digest:
    """The hook state: which steps to record, the current step, and what ran in it."""

    def __init__(self, steps: frozenset[int], current_step: Callable[[], int], rank: int,
                 emit: Callable[[str], None] = print) -> None:
        self.steps, self.current_step, self.rank, self.emit = steps, current_step, rank, emit
        self._step = -1
        self._seen: set[int] = set()  # id() of modules already digested in this step
        self._order = 0
        self.handles: list[Any] = []

    def _enter(self) -> int | None:
        step = self.current_step()
        if step != self._step:
            self._step, self._seen, self._order = step, set(), 0
        return step if step in self.steps else None

    def module_forward(self, module: Any, _inputs: Any, _output: Any) -> None:
        step = self._enter()
        if step is None or self.rank != 0 or id(module) in self._seen:
            return
        self._seen.add(id(module))
        for name, p in module.named_parameters(recurse=False):
            s, sq = tensor_stats(p)
            numel = getattr(p, "_local_tensor", p).numel()  # < shape's numel: a shard
            self.emit(f"HFSDP-DIGEST fwd step={step} rank={self.rank} idx={self._order} "
                      f"{type(module).__name__}.{name} {tuple(p.shape)} numel={numel} "
                      f"sum={s!r} sumsq={sq!r}")
            self._order += 1

    def optimizer_step(self, optimizer: Any, when: str) -> None:
        step = self._enter()
        if step is None:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        totals: dict[str, Any] = {"params_sumsq": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
        if when == "pre":  # the gradients the step will apply, per parameter group
            totals["grad_groups"] = grad_groups(optimizer.param_groups)
        step_values: set[float] = set()
        kept: dict[tuple[str, str], int] = {}  # (state key, dtype) -> bytes on this rank
        for p in params:
            totals["params_sumsq"] += tensor_stats(p)[1]  # the sum alone could cancel out
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                local = getattr(value, "_local_tensor", value)
                if hasattr(local, "element_size") and hasattr(local, "numel") and local.dim() > 0:
                    dtype = str(local.dtype).removeprefix("torch.")
                    kept[key, dtype] = kept.get((key, dtype), 0) + local.numel() * local.element_size()
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    totals[key] += tensor_stats(state[key])[0]
            if "step" in state:
                step_values.add(float(state["step"]))
        lrs = sorted({float(g.get("lr", 0.0)) for g in optimizer.param_groups})
        self.emit(f"HFSDP-DIGEST opt step={step} rank={self.rank} when={when} "
                  + " ".join(f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in totals.items())
                  + f" steps={sorted(step_values)} lr={lrs}"
                  + " state=" + (",".join(f"{k}:{d}:{b}" for (k, d), b in sorted(kept.items())) or "none"))


def grad_groups(param_groups: Any) -> str:
    """Per optimizer parameter group, ``numel:sumsq`` of this rank's (local) gradients, ``e``
    appended for a group marked expert-parallel (Megatron's ``is_expert_parallel`` key, where the
    optimizer keeps it; Megatron-FSDP's optimizer may group experts with other parameters).
    Ratios between groups are unchanged by gradient clipping, so they compare runs whose clip
    factor differs."""
    out = []
    for group in param_groups:
        numel, sumsq = 0, 0.0
        for p in group["params"]:
            if getattr(p, "grad", None) is not None:
                numel += getattr(p.grad, "_local_tensor", p.grad).numel()
                sumsq += tensor_stats(p.grad)[1]
        out.append(f"{numel}:{sumsq!r}" + ("e" if group.get("is_expert_parallel", False) else ""))
    return ",".join(out)


def install_from_env(environ: Mapping[str, str] | None = None) -> Digest | None:
    """Install the global module and optimizer hooks when ``HFSDP_DIGEST_STEPS`` is set."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    if not value:
        return None
    steps = parse_steps(value)

    def current_step() -> int:
        from megatron.training import get_args

        try:
            args = get_args()
        except Exception:  # before argument parsing: nothing to record yet
            return -1
        # curr_iteration counts completed steps; the log's "iteration N" is the N-th (1-based).
        # Not a flag: pretrain() sets it only after model setup (the bench worker never), so it may be absent.
        it = getattr(args, "curr_iteration", None)
        return 0 if it is None else int(it) + 1

    rank = int((os.environ if environ is None else environ).get("RANK", "0"))
    digest = Digest(steps, current_step, rank, emit=lambda line: print(line, flush=True))
    digest.handles = install_hooks(digest)  # global hooks; .remove() each to uninstall
    return digest


def install_hooks(digest: Digest) -> list[Any]:
    """Register ``digest`` on every module's forward and every torch optimizer's step."""
    from torch.nn.modules.module import register_module_forward_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    return [
        register_module_forward_hook(digest.module_forward),
        register_optimizer_step_pre_hook(lambda opt, a, k: digest.optimizer_step(opt, "pre")),
        register_optimizer_step_post_hook(lambda opt, a, k: digest.optimizer_step(opt, "post")),
    ]
