"""One lock per checkout for the verbs that write (materialize, refresh, export, pip install -e .).

An advisory ``flock`` on ``<checkout>/.patchset.lock``: the kernel releases it when the holder
exits, however it exits, so a killed build never leaves the checkout locked. The file records
who holds it, for the message a second writer gets. Read-only verbs take no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from . import leftovers
from .errors import PatchsetError

if TYPE_CHECKING:
    from .project import Project

LOCK_NAME = ".patchset.lock"


class Locked(PatchsetError):
    """Another writing verb holds this checkout's lock."""


@contextlib.contextmanager
def checkout_lock(root: Path, verb: str) -> Iterator[None]:
    """Hold the checkout's write lock for the block; raise Locked at once if someone else has it."""
    path = root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise PatchsetError(f"cannot create the lock {path}: {exc.strerror}",
                            f"`scripts/patchset {verb}` writes the checkout; make {root} writable") from exc
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
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
