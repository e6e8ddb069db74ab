"""What is in a materialized ``megatron/``, and who made it.

[Note: tool-made, edits, kept, caches] Every entry under ``megatron/`` is one of:

* **tool-made**: a file the stamp lists (the build wrote it); if its content changed or it is
  gone, that is an **edit** (``modified`` / ``deleted``);
* **added**: a new regular source file under a pinned member (``core/``, ``training/``): an
  edit too, which ``refresh`` can fold into a patch;
* **kept**: anything else the tool did not write: files outside the members, built objects
  and lock files (``.so``, ``.o``, ``.lock``), symlinks, empty folders. A rebuild copies them
  into the new tree, or refuses and names them when the new tree has something at that path;
* **cache**: Python's bytecode caches (``__pycache__``, ``.pyc``), which Python rewrites on
  import. They are neither edits nor kept, and a rebuild drops them;
* **stray**: an editor's backup or swap file, or a ``.rej``/``.orig`` of an apply, under a member
  ([Note: stray files] below): never an edit, so never folded into the overlay; every verb that
  reads the edits refuses the tree while one is there, and ``--backup`` keeps it with the old tree.

Nothing a user made is ever in the fourth group, so a rebuild loses nothing: edits and stray files
make it refuse (or go to a backup with ``--backup``) and kept entries move with the tree.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .source import sha256_file

CACHE_DIRS = frozenset({"__pycache__", ".pytest_cache"})
CACHE_SUFFIXES = (".pyc", ".pyo")
KEPT_SUFFIXES = (".so", ".o", ".lock")  # built objects and locks: never folded into a patch
STAMP_NAME = ".patchset-stamp.json"
NEXT_STAMP_NAME = ".patchset-stamp.next.json"  # refresh's new stamp until its patches/ is in place (refresh.py)


# [Note: stray files] Editor backups and swap files, and what a failed or partial apply leaves beside a file
# (``patch``, ``git apply --reject``, a merge tool): never a file of the fork, wherever they lie. One predicate
# for every place that decides what a file of the fork is: the overlay (overlay.py's ``path_problem``: status,
# lint, materialize, refresh and export refuse one in ``patches/overlay/``) and the tree (``census``: one in
# ``megatron/core`` or ``megatron/training`` is no edit, and every verb that reads the tree's edits refuses it,
# naming it, before ``refresh`` could fold it into the overlay).
_APPLY_LEFTOVERS = (".rej", ".orig", ".porig")
_EDITOR_BACKUPS = (".bak", ".swp", ".swo", ".swn", "~")


def stray_kind(path: str) -> str | None:
    """What the file at ``path`` is if it is a stray file (see the note): a phrase for messages, else None."""
    name = PurePosixPath(path).name
    if name.endswith(_APPLY_LEFTOVERS):
        return "a leftover of a failed or partial patch apply"
    if name.endswith(_EDITOR_BACKUPS) or (len(name) > 1 and name.startswith("#") and name.endswith("#")) \
            or name.startswith(".#"):
        return "an editor's backup, swap or lock file"
    return None


def is_stamp_file(name: str) -> bool:
    """A top-level entry of ``megatron/`` that holds a stamp, or one being written (hfsdp/atomic.py's temporary
    file, left by a killed run): never an edit or a kept entry (leftovers.py deals with the others)."""
    return name in (STAMP_NAME, NEXT_STAMP_NAME) or (
        name.startswith((f".{STAMP_NAME}.", f".{NEXT_STAMP_NAME}.")) and name.endswith(".tmp"))


@dataclass(frozen=True)
class Entry:
    """One entry under the tree: a file (sha256), a symlink (its target) or an empty folder."""

    kind: str  # "file" | "link" | "dir"
    digest: str = ""


def is_cache(rel: PurePosixPath) -> bool:
    return any(part in CACHE_DIRS for part in rel.parts) or rel.name.endswith(CACHE_SUFFIXES)


def scan(folder: Path, prefix: str = "megatron") -> dict[str, Entry]:
    """Every non-cache entry under ``folder`` (its stamp files excluded), keyed ``<prefix>/<relative path>``
    (``megatron/core/x.py`` for the materialized tree, also when it sits parked under another
    name). Symlinks are recorded, never followed."""
    out: dict[str, Entry] = {}
    if not folder.is_dir() or folder.is_symlink():
        return out

    def name(path: Path) -> str:
        return f"{prefix}/{path.relative_to(folder).as_posix()}"

    def walk(here: Path) -> None:
        with os.scandir(here) as it:
            entries = sorted(it, key=lambda e: e.name)
        if not entries and here != folder:
            out[name(here)] = Entry("dir")
        for entry in entries:
            path = Path(entry.path)
            if is_cache(PurePosixPath(name(path))) or (here == folder and is_stamp_file(entry.name)):
                continue
            if entry.is_symlink():
                out[name(path)] = Entry("link", os.readlink(path))
            elif entry.is_dir():
                walk(path)
            elif entry.is_file():
                out[name(path)] = Entry("file", sha256_file(path))
            else:
                out[name(path)] = Entry("other")  # a fifo or socket: cannot be copied

    walk(folder)
    return out


def is_source(path: str, members: tuple[str, ...]) -> bool:
    """A path that, as a regular file, is part of the patchable source (an edit if it changes)."""
    return any(path.startswith(m + "/") for m in members) and not path.endswith(KEPT_SUFFIXES)


@dataclass
class Census:
    """The tree sorted into edits (path -> modified/added/deleted) and kept entries."""

    edits: dict[str, str]
    kept: dict[str, Entry]
    strays: list[str] = field(default_factory=list)  # stray files under the members (see the note): no edits


def census(entries: dict[str, Entry], stamp_files: dict[str, str], members: tuple[str, ...]) -> Census:
    """Sort ``scan`` output against the stamp's files (see the note)."""
    edits: dict[str, str] = {}
    kept: dict[str, Entry] = {}
    strays: list[str] = []
    for path, entry in entries.items():
        if path in stamp_files:
            if entry.kind != "file" or entry.digest != stamp_files[path]:
                edits[path] = "modified"
        elif entry.kind == "file" and is_source(path, members) and stray_kind(path) is not None:
            strays.append(path)
        elif entry.kind == "file" and is_source(path, members):
            edits[path] = "added"
        else:
            kept[path] = entry
    for path in stamp_files:
        if path not in entries:
            edits[path] = "deleted"
    return Census(dict(sorted(edits.items())), dict(sorted(kept.items())), sorted(strays))


def linked_folders(entries: dict[str, Entry], stamp_files: dict[str, str]) -> list[str]:
    """Symlinks standing where the stamp has files below them: a folder of the tree replaced by a link
    (``scan`` never follows one, so every file below it would look deleted)."""
    folders = {str(parent) for path in stamp_files for parent in PurePosixPath(path).parents}
    return [path for path, entry in entries.items() if entry.kind == "link" and path in folders]


def hash_files(tree_root: Path, members: tuple[str, ...]) -> dict[str, str]:
    """sha256 of every source file (regular, non-cache, non-kept) under the members: the stamp's list."""
    return {p: e.digest for p, e in scan(tree_root / "megatron").items()
            if e.kind == "file" and is_source(p, members)}


def conflicts(kept: dict[str, Entry], new_root: Path) -> list[str]:
    """Kept paths that the new tree at ``new_root`` already uses (the path, or a parent as a file)."""
    clashing = []
    for path, entry in kept.items():
        target = new_root / path
        parents = [p for p in target.parents if new_root in p.parents]  # strictly below new_root
        if any(os.path.lexists(p) and (p.is_symlink() or not p.is_dir()) for p in parents):
            clashing.append(path)
        elif os.path.lexists(target) and not (entry.kind == "dir" and target.is_dir() and not target.is_symlink()):
            clashing.append(path)
    return clashing


def carry(kept: dict[str, Entry], old_root: Path, new_root: Path) -> None:
    """Copy kept entries from the old tree into the new one (call :func:`conflicts` first)."""
    for path, entry in kept.items():
        source, target = old_root / path, new_root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if entry.kind == "link":
            os.symlink(entry.digest, target)
        elif entry.kind == "dir":
            target.mkdir(exist_ok=True)
        elif entry.kind == "file":
            shutil.copy2(source, target)
        # "other" (fifo/socket) cannot be copied: materialize refuses before getting here


def copy_edits(edits: dict[str, str], src_root: Path, dst_root: Path) -> None:
    """Make ``dst_root`` (a queue) hold the edited files of ``src_root``: copy modified/added, delete deleted."""
    for path, kind in edits.items():
        dest = dst_root / path
        if kind == "deleted":
            dest.unlink(missing_ok=True)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src_root / path, dest)


def describe(paths: list[str], limit: int = 20) -> str:
    """Indented listing for error messages (at most ``limit`` lines)."""
    shown = "\n".join(f"    {p}" for p in paths[:limit])
    more = f"\n    ... and {len(paths) - limit} more" if len(paths) > limit else ""
    return shown + more


def changed_between(before: dict[str, Entry], after: dict[str, Entry]) -> list[str]:
    """Paths whose entry differs between two scans."""
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
