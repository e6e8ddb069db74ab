"""Materialize ``megatron/`` atomically, and report its state.

Rules (issue #2): build in a temporary folder beside the target and swap it into place; an
up-to-date stamp means nothing to do; a tree with local edits is never overwritten.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DirtyTree, ForeignTree
from .project import Project
from .source import locate_sdist
from .tree import STAMP_NAME, Stamp, build_queue, local_edits, read_stamp, write_stamp


@dataclass
class TreeStatus:
    """What ``status`` reports."""

    exists: bool
    stamped: bool
    up_to_date: bool
    applied: list[str] = field(default_factory=list)  # patch names in the stamp
    series: list[str] = field(default_factory=list)  # patch names in patches/series
    changed_patches: list[str] = field(default_factory=list)  # listed in both, file differs
    edits: dict[str, str] = field(default_factory=dict)
    base_mismatch: str | None = None


def tree_status(project: Project) -> TreeStatus:
    pin = project.pin()
    patches = project.series()
    names = [p.name for p in patches]
    if not project.megatron_dir.exists():
        return TreeStatus(False, False, False, series=names)
    stamp = read_stamp(project.root)
    if stamp is None:
        return TreeStatus(True, False, False, series=names)
    applied = dict(stamp.patches)
    current = dict(Stamp.expected_patches(patches))
    status = TreeStatus(
        exists=True,
        stamped=True,
        up_to_date=stamp.matches(pin, patches),
        applied=[n for n, _ in stamp.patches],
        series=names,
        changed_patches=[n for n in names if n in applied and applied[n] != current[n]],
        edits=local_edits(project.root, pin, stamp),
    )
    if stamp.base_version != pin.version or stamp.sdist_sha256 != pin.sha256:
        status.base_mismatch = f"tree built from {stamp.base_version} ({stamp.sdist_sha256[:12]}), pin is {pin.version} ({pin.sha256[:12]})"
    return status


def _refuse_if_unsafe(project: Project) -> Stamp | None:
    """Raise when replacing megatron/ could lose someone's work; return its stamp otherwise."""
    target = project.megatron_dir
    if not target.exists():
        return None
    stamp = read_stamp(project.root)
    if stamp is None:
        if any(target.iterdir()):
            raise ForeignTree(
                f"{target} exists but has no {STAMP_NAME}: it was not made by this tool, so it may hold your work",
                f"move it away (mv {target} {target}.mine), then run `scripts/patchset materialize` again",
            )
        return None
    edits = local_edits(project.root, project.pin(), stamp)
    if edits:
        listing = "\n".join(f"    {kind:8} {path}" for path, kind in list(edits.items())[:20])
        more = f"\n    ... and {len(edits) - 20} more" if len(edits) > 20 else ""
        raise DirtyTree(
            f"{target} has local edits that a rebuild would overwrite; nothing was changed:\n{listing}{more}",
            "save them into a patch first: `scripts/patchset refresh` (adds them to the patch that owns "
            "the files), `scripts/patchset refresh --new NAME` (a new patch at the end of the series), or "
            "`scripts/patchset diff > my.patch`; then re-run. `--backup` keeps a copy and rebuilds anyway.",
        )
    return stamp


def materialize(project: Project, sdist: Path | None = None, backup: bool = False, log=print) -> bool:
    """Make megatron/ match the pin and the series. Returns True if the tree was rebuilt."""
    pin = project.pin()
    patches = project.series()
    stamp = read_stamp(project.root) if project.megatron_dir.exists() else None
    if stamp is not None and stamp.matches(pin, patches) and not local_edits(project.root, pin, stamp):
        log(f"patchset: megatron/ is up to date ({pin.fork_version}, {len(patches)} patches); nothing to do")
        return False
    if not backup:
        _refuse_if_unsafe(project)  # --backup moves a foreign or edited tree aside instead
    source = locate_sdist(pin, sdist)
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix=".patchset-tmp-", dir=project.root))
    try:
        queue = build_queue(pin, source, patches, scratch / "queue")
        shutil.rmtree(queue.repo / ".git")
        write_stamp(queue.repo, pin, patches)
        _swap_into_place(project, queue.repo / "megatron", backup=backup)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(
        f"patchset: materialized megatron/ = {pin.distribution} {pin.version} + {len(patches)} patches "
        f"-> {pin.fork_version} in {time.monotonic() - started:.1f}s"
    )
    return True


def _swap_into_place(project: Project, built: Path, backup: bool) -> None:
    """Replace megatron/ with ``built``; on any failure the old tree is restored."""
    target = project.megatron_dir
    if not target.exists():
        os.replace(built, target)
        return
    parked = project.root / f".patchset-old-{os.getpid()}-{time.time_ns()}"
    os.replace(target, parked)
    try:
        os.replace(built, target)
    except BaseException:
        os.replace(parked, target)
        raise
    if backup:
        keep = project.root / f"megatron.bak-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(parked, keep)
        print(f"patchset: previous tree kept at {keep}")
    else:
        shutil.rmtree(parked, ignore_errors=True)
