"""The overlay: whole files of the fork that upstream does not have, kept as ordinary source.

[Note: the overlay] ``patches/overlay/`` mirrors ``megatron/``: the file
``patches/overlay/megatron/core/x/y.py`` is materialized as ``megatron/core/x/y.py``. Patches hold
only changes to upstream files; every file upstream does not have lives here, so it is reviewed
and edited as a file, not as a diff (and never as a diff of a diff). The rules:

* an overlay file lies under a pinned member (``megatron/core``, ``megatron/training``), is a
  regular UTF-8 text file, and is not a cache or a built object (``.pyc``, ``.so``, ``.o``,
  ``.lock``); anything else in ``patches/overlay/`` is refused, naming it, by every verb that
  reads the overlay (``lint`` lists them all);
* the overlay only adds files: a path the base already has is refused when a tree is built;
* in every build the overlay is one commit (subject ``overlay``) right after the base commit,
  before the patch commits ([Note: the queue] in tree.py), so a patch may still touch an overlay
  file mechanically, but ``lint`` refuses it (edit the overlay file instead);
* the overlay lives under ``patches/`` so that the all-or-nothing swap of ``patches/`` (guarded_swap.py)
  covers it: ``refresh`` and ``export`` write patches, ``series`` and the overlay in one step.

Standard library only (``pip install -e .`` runs this inside its isolated build environment).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .errors import SeriesError
from .pin import is_relative_path
from .scan import CACHE_DIRS, KEPT_SUFFIXES, is_cache, stray_kind

OVERLAY_DIR_NAME = "overlay"  # patches/overlay
OVERLAY_SUBJECT = "overlay"  # subject of the overlay commit in every queue (a reserved patch name)
OVERLAY_FIX = "move the file into patches/overlay/ at its megatron/ path"


def text_sha256(text: str) -> str:
    """sha256 of a text as the UTF-8 bytes it is stored as (a file's sha256, as scan.py computes it)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Overlay:
    """The overlay's files: ``megatron/...`` path -> text, sorted by path."""

    files: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert list(self.files) == sorted(self.files), f"overlay paths must be sorted, got {list(self.files)}"

    @staticmethod
    def of(files: dict[str, str]) -> Overlay:
        return Overlay(dict(sorted(files.items())))

    @property
    def paths(self) -> list[str]:
        return list(self.files)

    def digests(self) -> tuple[tuple[str, str], ...]:
        """(path, sha256) of each file, in path order: what the stamp and a queue's state record."""
        return tuple((path, text_sha256(text)) for path, text in self.files.items())


def source_name(path: str) -> str:
    """Where an overlay file is kept in a checkout, for messages: ``patches/overlay/megatron/...``."""
    return f"patches/{OVERLAY_DIR_NAME}/{path}"


def path_problem(path: str, members: tuple[str, ...]) -> str | None:
    """Why ``path`` (a ``megatron/...`` path) cannot be an overlay file, or None if it can (see the note)."""
    if not is_relative_path(path):
        return f"{path!r} is not a relative path"
    if not any(path.startswith(member + "/") for member in members):
        return f"is outside {', '.join(members)}; the overlay holds files of those folders only"
    if is_cache(PurePosixPath(path)) or path.endswith(KEPT_SUFFIXES):
        return "is a cache, a built object or a lock file, never an overlay file"
    if (kind := stray_kind(path)) is not None:
        return f"is {kind}, never an overlay file"
    return None


def _walk(folder: Path) -> Iterable[tuple[str, os.DirEntry[str]]]:
    """(posix path relative to ``folder``, entry) of every non-folder entry below ``folder``; links are not
    followed; cache folders (``__pycache__``, Python's own) are skipped, a loose cache file is not: someone
    put it there, and :func:`path_problem` refuses it."""
    stack = [folder]
    while stack:
        here = stack.pop()
        with os.scandir(here) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            rel = Path(entry.path).relative_to(folder).as_posix()
            if entry.is_dir(follow_symlinks=False):
                if not is_cache(PurePosixPath(rel)):
                    stack.append(Path(entry.path))
            elif not any(part in CACHE_DIRS for part in PurePosixPath(rel).parts):
                yield rel, entry


def scan_overlay(folder: Path, members: tuple[str, ...]) -> tuple[Overlay, list[str]]:
    """The overlay at ``folder`` (``patches/overlay``) and one sentence per entry that cannot be an overlay
    file (see the note). A missing folder is an empty overlay."""
    files: dict[str, str] = {}
    problems: list[str] = []
    if folder.is_symlink() or (os.path.lexists(folder) and not folder.is_dir()):
        return Overlay(), [f"patches/{OVERLAY_DIR_NAME} is not a folder (a symbolic link or a file); "
                           "it must be a real folder of files"]
    if not folder.is_dir():
        return Overlay(), []
    for rel, entry in _walk(folder):
        where = source_name(rel)
        if entry.is_symlink():
            problems.append(f"{where} is a symbolic link; the overlay holds regular files only")
            continue
        if not entry.is_file(follow_symlinks=False):
            problems.append(f"{where} is not a regular file")
            continue
        if (why := path_problem(rel, members)) is not None:
            problems.append(f"{where} {why}")
            continue
        try:
            files[rel] = Path(entry.path).read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start})")
    return Overlay.of(files), problems


def read_overlay(folder: Path, members: tuple[str, ...]) -> Overlay:
    """The overlay at ``folder``; any entry that cannot be an overlay file is refused (see the note)."""
    overlay, problems = scan_overlay(folder, members)
    if problems:
        listing = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise SeriesError(f"patches/{OVERLAY_DIR_NAME}/ holds what cannot be an overlay file: {listing}",
                          "move each such entry out of patches/overlay/ (or into megatron/core or "
                          "megatron/training below it; delete a backup, or a .rej or .orig left by an apply), "
                          "then run the command again; `scripts/patchset lint` lists them all")
    return overlay


def write_files(root: Path, files: dict[str, str]) -> None:
    """Write ``files`` (path -> text) below ``root``, creating folders; bytes exactly as recorded."""
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text.encode("utf-8"))


def taken_paths(tree: Path, paths: Iterable[str]) -> list[str]:
    """The ``paths`` that the tree at ``tree`` already uses: the path itself, or a parent as a non-folder."""
    def taken(path: str) -> bool:
        here = PurePosixPath(path)
        return os.path.lexists(tree / here) or any(
            os.path.lexists(tree / parent) and (os.path.islink(tree / parent) or not (tree / parent).is_dir())
            for parent in here.parents)
    return [path for path in paths if taken(path)]


def add_to_tree(tree: Path, overlay: Overlay, base_name: str) -> None:
    """Copy the overlay into the base tree at ``tree`` (a queue's work tree). A path the base already has, or
    one below a base file, is refused: the overlay only adds files (see the note)."""
    if taken := taken_paths(tree, overlay.paths):
        raise SeriesError(
            f"the overlay would replace files of the {base_name} sdist ({', '.join(source_name(p) for p in taken)}); "
            "the overlay only adds files upstream does not have. Nothing was written",
            "delete those files from patches/overlay/; a change to an upstream file is a patch: edit it in "
            "megatron/, then `scripts/patchset refresh`",
        )
    write_files(tree, overlay.files)
