"""Share Triton's autotuning between processes for kernels whose configs carry a ``pre_hook``.

[Note: autotune cache for pre_hook kernels]
With ``TRITON_CACHE_AUTOTUNING=1`` Triton stores each autotuner's timed choice on disk, so a later
process on the machine reuses it instead of timing every candidate again. Triton skips that cache
for any kernel whose candidate configs carry a ``pre_hook`` (it cannot serialize a function), and
mamba_ssm's backward SSD kernels all do (``init_to_zero``). So every process re-times them in its
first step: about 100 s a process for the 5.9B realistic preset at DP=4.

:func:`install` extends the cache to those kernels. The file holds each candidate's fields without
its hook (block sizes, warps, stages and the rest of ``Config.__dict__``); on a hit, each stored
entry is matched back to the live config with the same fields, which keeps its own hook. The
cache key is Triton's own (compiler, target, kernel source, cache-invalidating environment,
tuning key, candidate list) plus a tag, so the two kinds of entry never collide.

Invariants:
- a hit restores the choice only when every live candidate has exactly one stored timing; any
  other file (another candidate list, a truncated write, junk) means the kernel is timed again,
  and the new timings replace the file;
- kernels without hooks take Triton's own path, unchanged;
- where Triton's key cannot be computed (its internals moved), the kernel takes Triton's own
  path: timed, as without this module;
- nothing changes unless the process asked for the cache (``TRITON_CACHE_AUTOTUNING=1`` or an
  autotuner built with ``cache_results=True``): only then does Triton call ``check_disk_cache``.

[Note: one Triton cache directory per process life]
Triton reads ``TRITON_CACHE_DIR`` on every cache lookup, and TorchInductor sets it, when unset, to
``<inductor cache>/triton/<device index>`` the first time it builds a kernel launcher, which is
at some point inside the first step of a process with ``torch.compile``'d functions (Megatron's
``jit_fuser``). Kernels compiled or tuned before that moment (mamba_ssm's, on a hybrid's first
layer) go to Triton's default folder, those after it to Inductor's; where that moment falls differs
between processes (a cold compile against an Inductor cache hit), so a later process looks for its
kernels in the other folder, misses, and compiles and times them again: 90 s or more of every
process's first step on the realistic preset at DP=4. :func:`pin_cache_dir`, called by our entry
before anything is compiled, sets the variable to Triton's own default when the user has not set
it, so every kernel of every process and rank lives in one folder. A user's value is kept.

Standard library only at import time.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

from hfsdp.atomic import json_text, loads_strict

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "TRITON_CACHE_DIR"
_MARK = "_hfsdp_pre_hook_cache"
_TAG = "hfsdp-pre-hook-v1"


def config_fields(config: Any) -> str:
    """A candidate config as canonical JSON, without its ``pre_hook``: what identifies it on disk."""
    fields = {k: v for k, v in vars(config).items() if k != "pre_hook"}
    return json_text(fields, indent=None)


def cache_key(base_parts: Sequence[str], tuning_key: Any, configs: Sequence[Any]) -> str:
    """The file's key: Triton's own parts, the tuning key and the candidates' fields, tagged."""
    parts = [_TAG, *base_parts, str(tuning_key), *(config_fields(c) for c in configs)]
    return hashlib.sha256("-".join(parts).encode("utf-8")).hexdigest()


def _stored(timing: Any) -> Any:
    """A timing as strict JSON: a candidate that cannot run has Triton's ``inf``, stored as null."""
    if isinstance(timing, (list, tuple)):
        return [_stored(t) for t in timing]
    return timing if math.isfinite(timing) else None


def _timing(stored: Any) -> Any:
    """What :func:`_stored` wrote, back as Triton's timing (null -> ``inf``)."""
    if isinstance(stored, list):
        return [_timing(t) for t in stored]
    if stored is None:
        return math.inf
    if isinstance(stored, bool) or not isinstance(stored, (int, float)):
        raise TypeError(f"a timing is a number, got {stored!r}")
    return float(stored)


def restore(text: str, configs: Sequence[Any]) -> dict[Any, Any] | None:
    """The stored timings keyed by the live ``configs``, or None when ``text`` does not time
    exactly these candidates (each one once)."""
    try:
        stored = loads_strict(text)["configs_timings"]
        by_fields = {config_fields(c): c for c in configs}
        timings: dict[Any, Any] = {}
        for fields, timing in stored:
            live = by_fields.get(json_text(fields, indent=None))
            if live is None or live in timings:
                return None
            timings[live] = _timing(timing)
    except (ValueError, KeyError, TypeError):
        return None
    return timings if len(timings) == len(configs) else None


def dump(tuning_key: Any, timings: dict[Any, Any]) -> str:
    """What :func:`restore` reads back."""
    return json_text({"key": str(tuning_key),
                      "configs_timings": [(loads_strict(config_fields(c)), _stored(t)) for c, t in timings.items()]},
                     indent=None)


def _triton_key_parts(fn: Any) -> list[str]:
    """The parts of Triton's own autotune cache key, from the names its ``check_disk_cache`` uses."""
    from triton.compiler.compiler import make_backend
    from triton.runtime import autotuner as at

    env_vars = at.get_cache_invalidating_env_vars()
    return [at.triton_key(), make_backend(at.driver.active.get_current_target()).hash(), fn.cache_key,
            str(sorted(env_vars.items()))]


def make_check_disk_cache(original: Callable[..., bool], *,
                          key_parts: Callable[[Any], list[str]] = _triton_key_parts,
                          cache_manager: Callable[[str], Any] | None = None) -> Callable[..., bool]:
    """``Autotuner.check_disk_cache`` that also caches kernels with ``pre_hook`` configs."""

    def check_disk_cache(self: Any, tuning_key: Any, configs: Sequence[Any], bench_fn: Callable[[], None]) -> bool:
        if not tuning_key or not any(c.pre_hook for c in configs):
            return original(self, tuning_key, configs, bench_fn)
        if cache_manager is None:
            from triton.runtime.cache import get_cache_manager
        else:
            get_cache_manager = cache_manager
        fn = self.fn
        while not hasattr(fn, "cache_key"):  # the JITFunction under any heuristics wrappers
            fn = fn.fn
        try:
            cache = get_cache_manager(cache_key(key_parts(fn), tuning_key, configs))
        except Exception as exc:  # a Triton whose internals moved: time the kernel, as Triton would
            logger.warning("autotune cache for %s unavailable (%s: %s); timing its configs",
                           getattr(fn, "__name__", fn), type(exc).__name__, exc)
            return original(self, tuning_key, configs, bench_fn)
        file_name = f"{fn.__name__[:150]}.autotune.json"
        path = cache.get_file(file_name)
        if path:
            with open(path, encoding="utf-8", errors="replace") as f:
                timings = restore(f.read(), configs)
            if timings is not None:
                self.cache[tuning_key] = min(timings, key=lambda c: timings[c])
                self.configs_timings = timings
                return True
        bench_fn()
        try:
            cache.put(dump(tuning_key, self.configs_timings), file_name, binary=False)
        except (TypeError, ValueError, OSError) as exc:  # a config field or timing JSON cannot hold
            logger.warning("autotune cache for %s not written (%s: %s)", fn.__name__, type(exc).__name__, exc)
        return False

    setattr(check_disk_cache, _MARK, True)
    check_disk_cache.__doc__ = original.__doc__
    return check_disk_cache


def install(autotuner_cls: Any | None = None) -> bool:
    """Extend ``autotuner_cls`` (Triton's ``Autotuner`` by default) as the note says. True when it
    patched; False when already installed, or when Triton (or its ``check_disk_cache``) is absent."""
    if autotuner_cls is None:
        try:
            from triton.runtime.autotuner import Autotuner
        except ImportError:
            return False
        autotuner_cls = Autotuner
    original = getattr(autotuner_cls, "check_disk_cache", None)
    if original is None or getattr(original, _MARK, False):
        return False
    autotuner_cls.check_disk_cache = make_check_disk_cache(original)
    logger.debug("Triton's autotune disk cache now covers configs with a pre_hook")
    return True


def default_cache_dir(environ: MutableMapping[str, str]) -> str:
    """Triton's own default cache folder: ``$TRITON_HOME/.triton/cache``, ``TRITON_HOME`` being the home
    folder when unset (triton.knobs.cache)."""
    home = environ.get("TRITON_HOME") or os.path.expanduser("~/")
    return os.path.join(home, ".triton", "cache")


def pin_cache_dir(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``TRITON_CACHE_DIR`` to Triton's default where unset ([Note: one Triton cache directory per
    process life]); the folder set, or None when the user's value stands."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_DIR_ENV):
        return None
    env[CACHE_DIR_ENV] = default_cache_dir(env)
    return env[CACHE_DIR_ENV]
