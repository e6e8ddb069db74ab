"""Run-time guard for entry points: the imported ``megatron.core`` must be this fork's tree, current.

Two copies of ``megatron`` (a site-packages wheel beside a checkout) and stale trees are the
most common way patch-set forks silently run the wrong code; fail before any training starts.
The tree's own import check only asks that it is stamped; whether the stamp is current against
the checkout is asked here ([Note: the import guard] in the overlay's ``megatron/core/fork_info.py``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from hfsdp.usererror import quoted

from .errors import PatchsetError, StaleTree
from .project import Project
from .stamp import read_stamp


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
        pinned = project.base_label  # patches/ or patches/bases/<version>/
        install = "pip install -e ." if project.base is None else f"HFSDP_BASE={project.base} pip install -e ."
        raise StaleTree(
            f"{project.megatron_dir} is {'not stamped' if stamp is None else 'stale'}: it does not match "
            f"{pinned}series, {pinned}base.toml and patches/overlay/",
            f"run `{project.command('materialize')}` (or `{install}`); `{project.command('status')}` says why",
        )
    return project.megatron_dir
