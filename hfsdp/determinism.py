"""Cross-process reproducibility of Triton-autotuned kernels (mamba_ssm's SSD kernels).

Triton's autotuner times every candidate config on a kernel's first call and keeps the fastest.
Timing noise, and NCCL traffic on another stream, can make another process pick another config;
configs differ in block sizes and so in summation order, so two processes fed identical inputs
return different bits. Megatron's ``--deterministic-mode`` does not cover this, and it is enough to
make a double-buffered run and its no-double-buffer twin disagree in the last bit.

``HFSDP_TRITON_PIN_AUTOTUNE=1`` keeps the autotuner's machinery (the kernel's own pruning, dropping
candidates that cannot run here) but walks the pruned list in order, compiling and launching each
candidate once instead of timing it, and stops at the first that runs: that one wins, in every
process and on every machine of one kind. Later candidates are never compiled. Kernels may
run slower, so this is for functional (golden) runs and determinism checks, never for benchmarks
(those use ``TRITON_CACHE_AUTOTUNING=1`` to share one timed choice).
Standard library only at import time.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

ENV = "HFSDP_TRITON_PIN_AUTOTUNE"
_MARK = "_hfsdp_pinned_first_config"

logger = logging.getLogger(__name__)


_MISSING = object()


def _launch_once(kernel_call: Any, quantiles: Any = None, **_: Any) -> list[float]:
    """A do_bench stand-in for the pinned tuner: launch the candidate once, report no time."""
    kernel_call()
    return [0.0, 0.0, 0.0]


def pin_autotuner_class(autotuner_cls: Any) -> bool:
    """Make ``autotuner_cls`` choose by candidate order instead of by measured time.

    Wraps ``prune_configs`` (remembers the pruned order) and ``_bench`` (a runnable candidate's
    "time" becomes its index; an unrunnable one keeps Triton's ``inf``; candidates after the
    first runnable one are ranked without being compiled or launched). Returns True when it
    patched, False when the class was already pinned (idempotent).
    """
    if getattr(autotuner_cls.prune_configs, _MARK, False):
        return False
    original_prune, original_bench = autotuner_cls.prune_configs, autotuner_cls._bench

    def prune_configs(self: Any, *args: Any, **kwargs: Any) -> list[Any]:
        configs = list(original_prune(self, *args, **kwargs))
        self._hfsdp_config_order = configs  # why: _bench sees one config, not the list
        self._hfsdp_found = False  # why: once one candidate ran, later ones cannot win
        self.cache_results = False  # a TRITON_CACHE_AUTOTUNING entry holds real, unpinned timings
        return configs

    def _bench(self: Any, *args: Any, config: Any, **kwargs: Any) -> list[float] | float:
        order = getattr(self, "_hfsdp_config_order", None) or list(self.configs)
        rank = float(next((i for i, c in enumerate(order) if c is config), len(order)))
        if getattr(self, "_hfsdp_found", False):
            # An earlier candidate (Triton benches them in pruned order) already runs and has a
            # lower rank: this one can only lose, so neither compile nor launch it. On a fresh
            # machine most of mamba_ssm's first-step time was compiling such losers.
            return [rank, rank, rank]
        # Only "can it run" matters here, not its time: one launch instead of do_bench's
        # ~100 ms of repeats per candidate (minutes per process for mamba_ssm's kernels).
        # Triton reports "cannot run" (out of resources, ptxas) as exceptions at compile or
        # launch, which _bench turns into inf either way.
        # do_bench is a cached_property in Triton 3.7 and a plain attribute in older releases
        # (the instance dict wins over both); were it a property, swap what it reads instead.
        attr = ("_do_bench" if isinstance(inspect.getattr_static(type(self), "do_bench", None),
                                           property) else "do_bench")
        saved = self.__dict__.get(attr, _MISSING)
        self.__dict__[attr] = _launch_once
        try:
            timings = original_bench(self, *args, config=config, **kwargs)
        finally:
            if saved is _MISSING:
                del self.__dict__[attr]
            else:
                self.__dict__[attr] = saved
        values = list(timings) if isinstance(timings, (list, tuple)) else [timings]
        if not all(math.isfinite(t) for t in values):
            return timings  # cannot run on this GPU (out of resources, ptxas error)
        self._hfsdp_found = True
        return [rank] * len(values) if isinstance(timings, (list, tuple)) else rank

    for name, fn, orig in (("prune_configs", prune_configs, original_prune),
                           ("_bench", _bench, original_bench)):
        setattr(fn, _MARK, True)
        fn.__doc__ = orig.__doc__
        setattr(autotuner_cls, name, fn)
    return True


def pin_triton_autotune_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Pin Triton autotuning when ``HFSDP_TRITON_PIN_AUTOTUNE=1``; True when pinning is active.

    Any other value than ``0``/``1`` is a clear error. Without Triton there is nothing to pin
    (no Triton kernels can run), which is logged, not an error.
    """
    value = (os.environ if environ is None else environ).get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected '0' or '1'")
    if value == "0":
        return False
    try:
        from triton.runtime import autotuner
    except ImportError:
        logger.warning("%s=1 but triton is not installed: no Triton kernels to pin", ENV)
        return False
    if pin_autotuner_class(autotuner.Autotuner):
        logger.warning("%s=1: every Triton autotuner uses its first valid config "
                       "(reproducible across processes; kernels may be slower)", ENV)
    return True
