"""One lock per checkout for the verbs that write (materialize, refresh, export, pip install -e .).

An advisory ``flock`` on ``<checkout>/.patchset.lock``: the kernel releases it when the holder
exits, however it exits, so a killed build never leaves the checkout locked. The file records
who holds it, for the message a second writer gets. Read-only verbs take no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from hfsdp.usererror import not_a_regular_file, quoted

from . import leftovers
from .errors import PatchsetError

if TYPE_CHECKING:
    from .project import Project

LOCK_NAME = ".patchset.lock"


class Locked(PatchsetError):
    """Another writing verb holds this checkout's lock."""


def _open_lock(path: Path, verb: str) -> int:
    """The lock file, opened (made if missing). Anything there but a regular file is refused, never written
    through: a link would make the lock elsewhere, and a named pipe or a device takes no lock record."""
    way_out = f"move {quoted(path)} away (the next writer makes a new one), then run `scripts/patchset {verb}` again"
    if os.path.islink(path) or (os.path.lexists(path) and not_a_regular_file(path)):
        why = "is a symbolic link, not a regular file" if os.path.islink(path) else not_a_regular_file(path)
        raise PatchsetError(f"the checkout's lock {path} {why}; the writing verbs take their lock on a file of "
                            "their own there, never through a link", way_out)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        raise PatchsetError(f"cannot create the lock {path}: {exc.strerror}",
                            f"`scripts/patchset {verb}` writes the checkout; make {path.parent} writable") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the look and the open
        os.close(fd)
        raise PatchsetError(f"the checkout's lock {path} is not a regular file", way_out)
    return fd


@contextlib.contextmanager
def checkout_lock(root: Path, verb: str) -> Iterator[None]:
    """Hold the checkout's write lock for the block; raise Locked at once if someone else has it."""
    path = root / LOCK_NAME
    fd = _open_lock(path, verb)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise Locked(
                f"{root} is being written by {holder}; two writers could interleave their changes",
                f"wait for it to finish, then run `scripts/patchset {verb}` again (the lock ends with that process)",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"`scripts/patchset {verb}` (pid {os.getpid()}, since {time.strftime('%H:%M:%S')})".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # no stale holder named once we are done
    finally:
        os.close(fd)  # closing releases the flock


@contextlib.contextmanager
def writing(project: Project, verb: str, log: Callable[[str], None]) -> Iterator[None]:
    """What every writing verb starts with: the lock, then the leftovers of killed writers."""
    with checkout_lock(project.root, verb):
        leftovers.recover(project, log)
        yield


def is_free(root: Path) -> bool:
    """Whether a writer could take the checkout's lock now (False also where it cannot be made: read-only)."""
    try:
        fd = _open_lock(root / LOCK_NAME, "materialize")
    except PatchsetError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
