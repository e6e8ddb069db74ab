"""Run-time guard for entry points: the imported ``megatron.core`` must be this fork's tree.

Two copies of ``megatron`` (a site-packages wheel beside a checkout) and stale trees are the
most common way patch-set forks silently run the wrong code; fail before any training starts.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from hfsdp.usererror import quoted

from .errors import PatchsetError, StaleTree
from .project import Project
from .tree import read_stamp


def ensure_fork(project: Project | None = None) -> Path:
    """Raise unless ``megatron.core`` resolves inside the materialized, up-to-date tree."""
    project = project or Project.default()
    if os.environ.get("HFSDP_SKIP_FORK_GUARD") == "1":
        return project.megatron_dir
    spec = importlib.util.find_spec("megatron.core")
    where = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    expected = (project.megatron_dir / "core").resolve()
    if where is None:
        raise PatchsetError(
            "megatron.core is not importable",
            f"install the fork: `pip install -e {quoted(project.root)}` (or run `scripts/patchset materialize` "
            f"and put {project.root} on PYTHONPATH)",
        )
    if expected not in where.parents:
        raise PatchsetError(
            f"megatron.core resolves to {where.parent}, not this fork's materialized tree {expected}",
            f"remove the other copy (`pip uninstall -y megatron-core`), then `pip install -e {quoted(project.root)}`",
        )
    stamp = read_stamp(project.root)
    if stamp is not None:  # the tree is checked against the base it was built from ([Note: bases] in project.py)
        project = project.for_stamp(stamp.base_version, stamp.sdist_sha256) or project
    if stamp is None or not stamp.matches(project.pin(), project.series(), project.overlay()):
        raise StaleTree(
            f"{project.megatron_dir} is {'not stamped' if stamp is None else 'stale'}: it does not match "
            "patches/series, patches/overlay/ and patches/base.toml",
            "run `scripts/patchset materialize` (or `pip install -e .`); `scripts/patchset status` says why",
        )
    return project.megatron_dir
