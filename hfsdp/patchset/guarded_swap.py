"""Replace a folder with a fully built one, and lose nothing that changed while it was built.

[Note: guarded swap] Writers build the new ``megatron/`` or ``patches/`` in a temporary folder
beside it, validate it, then call :func:`swap_in`: park the old folder (rename), rename the new
one into place, and re-read the parked folder. If anything in it differs from the snapshot the
build started from (an editor saved a file meanwhile), the swap is undone and the run refused,
naming the files; otherwise the parked folder is deleted, or kept as a backup. Renames within
one filesystem are atomic, so a reader sees the old folder or the new one; a run killed between
the two renames leaves a ``.patchset-old-*`` folder that the next writer restores (leftovers.py).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hfsdp.usererror import quoted

from .errors import PatchsetError
from .scan import changed_between, describe

OLD_PREFIX = ".patchset-old-"
TMP_PREFIX = ".patchset-tmp-"


class OldFolderKept(PatchsetError):
    """The new folder is in place; the old one could not be deleted and is kept as a backup."""


class NotSwapped(PatchsetError):
    """A rename of the swap failed (a folder in use, a parent that cannot be written): the old folder is in place,
    as it was, and the new one is discarded with its scratch folder."""


class ChangedDuringBuild(PatchsetError):
    """Files changed while the replacement was being built; nothing was replaced."""


def parked_name(root: Path, what: str) -> Path:
    return root / f"{OLD_PREFIX}{what}-{os.getpid()}-{time.time_ns()}"


def backup_name(root: Path, what: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = root / f"{what}.bak-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = root / f"{what}.bak-{stamp}-{n}"
    return path


def swap_in(target: Path, built: Path, snapshot: dict, rescan: Callable[[Path], dict], rerun: str,
            keep_old_as: Path | None = None) -> Path | None:
    """Put ``built`` at ``target`` (see the note); return where the old folder was kept, if anywhere.

    ``snapshot`` is ``rescan(target)`` from before the build; ``rerun`` is the command to repeat.
    """
    root = target.parent
    if not os.path.lexists(target):  # a symlink there (even a dangling one) is parked, never followed
        if snapshot:
            raise ChangedDuringBuild(f"{target} disappeared while the replacement was being built; nothing was "
                                     "replaced", f"restore it, then run `{rerun}` again")
        os.rename(built, target)  # fails (nothing lost) if a folder appeared there meanwhile
        return None
    parked = parked_name(root, target.name)
    try:
        os.rename(target, parked)
    except OSError as exc:
        raise _not_swapped(target, exc, "the old one could not be moved aside", rerun) from None
    try:
        os.rename(built, target)
    except BaseException as exc:
        os.rename(parked, target)
        if isinstance(exc, OSError):
            raise _not_swapped(target, exc, "the new one could not be moved in (the old one was moved back)",
                               rerun) from None
        raise
    changed = changed_between(snapshot, rescan(parked))
    if changed:
        os.rename(target, built)  # hand the new folder back to its (temporary) builder
        os.rename(parked, target)
        raise ChangedDuringBuild(
            f"{len(changed)} file(s) in {target} changed while the replacement was being built; nothing was "
            f"replaced, the changes are where you made them:\n{describe(changed)}",
            f"run `{rerun}` again once you are done editing (if the changes are edits to keep, it says how "
            "to save them first)",
        )
    if keep_old_as is not None:
        try:
            os.rename(parked, keep_old_as)
        except OSError as exc:  # the new folder is in place; the old one, whole, stays where it was parked
            raise OldFolderKept(
                f"{target} is the new one; the old one, whole, could not be renamed to {keep_old_as} "
                f"({exc.strerror or exc}) and is kept as {parked}",
                f"rename it yourself (`mv {quoted(parked)} {quoted(keep_old_as)}`); nothing needs to be "
                "rebuilt") from None
        return keep_old_as
    try:
        remove_tree(parked)
    except OSError as exc:  # the new folder is in place: say so, and keep what is left as a backup
        kept = backup_name(root, target.name)
        os.rename(parked, kept)
        where = str(exc.filename or "")  # a path in the parked folder, which is now ``kept``: name it there
        if where == str(parked) or where.startswith(f"{parked}{os.sep}"):
            where = f"{kept}{where[len(str(parked)):]}"
        raise OldFolderKept(
            f"{target} is the new one; the old one could not be deleted ({exc.strerror}: {where}), "
            f"and what is left of it is kept as {kept}",
            f"look inside {kept}, make what is left deletable, then remove it yourself "
            f"(`rm -rf {quoted(kept)}`); nothing needs to be rebuilt") from None
    return None


def remove_tree(folder: Path) -> None:
    """``shutil.rmtree(folder)``, deleting all it can; the first entry it cannot delete is raised as an OSError
    whose ``filename`` is that entry's full path (rmtree's own error names it relative to the folder it was in:
    ``enums.py`` of an immutable ``megatron/core/enums.py``)."""
    failed: list[OSError] = []

    def note(function: object, path: str, exc: BaseException) -> None:
        if isinstance(exc, OSError) and not failed:
            failed.append(OSError(exc.errno, exc.strerror, path))
        elif not isinstance(exc, OSError):
            raise exc

    if sys.version_info >= (3, 12):  # noqa: UP036 (scripts/patchset runs on 3.11 too)
        shutil.rmtree(folder, onexc=note)
    else:  # onexc is new in 3.12
        shutil.rmtree(folder, onerror=lambda function, path, info: note(function, path, info[1]))
    if failed:
        raise failed[0]


def _not_swapped(target: Path, exc: OSError, why: str, rerun: str) -> NotSwapped:
    return NotSwapped(
        f"the new {target.name}/ could not be put in place: {why} ({exc.strerror or exc}); {target} is the old "
        "one, as it was, and the new one was discarded: nothing was replaced and nothing was left half-written",
        f"make {target} movable (nothing mounted on it or in use as a mount point, its folder {target.parent} "
        f"writable), then run `{rerun}` again")
