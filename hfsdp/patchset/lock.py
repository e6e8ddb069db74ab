"""One lock per checkout for the verbs that write (materialize, refresh, export, pip install -e .).

An advisory ``flock`` on ``<checkout>/.patchset.lock`` ([Note: held locks] in hfsdp/filelock.py): the
kernel releases it when the holder exits, however it exits, so a killed build never leaves the
checkout locked. The file records
who holds it, for the message a second writer gets. Read-only verbs take no lock.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from hfsdp import filelock
from hfsdp.usererror import quoted

from . import leftovers
from .errors import PatchsetError

if TYPE_CHECKING:
    from .project import Project

LOCK_NAME = ".patchset.lock"


class Locked(PatchsetError):
    """Another writing verb holds this checkout's lock."""


def _lock_error(path: Path, verb: str, exc: filelock.NotALockFile | OSError) -> PatchsetError:
    """Why the lock file cannot be taken, as the checkout's error. Anything there but a regular file is
    refused, never written through: a link would make the lock elsewhere, and a named pipe or a device
    takes no lock record."""
    way_out = f"move {quoted(path)} away (the next writer makes a new one), then run `scripts/patchset {verb}` again"
    if isinstance(exc, filelock.NotALockFile):
        if exc.why == "is not a regular file":  # replaced between the look and the open
            return PatchsetError(f"the checkout's lock {path} is not a regular file", way_out)
        return PatchsetError(f"the checkout's lock {path} {exc.why}; the writing verbs take their lock on a file of "
                             "their own there, never through a link", way_out)
    return PatchsetError(f"cannot create the lock {path}: {exc.strerror}",
                         f"`scripts/patchset {verb}` writes the checkout; make {path.parent} writable")


@contextlib.contextmanager
def checkout_lock(root: Path, verb: str) -> Iterator[None]:
    """Hold the checkout's write lock for the block; raise Locked at once if someone else has it
    ([Note: held locks] in hfsdp/filelock.py: the lock ends with its holder's process)."""
    path = root / LOCK_NAME
    holder = f"`scripts/patchset {verb}` (pid {os.getpid()}, since {time.strftime('%H:%M:%S')})"
    held = contextlib.ExitStack()
    try:
        held.enter_context(filelock.exclusive(path, holder))
    except filelock.Held as busy:
        raise Locked(
            f"{root} is being written by {busy.holder or 'another process'}; two writers could interleave their "
            "changes",
            f"wait for it to finish, then run `scripts/patchset {verb}` again (the lock ends with that process)",
        ) from None
    except (filelock.NotALockFile, OSError) as exc:
        raise _lock_error(path, verb, exc) from exc
    with held:
        yield


@contextlib.contextmanager
def writing(project: Project, verb: str, log: Callable[[str], None]) -> Iterator[None]:
    """What every writing verb starts with: the lock, then the leftovers of killed writers."""
    with checkout_lock(project.root, verb):
        leftovers.recover(project, log)
        yield


def is_free(root: Path) -> bool:
    """Whether a writer could take the checkout's lock now (False also where it cannot be made: read-only)."""
    return filelock.is_free(root / LOCK_NAME)
