"""An exclusive lock on a file of its own, held by an open file: the one lock helper of this project.

[Note: held locks] The lock is an advisory ``flock`` on a regular file that is never removed. The
kernel holds it for the open file and drops it when the holder exits, however it exits, so a
killed holder never leaves it taken: there is no stale lock to recover by hand or by guessing
whether a pid is still alive, and taking a lock a dead holder had is the same single
``flock(LOCK_EX | LOCK_NB)`` as taking a fresh one, which the kernel grants to exactly one of any
number of racing takers. (A lock that is a file's existence, made with ``O_EXCL``, needs its
recoverer to delete and remake it, and two recoverers can both win.) On NFS, Linux maps ``flock``
to the server's byte-range locks, so holders on other hosts count too.

The holder writes one line saying who it is into the file (:func:`holder_line` gives the usual
words: pid, host, start time), for the message the next taker gets, and empties it on release; a
killed holder's line stays behind, and is overwritten by the next holder before anyone can read
it as the holder's (a reader reads the line only when the lock is taken, and waits a moment for
the line of a holder that has just taken it). The file is never taken
through a symbolic link (it would lock elsewhere) nor on anything but a regular file (a named pipe
or a device takes no lock).

Standard library only (``hfsdp.patchset`` uses it inside pip's build environment).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from hfsdp.usererror import not_a_regular_file


class NotALockFile(Exception):
    """Something other than a regular file stands where the lock file goes; ``why`` ends a sentence about it."""

    def __init__(self, path: Path, why: str) -> None:
        self.path = path
        self.why = why
        super().__init__(f"{path} {why}")


class Held(Exception):
    """Another open file holds the lock; ``holder`` is the line its holder wrote ('' when none yet)."""

    def __init__(self, path: Path, holder: str) -> None:
        self.path = path
        self.holder = holder
        super().__init__(f"{path} is held by {holder or 'another process'}")


def holder_line(what: str) -> str:
    """``what`` with this process's pid, host and start time: ``"<what> (pid 12, host n1, since 2026-...)"``."""
    since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return f"{what} (pid {os.getpid()}, host {socket.gethostname()}, since {since})"


def _problem(path: Path) -> str | None:
    """Why ``path`` cannot be the lock file (None: a regular file, or nothing yet)."""
    if os.path.islink(path):
        return "is a symbolic link, not a regular file"
    if os.path.lexists(path):
        return not_a_regular_file(path)
    return None


def open_lock(path: Path) -> int:
    """The lock file, opened for reading and writing (made if missing). NotALockFile for anything there
    but a regular file; an OSError of the open (a folder we may not write) is the caller's to word."""
    if why := _problem(path):
        raise NotALockFile(path, why)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the look and the open
        os.close(fd)
        raise NotALockFile(path, "is not a regular file")
    return fd


HOLDER_WAIT_S = 0.5  # how long a refused taker waits for a holder that just took the lock to write its line


POLL_S = 1.0  # how often a waiting taker tries again


def _holder(fd: int) -> str:
    """The holder's line; a holder that has just taken the lock writes it a moment later."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while not (line := os.pread(fd, 400, 0).decode("utf-8", "replace").strip()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return line


@contextlib.contextmanager
def exclusive(path: Path, holder: str, wait_s: float = 0.0) -> Iterator[None]:
    """Hold ``path``'s lock for the block, with ``holder`` as the line a refused taker reads; raise
    Held when another open file has it (at once, or after trying for ``wait_s`` seconds; see the note)."""
    fd = open_lock(path)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise Held(path, _holder(fd)) from None
                time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode("utf-8", "replace"), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # no holder named once we are done
    finally:
        os.close(fd)  # closing releases the flock


def is_free(path: Path) -> bool:
    """Whether the lock could be taken now (False also where the file cannot be made or opened)."""
    try:
        fd = open_lock(path)
    except (NotALockFile, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
