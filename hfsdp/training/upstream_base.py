"""Our entry points on a pristine upstream tree: ``HFSDP_UPSTREAM_BASE=<folder>``.

The benchmark times the same ``pretrain_gpt.py`` flags on unpatched megatron-core releases
(hfsdp/bench/bases.py). It puts the release's tree first on ``PYTHONPATH`` and names it here;
the entry then checks that ``megatron.core`` really is that tree (instead of the fork's guard)
and leaves out what only the fork has: the max-pool lanes check, the explicit FSDP unit list and
the fork's fields of the run report. Nothing of upstream is patched: the entry, model provider,
data and forward step are ours on either tree.

Standard library only at import time: the check runs before ``megatron`` loads.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from hfsdp.usererror import UserError

ENV = "HFSDP_UPSTREAM_BASE"


def active() -> Path | None:
    """The upstream tree this process runs on (the folder holding ``megatron/``), or None: the fork."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def isolate() -> list[object]:
    """Drop the import finders that map ``megatron`` packages to a tree of their own (the one ``pip install -e``
    of the fork adds to ``sys.meta_path``): otherwise a module the release lacks, ``megatron.training.teardown``
    say, would be found in the fork's tree. Returns what was dropped."""
    dropped: list[object] = []
    for finder in list(sys.meta_path):
        module = sys.modules.get(getattr(finder, "__module__", "") or "")
        mapping = getattr(module, "MAPPING", None)
        if isinstance(mapping, dict) and any(str(k).split(".")[0] == "megatron" for k in mapping):
            sys.meta_path.remove(finder)
            dropped.append(finder)
    return dropped


def ensure(root: Path) -> Path:
    """Raise unless ``megatron.core`` resolves inside ``root`` (after :func:`isolate`); returns where it resolves."""
    isolate()
    spec = importlib.util.find_spec("megatron.core")
    where = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
    expected = (root / "megatron" / "core").resolve()
    if where != expected:
        found = "megatron.core is not importable" if where is None else f"megatron.core resolves to {where}"
        raise UserError(f"{ENV}={root}, but {found}, not that tree",
                        f"put {root} first on PYTHONPATH and run with PYTHONSAFEPATH=1, so that the script's "
                        "folder (which may hold the fork's megatron/) is not searched first")
    return where
