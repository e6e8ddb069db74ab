"""Leftovers of writers that were killed: found by ``status``, cleaned up by the next writer.

Writers leave two kinds of folder in the checkout while they run (guarded_swap.py):
``.patchset-tmp-*`` (a build or a queue in progress: only ever a copy, never the only place of
anything) and ``.patchset-old-<folder>-*`` (the previous ``megatron/`` or ``patches/``, parked
for the moment of the swap). Only a writer holding the checkout lock cleans them, so their
creator is known to be dead:

* ``.patchset-tmp-*`` is deleted;
* a parked folder whose original is missing is put back (the swap never finished);
* a parked ``megatron`` that holds nothing the current tree lacks (its stamp reads, it has no
  edits, its kept entries are all in the current tree, identical) is deleted; any other parked
  folder is renamed to ``<folder>.bak-<time>``, so nothing is lost and the user decides.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchsetError
from .guarded_swap import OLD_PREFIX, TMP_PREFIX, backup_name
from .scan import STAMP_NAME, census, scan
from .stamp import read_stamp_file


@dataclass(frozen=True)
class Leftover:
    path: Path
    action: str  # what the next writing verb does with it


def _original(parked: Path) -> str | None:
    """``.patchset-old-megatron-<pid>-<ns>`` -> ``megatron``."""
    rest = parked.name.removeprefix(OLD_PREFIX)
    name = rest.rsplit("-", 2)[0] if rest.count("-") >= 2 else ""
    return name if name in ("megatron", "patches") else None


def _parked_megatron_is_redundant(parked: Path, current: Path, members: tuple[str, ...]) -> bool:
    """True when deleting ``parked`` loses nothing: no edits, kept entries all in ``current``."""
    try:
        stamp = read_stamp_file(parked / STAMP_NAME)
    except PatchsetError:
        return False
    if stamp is None:
        return False
    old = census(scan(parked), stamp.files, members)
    if old.edits:
        return False
    now = scan(current)
    return all(now.get(path) == entry for path, entry in old.kept.items())


def find_leftovers(root: Path, members: tuple[str, ...]) -> list[Leftover]:
    """Leftover folders in ``root`` and what the next writer will do with each (read-only)."""
    out: list[Leftover] = []
    for path in sorted(root.glob(f"{TMP_PREFIX}*")):
        out.append(Leftover(path, "delete (a copy from a killed run)"))
    for path in sorted(root.glob(f"{OLD_PREFIX}*")):
        name = _original(path)
        if name is None:
            out.append(Leftover(path, "leave alone (not recognised)"))
        elif not os.path.lexists(root / name):  # a symlink there, even a dangling one, is not replaced
            out.append(Leftover(path, f"put back as {name}/ (a killed run moved it aside)"))
        elif name == "megatron" and _parked_megatron_is_redundant(path, root / name, members):
            out.append(Leftover(path, "delete (holds nothing megatron/ lacks)"))
        else:
            out.append(Leftover(path, f"keep as {name}.bak-<time>"))
    return out


def recover(root: Path, members: tuple[str, ...], log: Callable[[str], None]) -> None:
    """Carry out :func:`find_leftovers`'s actions. Call only while holding the checkout lock."""
    for item in find_leftovers(root, members):
        action = item.action
        if action.startswith("delete"):
            shutil.rmtree(item.path) if item.path.is_dir() and not item.path.is_symlink() else item.path.unlink()
            log(f"patchset: removed {item.path.name} ({action.partition('(')[2].rstrip(')')})")
        elif action.startswith("put back"):
            name = _original(item.path)
            os.rename(item.path, root / str(name))
            log(f"patchset: restored {name}/ from {item.path.name}, left by a killed run")
        elif action.startswith("keep as"):
            name = str(_original(item.path))
            keep = backup_name(root, name)
            os.rename(item.path, keep)
            log(f"patchset: kept {item.path.name}, left by a killed run, as {keep.name}; delete it once you "
                "have checked it holds nothing you need")
