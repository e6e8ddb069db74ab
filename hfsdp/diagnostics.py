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

STACK_DUMP_SIGNAL = signal.SIGUSR1


def install_stack_dump_signal() -> bool:
    """Dump all threads' Python stacks to stderr on SIGUSR1; the process keeps running."""
    if not hasattr(faulthandler, "register"):  # not on Windows
        return False
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    return True


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (torchrun's ranks), from /proc; empty where /proc is absent."""
    children = []
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
