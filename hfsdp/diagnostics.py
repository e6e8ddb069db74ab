"""Python stack dumps of a hung rank, on demand: ``kill -USR1 <pid>`` (like py-spy, no install).

Entry points call :func:`install_stack_dump_signal` first thing; the functional driver sends
SIGUSR1 to every rank before it kills a timed-out run, so a hang (a collective that one rank never
joins, say) leaves each rank's stacks in the log. Standard library only.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Mapping

from hfsdp.usererror import env_number

STACK_DUMP_SIGNAL = signal.SIGUSR1


AFTER_ENV = "HFSDP_STACK_DUMP_AFTER_S"


def install_stack_dump_signal(environ: Mapping[str, str] | None = None) -> bool:
    """Dump all threads' Python stacks to stderr on SIGUSR1; the process keeps running.

    With ``HFSDP_STACK_DUMP_AFTER_S=T`` (the functional driver sets it a little under its
    timeout) the stacks are also dumped once after T seconds by faulthandler's own watchdog
    thread: evidence even where a signal cannot reach the rank.
    """
    if not hasattr(faulthandler, "register"):  # not on Windows
        return False
    seconds = stack_dump_after_s(environ)
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    if seconds:
        faulthandler.dump_traceback_later(seconds, repeat=False, file=sys.stderr, exit=False)
    return True


def stack_dump_after_s(environ: Mapping[str, str] | None = None) -> float | None:
    """``HFSDP_STACK_DUMP_AFTER_S`` in seconds (None when unset, 0: no timed dump); a value that is
    no number >= 0 is a :class:`~hfsdp.usererror.UserError` naming the variable. Our launchers ask
    this before they start anything (hfsdp/proc.py), so junk is one sentence, not a failure in
    every rank."""
    return env_number(AFTER_ENV, None, kind=float, zero=True, environ=environ,
                      unset_means="no timed stack dump (SIGUSR1 still dumps them)")


def handles_signal(pid: int, signum: int = STACK_DUMP_SIGNAL) -> bool:
    """Whether ``pid`` catches ``signum`` (/proc SigCgt), so sending it cannot kill the process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(signum) - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def descendant_pids(pid: int) -> list[int]:
    """Every process below ``pid`` (ranks may sit under a launcher layer), children first."""
    found, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in child_pids(p)]
        found += kids
        frontier = kids
    return found


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (torchrun's ranks), from /proc; empty where /proc is absent."""
    children: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # Field 4 is the parent pid; field 2 (the command name) may contain spaces and ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry))
    return children
