"""Run a command as its own process group, with a timeout that leaves evidence and no survivors.

[Note: ending a process group] Every launcher of this project (functional driver, benchmark
runner, GPU test scripts) starts ``torchrun`` through :func:`run_group`. On timeout it:

1. sends ``SIGUSR1`` to every process of the run that catches it: our ranks print their Python
   stacks (:mod:`hfsdp.diagnostics`), the evidence of a hang. Processes that do not catch it
   are skipped, because SIGUSR1's default action would kill them before they could print;
2. waits ``stack_grace_s`` for the stacks to be written;
3. sends ``SIGTERM`` to the whole group (and to descendants that left it with ``setsid``);
4. waits ``term_grace_s`` for the group to end;
5. sends ``SIGKILL`` to whatever is left.

Killing only the direct child is not enough: torchrun's workers then keep running, holding
GPUs and the output pipe (``subprocess.run(timeout=...)`` does exactly that). The same end
(steps 3-5) is applied when the leader exits on its own but left processes behind.

A SIGTERM to the launcher itself (a job's time limit, ``scancel``, ``srun`` ending a step after
another node failed) would kill it and leave the run's own session behind, and a Ctrl-C reaches
the launcher only. Under ``run_cli`` both raise :class:`hfsdp.usererror.Interrupted` instead
([Note: interrupts] in usererror.py), and :func:`run_group` ends its run before passing it on
(after SIGTERM with steps 1-5, the stacks showing where the run was; after Ctrl-C with 3-5).

With a timeout, the child also gets ``HFSDP_STACK_DUMP_AFTER_S`` (unless the caller set it):
ranks dump their stacks on their own a little before the deadline, even where no signal
reaches them. Nothing else in the caller's environment is changed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from hfsdp.diagnostics import AFTER_ENV, STACK_DUMP_SIGNAL, descendant_pids, handles_signal, stack_dump_after_s
from hfsdp.usererror import Interrupted

STACK_GRACE_S = 5.0  # time the ranks get to write their stacks before SIGTERM
TERM_GRACE_S = 10.0  # time the group gets to exit on SIGTERM before SIGKILL
DRAIN_S = 2.0  # after the leader exits, time its workers get to finish exiting on their own
SCAN_S = 1.0  # how often the descendants of a running command are noted
_POLL_S = 0.05


@dataclass
class GroupResult:
    """How a run ended. ``returncode`` is the leader's (negative: killed by that signal)."""

    returncode: int
    timed_out: bool
    seconds: float
    signals: list[str] = field(default_factory=list)  # what was sent, in order, e.g. USR1, TERM
    stragglers: list[int] = field(default_factory=list)  # pids still alive after the leader ended


def _state(pid: int) -> tuple[str, int, int] | None:
    """(state letter, process group, start time) from /proc, or None if the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2]), int(fields[19])


def _alive(pid: int, started: int | None = None) -> bool:
    """A live, non-zombie process (the same one when ``started`` is given: no pid reuse)."""
    st = _state(pid)
    return st is not None and st[0] not in "ZX" and (started is None or st[2] == started)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return members
    for entry in entries:
        if entry.isdigit():
            st = _state(int(entry))
            if st is not None and st[1] == pgid and st[0] not in "ZX":
                members.append(int(entry))
    return members


class _Group:
    """The processes of one run: the session's group plus every descendant seen so far."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.pgid = proc.pid  # start_new_session: the leader's pid is the group id
        self.known: dict[int, int] = {}  # pid -> start time, so a reused pid is never signalled

    def remember_descendants(self) -> None:
        for pid in descendant_pids(self.proc.pid):
            st = _state(pid)
            if st is not None:
                self.known.setdefault(pid, st[2])

    def alive(self) -> list[int]:
        self.proc.poll()  # reap the leader: a zombie leader keeps the group "alive"
        pids = set(group_members(self.pgid))
        pids |= {pid for pid, started in self.known.items() if _alive(pid, started)}
        if self.proc.returncode is None:
            pids.add(self.proc.pid)
        return sorted(pids)

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group ended meanwhile
        for pid, started in self.known.items():
            if _alive(pid, started):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    def wait_gone(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def end(self, signals: list[str], term_grace_s: float) -> None:
        """SIGTERM the group, wait, SIGKILL what is left."""
        self.remember_descendants()
        signals.append("TERM")
        self.signal(signal.SIGTERM)
        if not self.wait_gone(term_grace_s):
            signals.append("KILL")
            self.signal(signal.SIGKILL)
            self.wait_gone(5.0)

    def ask_for_stacks(self, signals: list[str], stack_grace_s: float) -> None:
        self.remember_descendants()
        targets = [p for p in [self.proc.pid, *self.known] if _alive(p) and handles_signal(p, STACK_DUMP_SIGNAL)]
        if targets:
            signals.append(signal.Signals(STACK_DUMP_SIGNAL).name.removeprefix("SIG"))
        for pid in targets:
            try:
                os.kill(pid, STACK_DUMP_SIGNAL)
            except ProcessLookupError:
                pass
        if targets:
            self.wait_gone(stack_grace_s)


def child_env(env: Mapping[str, str] | None, timeout_s: float | None, stack_grace_s: float) -> dict[str, str]:
    """The caller's environment (``env`` or ours), plus the stack-dump watchdog under a timeout."""
    out = dict(os.environ if env is None else env)
    stack_dump_after_s(out)  # the caller's value is checked here, before any rank reads it
    if timeout_s and AFTER_ENV not in out:
        out[AFTER_ENV] = f"{max(timeout_s - 2 * stack_grace_s, 1.0):g}"
    return out


def run_group(
    cmd: Sequence[str],
    *,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    stdout: IO | None = None,
    on_line: Callable[[str], None] | None = None,
    stack_grace_s: float = STACK_GRACE_S,
    term_grace_s: float = TERM_GRACE_S,
) -> GroupResult:
    """Run ``cmd`` in a new session; end the whole group on timeout (see the module note).

    Output: with ``on_line`` every line of stdout+stderr is passed to it (text); else with
    ``stdout`` (an open file) both streams go there; else they are inherited.
    """
    assert not (stdout is not None and on_line is not None), "pass stdout or on_line, not both"
    assert timeout_s is None or timeout_s > 0, f"timeout_s must be positive, got {timeout_s}"
    started = time.monotonic()
    piped = on_line is not None
    proc = subprocess.Popen(
        list(cmd), env=child_env(env, timeout_s, stack_grace_s), cwd=cwd,
        stdout=subprocess.PIPE if piped else stdout, stderr=subprocess.STDOUT if (piped or stdout) else None,
        text=piped, errors="replace" if piped else None, start_new_session=True,
    )
    group = _Group(proc)
    signals: list[str] = []
    timed_out = threading.Event()
    finished = threading.Event()

    def watchdog() -> None:
        deadline = None if timeout_s is None else started + timeout_s
        while True:
            # Descendants are noted as they appear: one that leaves the group (setsid) and is
            # orphaned by its parent can no longer be found from the leader afterwards.
            group.remember_descendants()
            left = SCAN_S if deadline is None else min(SCAN_S, deadline - time.monotonic())
            if finished.wait(max(left, 0.0)):
                return
            if deadline is not None and time.monotonic() >= deadline:
                break
        timed_out.set()
        group.ask_for_stacks(signals, stack_grace_s)
        group.end(signals, term_grace_s)

    watcher = threading.Thread(target=watchdog, name="run_group-timeout", daemon=True)
    watcher.start()
    reader = None
    if on_line is not None:  # the same test as ``piped``, spelled so the type narrows
        assert proc.stdout is not None, f"stdout of {cmd!r} was not piped (piped={piped})"
        pipe = proc.stdout

        def pump() -> None:
            for line in pipe:  # ends when every holder of the pipe has exited
                on_line(line)

        reader = threading.Thread(target=pump, name="run_group-output", daemon=True)
        reader.start()
    try:
        proc.wait()
    except BaseException as exc:  # Ctrl-C or SIGTERM reaches only us (the group has its own session)
        finished.set()
        watcher.join()
        if isinstance(exc, Interrupted) and exc.signum == signal.SIGTERM:  # a time limit: where was the run?
            group.ask_for_stacks(signals, stack_grace_s)
        group.end(signals, term_grace_s)
        if reader is not None:
            reader.join(timeout=DRAIN_S)  # the last lines (the stacks) reach on_line
        raise
    finished.set()
    watcher.join()
    stragglers: list[int] = []
    if not timed_out.is_set() and not group.wait_gone(DRAIN_S):
        stragglers = group.alive()  # the leader ended on its own but left processes behind
        group.end(signals, term_grace_s)
    if reader is not None:
        reader.join()
        pipe.close()
    return GroupResult(proc.returncode, timed_out.is_set(), time.monotonic() - started, signals, stragglers)
