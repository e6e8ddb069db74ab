"""Materialize ``megatron/`` atomically, keep what the tool did not make, and report the tree's state.

Rules: one writer per checkout (lock.py), leftovers of killed writers recovered first
(leftovers.py); an up-to-date tree is left alone, its local edits included; a rebuild happens in a
temporary folder beside the target, carries over every kept entry (scan.py's note), and is
swapped in only if nothing changed in the old tree meanwhile (guarded_swap.py's note); a tree with edits,
or one this tool did not make, is never replaced except with ``--backup``, which keeps it whole.

[Note: a tree behind a symbolic link] ``megatron/`` and the folders of it that hold the stamp's
files must be real folders. ``scan`` records a symlink and never follows it, so through a link every
file would look deleted (``status`` listed them all, ``diff`` printed a patch deleting them, ``refresh``
folded that into the series), while a writer would follow it into the folder it points to. So every
verb that reads the tree (status, diff, refresh, materialize) refuses such a link before it reads or
writes anything, and names two ways out: put the folder itself in the link's place, or
``materialize --backup``, which renames the link (never the folder it points to) to
``megatron.bak-*`` and builds a fresh tree. The verbs that never look at the tree (check, lint,
queue, export, ``diff --series``) work as usual.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hfsdp.usererror import quoted

from .errors import REBASE_EDITS_FIX, DirtyTree, ForeignTree, LinkedTree, PatchsetError, SeriesError
from .guarded_swap import TMP_PREFIX, backup_name, swap_in
from .leftovers import Leftover, any_leftovers, find_leftovers
from .lock import is_free, writing
from .project import Project
from .scan import (
    STAMP_NAME,
    Census,
    Entry,
    carry,
    census,
    conflicts,
    describe,
    hash_files,
    linked_folders,
    scan,
    stray_kind,
)
from .source import locate_sdist
from .stamp import CorruptStamp, Stamp, make_stamp, read_stamp, write_stamp_file
from .tree import build_queue


@dataclass
class TreeStatus:
    """What ``status`` reports."""

    exists: bool
    stamped: bool
    up_to_date: bool
    applied: list[str] = field(default_factory=list)  # patch names in the stamp
    series: list[str] = field(default_factory=list)  # patch names in patches/series
    changed_patches: list[str] = field(default_factory=list)  # listed in both, file differs
    overlay_files: int = 0  # files in patches/overlay/
    changed_overlay: dict[str, str] = field(default_factory=dict)  # path -> changed/new/removed since the build
    edits: dict[str, str] = field(default_factory=dict)
    overlay_edits: list[str] = field(default_factory=list)  # edits that refresh writes to patches/overlay/
    kept: dict[str, Entry] = field(default_factory=dict)  # not made by this tool; a rebuild keeps them
    base_mismatch: str | None = None
    fork_mismatch: str | None = None  # the tree's fork version differs from patches/base.toml's
    leftovers: list[Leftover] = field(default_factory=list)  # of killed writers (leftovers.py)
    unlisted: list[str] = field(default_factory=list)  # patch files in patches/ that the series does not list


def _linked(link: Path, tree: Path | None) -> LinkedTree:
    """The refusal for the symlink ``link``: megatron/ itself (``tree`` None) or a folder in the tree ``tree``."""
    dest = Path(os.path.realpath(link))
    here = Path(os.path.realpath(link.parent))
    inside = "" if tree is None else ", where the tree has files of its own"
    cause = (f"{link} is a symbolic link to {dest}{'' if dest.exists() else ' (which does not exist)'}{inside}; "
             "this tool works on megatron/ only as real folders (through the link every file would look deleted), "
             "so it read and changed nothing")
    backup = ("`scripts/patchset materialize --backup` (renames the link, not the folder it points to, to "
              "megatron.bak-* and builds a fresh tree)" if tree is None else
              "`scripts/patchset materialize --backup` (moves the whole tree, the link in it included, to "
              "megatron.bak-* and builds a fresh one)")
    movable = (dest.is_dir() and dest not in (here, *here.parents)
               and (tree is None or Path(os.path.realpath(tree)) not in (dest, *dest.parents)))
    if movable:
        return LinkedTree(cause, f"put the folder itself in the link's place: `unlink {quoted(link)}`, then "
                                 f"`mv {quoted(dest)} {quoted(link)}`; or set the link aside: {backup}")
    return LinkedTree(cause, f"set the link aside: {backup}")


def require_real_tree(project: Project) -> None:
    """Refuse a megatron/ that is a symbolic link (see the note)."""
    if project.megatron_dir.is_symlink():
        raise _linked(project.megatron_dir, None)


def live_census(project: Project, stamp: Stamp, entries: dict[str, Entry] | None = None) -> Census:
    """megatron/ (``entries``: its scan, if made already) sorted against its stamp; a tree read through a
    symbolic link is refused (see the note)."""
    require_real_tree(project)
    entries = scan(project.megatron_dir) if entries is None else entries
    if links := linked_folders(entries, stamp.files):
        raise _linked(project.root / links[0], project.megatron_dir)
    found = census(entries, stamp.files, project.pin().members)
    if found.strays:
        raise stray_files(project, found.strays)
    return found


def stray_files(project: Project, strays: list[str]) -> SeriesError:
    """The refusal for stray files in the tree ([Note: stray files] in scan.py): never an edit, so never folded."""
    listing = "; ".join(f"{path} is {stray_kind(path)}" for path in strays[:5])
    more = f" (and {len(strays) - 5} more such files)" if len(strays) > 5 else ""
    paths = " ".join(quoted(project.root / path) for path in strays)
    return SeriesError(f"{listing}{more}: not a file of the fork, so never an edit or an overlay file; nothing was "
                       "changed",
                       f"apply by hand what a .rej holds if it still matters, then delete "
                       f"{'it' if len(strays) == 1 else 'them'} (`rm {paths}`) or move "
                       f"{'it' if len(strays) == 1 else 'them'} out of megatron/, and run the command again")


def overlay_edits(edits: dict[str, str], stamp: Stamp) -> list[str]:
    """The edits that belong to the overlay: of files the tree got from the overlay, and new files (which
    ``refresh`` adds to the overlay)."""
    built = dict(stamp.overlay)
    return [path for path, kind in edits.items() if path in built or kind == "added"]


def tree_status(project: Project) -> TreeStatus:
    """Read-only: nothing in the checkout is written."""
    require_real_tree(project)
    pin = project.pin()
    patches = project.series()
    overlay = project.overlay()
    names = [p.name for p in patches]
    leftovers = find_leftovers(project)
    unlisted = project.unlisted(names)
    if not project.megatron_dir.exists():
        return TreeStatus(False, False, False, series=names, overlay_files=len(overlay.files), leftovers=leftovers,
                          unlisted=unlisted)
    stamp = read_stamp(project.root)
    if stamp is None:
        return TreeStatus(True, False, False, series=names, overlay_files=len(overlay.files), leftovers=leftovers,
                          unlisted=unlisted)
    applied = dict(stamp.patches)
    current = dict(Stamp.expected_patches(patches))
    found = live_census(project, stamp)
    status = TreeStatus(
        exists=True,
        stamped=True,
        up_to_date=stamp.matches(pin, patches, overlay),
        applied=[n for n, _ in stamp.patches],
        series=names,
        changed_patches=[n for n in names if n in applied and applied[n] != current[n]],
        overlay_files=len(overlay.files),
        changed_overlay=stamp.overlay_changes(overlay),
        edits=found.edits,
        overlay_edits=overlay_edits(found.edits, stamp),
        kept=found.kept,
        leftovers=leftovers,
        unlisted=unlisted,
    )
    if stamp.base_version != pin.version or stamp.sdist_sha256 != pin.sha256:
        status.base_mismatch = (f"tree built from {stamp.base_version} ({stamp.sdist_sha256[:12]}), "
                                f"pin is {pin.version} ({pin.sha256[:12]})")
        if (other := project.for_stamp(stamp.base_version, stamp.sdist_sha256)) is not None:
            status.base_mismatch = (f"tree built from base {stamp.base_version} ({other.base_label}), this command "
                                    f"works on base {pin.version} -> `--base {stamp.base_version}` works on the "
                                    f"tree as it is; `materialize` switches it to {pin.version}")
    if stamp.fork_version != pin.fork_version and status.base_mismatch is None:
        status.fork_mismatch = (f"tree stamped {stamp.fork_version}, patches/base.toml says "
                                f"{pin.fork_version} ([fork] release changed)")
    return status


def _refuse_if_unsafe(project: Project, stamp: Stamp | None, found: Census | None) -> None:
    """Raise when replacing megatron/ could lose someone's work (without --backup)."""
    target = project.megatron_dir
    if not target.is_dir():
        raise ForeignTree(f"{target} is a file, not a folder: it was not made by this tool, so it may hold your work",
                          f"move it away (`mv {quoted(target)} {quoted(f'{target}.mine')}`) and run "
                          "`scripts/patchset materialize` again, "
                          "or run `scripts/patchset materialize --backup` (moves it to megatron.bak-* and rebuilds)")
    if stamp is None:
        if any(target.iterdir()):
            raise ForeignTree(
                f"{target} exists but has no {STAMP_NAME}: it was not made by this tool, so it may hold your work",
                f"move it away (`mv {quoted(target)} {quoted(f'{target}.mine')}`) and run "
                "`scripts/patchset materialize` again, or "
                "run `scripts/patchset materialize --backup` (moves it to megatron.bak-* and rebuilds)",
            )
        return
    if found is None:
        raise PatchsetError("a stamped megatron/ was not read before deciding to replace it; nothing was changed",
                            "run `scripts/patchset materialize` again")
    pin = project.pin()
    if found.edits and (stamp.base_version, stamp.sdist_sha256) != (pin.version, pin.sha256):
        raise DirtyTree(
            f"{target} was built from base {stamp.base_version} and has {len(found.edits)} local edit(s) that "
            f"switching it to base {pin.version} would overwrite; nothing was changed",
            f"fold them into base {stamp.base_version} first (`scripts/patchset --base {stamp.base_version} "
            f"refresh`), or keep the edited tree as megatron.bak-* (`scripts/patchset --base {pin.version} "
            "materialize --backup`)",
        )
    if found.edits:
        listing = describe([f"{kind:8} {path}" for path, kind in found.edits.items()])
        raise DirtyTree(
            f"{target} has local edits that a rebuild would overwrite; nothing was changed:\n{listing}",
            REBASE_EDITS_FIX,  # only a stale tree is rebuilt without --backup
        )


def materialize(project: Project, sdist: Path | None = None, backup: bool = False,
                log: Callable[[str], None] = print) -> bool:
    """Make megatron/ match the pin and the series. Returns True if the tree was rebuilt."""
    if not backup:
        require_real_tree(project)  # --backup renames a link aside (see the note)
        # Nothing to write: no lock needed (a read-only checkout or a busy one is fine), unless a killed run left
        # something that the lock lets us clean up (leftovers.py).
        recover = any_leftovers(project.root) and is_free(project.root)
        if not recover and project.patches_dir.is_dir() and _report_up_to_date(project, log):
            return False
    with writing(project, "materialize" + (" --backup" if backup else ""), log):
        return _materialize(project, sdist, backup, log)


def refuse_unlisted(project: Project) -> None:
    """Refuse to build from a series that lost patches ``patches/`` still holds: the tree would carry
    the fork's version and stamp without those changes (an emptied series would build the release
    itself). Leaving a patch out is said by deleting its file, or moving it out of ``patches/``."""
    names = [p.name for p in project.series()]
    if unlisted := project.unlisted(names):
        shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
        where = project.base_label
        raise SeriesError(
            f"{where}series lists {len(names)} patch(es) and {where} holds {len(unlisted)} more it does not list "
            f"({shown}); a tree built without them would be stamped as the fork without their changes. "
            "Nothing was built",
            f"restore {where}series (`git checkout -- {where}series`), add the names back, or, to leave a patch "
            "out for good, delete its file",
        )


def _report_up_to_date(project: Project, log: Callable[[str], None]) -> bool:
    refuse_unlisted(project)  # a tree built from the shorter series would look up to date
    pin, patches, overlay = project.pin(), project.series(), project.overlay()
    stamp = read_stamp(project.root) if project.megatron_dir.exists() else None
    if stamp is None or not stamp.matches(pin, patches, overlay):
        return False
    edits = live_census(project, stamp).edits
    note = f"; {len(edits)} local edit(s) left as they are" if edits else ""
    log(f"patchset: megatron/ is up to date ({pin.fork_version}, {len(overlay.files)} overlay files, "
        f"{len(patches)} patches); nothing to do{note}")
    return True


def _materialize(project: Project, sdist: Path | None, backup: bool, log: Callable[[str], None]) -> bool:
    refuse_unlisted(project)
    pin = project.pin()
    patches = project.series()
    overlay = project.overlay()
    target = project.megatron_dir
    if not backup:
        require_real_tree(project)
    snapshot = scan(target)  # {} for a link: it is renamed aside whole, never read through
    try:
        stamp = read_stamp(project.root) if target.exists() and not target.is_symlink() else None
    except CorruptStamp:
        if not backup:
            raise
        stamp = None  # --backup: the whole tree goes to megatron.bak-*; nothing is classified
    found = None
    if stamp is not None:
        found = census(snapshot, stamp.files, pin.members) if backup else live_census(project, stamp, snapshot)
    if not backup and _report_up_to_date(project, log):  # again, under the lock
        return False
    if target.exists() and not backup:
        _refuse_if_unsafe(project, stamp, found)
    kept = found.kept if found is not None else {}
    if unmovable := [p for p, e in kept.items() if e.kind == "other"]:
        raise PatchsetError("megatron/ holds entries that cannot be carried into a rebuilt tree:\n"
                            f"{describe(unmovable)}",
                            "move them out of megatron/, then run `scripts/patchset materialize` again")
    source = locate_sdist(pin, sdist)
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=project.root))
    try:
        queue = build_queue(pin, source, patches, scratch / "queue", overlay)
        shutil.rmtree(queue.repo / ".git")
        write_stamp_file(queue.repo, make_stamp(pin, patches, overlay, hash_files(queue.repo, pin.members)))
        built = queue.repo / "megatron"
        if clashing := conflicts(kept, queue.repo):
            if not backup:
                raise PatchsetError(
                    "the new tree has files where megatron/ holds things this tool did not make; nothing was "
                    f"changed:\n{describe(clashing)}",
                    "move those out of megatron/ and run `scripts/patchset materialize` again, or run "
                    "`scripts/patchset materialize --backup` (the old tree, with them, is kept as megatron.bak-*)",
                )
            kept = {p: e for p, e in kept.items() if p not in clashing}  # they stay in the backup
        carry(kept, project.root, queue.repo)
        keep_as = backup_name(project.root, "megatron") if backup and os.path.lexists(target) else None
        kept_at = swap_in(target, built, snapshot, scan, "scripts/patchset materialize", keep_old_as=keep_as)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if kept_at is not None:
        log(f"patchset: previous tree kept at {kept_at}")
    if kept:
        log(f"patchset: carried {len(kept)} entr{'y' if len(kept) == 1 else 'ies'} not made by this tool into "
            "the new tree")
    log(
        f"patchset: materialized megatron/ = {pin.distribution} {pin.version} + {len(overlay.files)} overlay files "
        f"+ {len(patches)} patches -> {pin.fork_version} in {time.monotonic() - started:.1f}s"
    )
    return True


def kept_summary(kept: dict[str, Entry], limit: int = 10) -> list[str]:
    """Lines for ``status``: the first ``limit`` kept entries, then a count of the rest."""
    lines = [f"{e.kind:4} {p}" + (f" -> {e.digest}" if e.kind == "link" else "")
             for p, e in list(kept.items())[:limit]]
    return lines + ([f"... and {len(kept) - limit} more"] if len(kept) > limit else [])
