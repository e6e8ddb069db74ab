"""Leftovers of writers that were killed: found by ``status``, cleaned up by the next writer.

Writers leave these in the checkout while they run (guarded_swap.py, refresh.py):
``.patchset-tmp-*`` (a build or a queue in progress: only ever a copy, never the only place of
anything), ``.patchset-old-<folder>-*`` (the previous ``megatron/`` or ``patches/``, parked
for the moment of the swap), and in ``megatron/`` the stamp ``refresh`` writes for its new
``patches/`` (``.patchset-stamp.next.json``) and the temporary file of a stamp being written.
Only a writer holding the checkout lock cleans them, so their creator is known to be dead:

* ``.patchset-tmp-*`` and a stamp's temporary file are deleted;
* a parked folder whose original is missing is put back (the swap never finished), first of all:
  a parked ``patches/`` is where the pin and the series are read from;
* a parked ``megatron`` that holds nothing the current tree lacks (its stamp reads, it has no
  edits, its kept entries are all in the current tree, identical) is deleted; any other parked
  folder is renamed to ``<folder>.bak-<time>``, so nothing is lost and the user decides;
* refresh's new stamp becomes the stamp if ``patches/`` is what it was written for (refresh was
  killed after writing ``patches/``: its edits are in the patches now); otherwise it is deleted
  (killed before: ``patches/`` and the stamp are as they were, the edits still edits).

``materialize`` cleans them too when the tree is up to date (it needs the lock only then), unless
another writer holds the lock: while it runs, what looks left over is its work in progress.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import PatchsetError
from .guarded_swap import OLD_PREFIX, TMP_PREFIX, backup_name
from .scan import NEXT_STAMP_NAME, STAMP_NAME, census, is_stamp_file, scan
from .stamp import read_stamp_file

if TYPE_CHECKING:
    from .project import Project

FINISH = "make it the stamp (refresh wrote patches/ for it)"
DISCARD = "delete it (refresh did not get to write patches/)"


@dataclass(frozen=True)
class Leftover:
    path: Path
    action: str  # what the next writing verb does with it


def _original(parked: Path) -> str | None:
    """``.patchset-old-megatron-<pid>-<ns>`` -> ``megatron``."""
    rest = parked.name.removeprefix(OLD_PREFIX)
    name = rest.rsplit("-", 2)[0] if rest.count("-") >= 2 else ""
    return name if name in ("megatron", "patches") else None


def parked_originals(root: Path) -> list[tuple[Path, str]]:
    """(parked folder, its name) for each parked folder whose original is missing (it goes back first)."""
    out = []
    for path in sorted(root.glob(f"{OLD_PREFIX}*")):
        name = _original(path)
        if name is not None and not os.path.lexists(root / name):  # a symlink there, even dangling, is not replaced
            out.append((path, name))
    return out


def any_leftovers(root: Path) -> bool:
    """Whether a killed writer may have left something (cheap: names only)."""
    tree = root / "megatron"
    return (any(root.glob(f"{TMP_PREFIX}*")) or any(root.glob(f"{OLD_PREFIX}*"))
            or (tree.is_dir() and not tree.is_symlink()
                and any(is_stamp_file(p.name) and p.name != STAMP_NAME for p in tree.iterdir())))


def _parked_megatron_is_redundant(parked: Path, current: Path, members: tuple[str, ...]) -> bool:
    """True when deleting ``parked`` loses nothing: no edits, kept entries all in ``current``."""
    try:
        stamp = read_stamp_file(parked / STAMP_NAME)
    except PatchsetError:
        return False
    if stamp is None:
        return False
    old = census(scan(parked), stamp.files, members)
    if old.edits or old.strays:  # a stray file is no edit, but it is the user's: never deleted
        return False
    now = scan(current)
    return all(now.get(path) == entry for path, entry in old.kept.items())


def _next_stamp_action(project: Project) -> str:
    """What to do with refresh's new stamp: it is the stamp of the current patches/, or of none."""
    try:
        stamp = read_stamp_file(project.megatron_dir / NEXT_STAMP_NAME, checkout=project.root)
        written = stamp is not None and stamp.matches(project.pin(), project.series(), project.overlay())
    except PatchsetError:
        written = False
    return FINISH if written else DISCARD


def find_leftovers(project: Project) -> list[Leftover]:
    """Leftovers in the checkout and what the next writer will do with each (read-only)."""
    root = project.root
    out: list[Leftover] = []
    for path in sorted(root.glob(f"{TMP_PREFIX}*")):
        out.append(Leftover(path, "delete (a copy from a killed run)"))
    for path in sorted(root.glob(f"{OLD_PREFIX}*")):
        name = _original(path)
        if name is None:
            out.append(Leftover(path, "leave alone (not recognised)"))
        elif not os.path.lexists(root / name):
            out.append(Leftover(path, f"put back as {name}/ (a killed run moved it aside)"))
        elif name == "megatron" and _parked_megatron_is_redundant(path, root / name, project.pin().members):
            out.append(Leftover(path, "delete (holds nothing megatron/ lacks)"))
        else:
            out.append(Leftover(path, f"keep as {name}.bak-<time>"))
    tree = project.megatron_dir
    if tree.is_dir() and not tree.is_symlink():
        for path in sorted(tree.iterdir()):
            if path.name == NEXT_STAMP_NAME:
                out.append(Leftover(path, _next_stamp_action(project)))
            elif is_stamp_file(path.name) and path.name != STAMP_NAME:
                out.append(Leftover(path, "delete (a stamp a killed run was writing)"))
    return out


def recover(project: Project, log: Callable[[str], None]) -> None:
    """Carry out :func:`find_leftovers`'s actions. Call only while holding the checkout lock."""
    root = project.root
    for path, name in parked_originals(root):  # first: patches/ holds the pin the rest reads
        os.rename(path, root / name)
        log(f"patchset: restored {name}/ from {path.name}, left by a killed run")
    for item in find_leftovers(project):
        action = item.action
        if action == FINISH:
            os.replace(item.path, project.megatron_dir / STAMP_NAME)
            log("patchset: finished the stamp of a killed refresh (its patches/ was written)")
        elif action == DISCARD:
            item.path.unlink()
            log("patchset: removed the stamp of a refresh killed before it wrote patches/ (nothing of it took "
                "effect; your edits are still edits)")
        elif action.startswith("delete"):
            shutil.rmtree(item.path) if item.path.is_dir() and not item.path.is_symlink() else item.path.unlink()
            log(f"patchset: removed {item.path.name} ({action.partition('(')[2].rstrip(')')})")
        elif action.startswith("keep as"):
            name = str(_original(item.path))
            keep = backup_name(root, name)
            os.rename(item.path, keep)
            log(f"patchset: kept {item.path.name}, left by a killed run, as {keep.name}; delete it once you "
                "have checked it holds nothing you need")
