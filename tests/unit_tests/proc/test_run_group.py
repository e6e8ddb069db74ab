"""hfsdp.proc.run_group: exit codes, stacks before SIGTERM, and no process of a run survives it."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from hfsdp import proc
from hfsdp.diagnostics import AFTER_ENV

REPO_ROOT = Path(__file__).resolve().parents[3]
FAST = {"stack_grace_s": 0.5, "term_grace_s": 1.0}


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"  # a zombie is dead
    except FileNotFoundError:
        return False


def wait_for(path: Path, seconds: float = 20.0) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_exit_codes_pass_through():
    ok = proc.run_group(py("pass"), timeout_s=30)
    assert (ok.returncode, ok.timed_out, ok.signals, ok.stragglers) == (0, False, [], [])
    three = proc.run_group(py("raise SystemExit(3)"), timeout_s=30)
    assert (three.returncode, three.timed_out) == (3, False)
    killed = proc.run_group(py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    assert killed.returncode == -9 and not killed.timed_out


def test_output_goes_to_on_line_or_to_a_file(tmp_path):
    lines: list[str] = []
    proc.run_group(py("import sys; print('out'); print('err', file=sys.stderr)"), on_line=lines.append)
    assert sorted(lines) == ["err\n", "out\n"]
    with open(tmp_path / "log", "w") as log:
        proc.run_group(py("print('to the file')"), stdout=log)
    assert (tmp_path / "log").read_text() == "to the file\n"


@pytest.mark.parametrize("how", ["same-group", "ignores-term", "own-session"])
def test_no_grandchild_survives_a_timeout(tmp_path, how):
    """torchrun's workers are grandchildren of the launcher; none may outlive a timed-out run."""
    pidfile = tmp_path / "grandchild.pid"
    grandchild = {
        "same-group": "import time; time.sleep(120)",
        "ignores-term": "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)",
        "own-session": "import os, time; os.setsid(); time.sleep(120)",
    }[how]
    leader = f"""
        import subprocess, sys, time
        c = subprocess.Popen([sys.executable, "-c", {grandchild!r}])
        open({str(pidfile)!r}, "w").write(str(c.pid))
        time.sleep(120)
    """
    t0 = time.monotonic()
    res = proc.run_group(py(leader), timeout_s=2.0, **FAST)
    assert res.timed_out and res.returncode < 0 and time.monotonic() - t0 < 30
    child = int(wait_for(pidfile))
    assert not alive(child), f"{how}: grandchild {child} survived; signals sent {res.signals}"
    assert res.signals[-1] == ("KILL" if how == "ignores-term" else "TERM"), res.signals


def test_stack_signal_comes_before_term_and_dumps_the_stacks(tmp_path):
    events = tmp_path / "events"
    rank = f"""
        import faulthandler, signal, sys, time
        def note(what):
            with open({str(events)!r}, "a") as f:
                f.write(what + "\\n")
        def usr1(*_):  # what hfsdp.diagnostics does, plus a note of the order
            note("USR1")
            faulthandler.dump_traceback(all_threads=True)
        signal.signal(signal.SIGUSR1, usr1)
        signal.signal(signal.SIGTERM, lambda *_: (note("TERM"), sys.exit(143)))
        def hanging_in_a_collective():
            print("ready", flush=True)
            time.sleep(120)
        hanging_in_a_collective()
    """
    lines: list[str] = []
    res = proc.run_group(py(rank), timeout_s=2.0, on_line=lines.append, **FAST)
    assert res.timed_out and res.signals == ["USR1", "TERM"], res.signals
    assert events.read_text().split() == ["USR1", "TERM"]
    assert res.returncode == 143
    text = "".join(lines)
    assert "ready" in text and "hanging_in_a_collective" in text, text


def test_processes_that_do_not_catch_the_stack_signal_are_not_sent_it(tmp_path):
    # SIGUSR1's default action is to terminate: sent to a plain process it would kill it
    # before SIGTERM (and before its clean-up handler) could run.
    events = tmp_path / "events"
    code = f"""
        import signal, sys, time
        def term(*_):
            open({str(events)!r}, "w").write("TERM")
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        time.sleep(120)
    """
    res = proc.run_group(py(code), timeout_s=1.0, **FAST)
    assert res.signals == ["TERM"] and events.read_text() == "TERM"
    assert res.timed_out and res.returncode == 0  # timed_out says what happened, not the code


def test_processes_left_behind_by_a_finished_leader_are_ended(tmp_path):
    pidfile = tmp_path / "orphan.pid"
    leader = f"""
        import subprocess, sys
        c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pidfile)!r}, "w").write(str(c.pid))
    """
    lines: list[str] = []
    res = proc.run_group(py(leader), timeout_s=60, on_line=lines.append, **FAST)
    orphan = int(pidfile.read_text())
    assert res.returncode == 0 and not res.timed_out
    assert res.stragglers == [orphan] and res.signals == ["TERM"]
    assert not alive(orphan)


def test_environment_passes_through_and_only_the_watchdog_is_added(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv(AFTER_ENV, raising=False)
    lines: list[str] = []
    code = f"import os; print(os.environ['NCCL_NVLS_ENABLE'], os.environ.get({AFTER_ENV!r}))"
    proc.run_group(py(code), on_line=lines.append)
    assert lines == ["1 None\n"]
    lines.clear()
    proc.run_group(py(code), timeout_s=60, on_line=lines.append, stack_grace_s=5.0)
    assert lines == ["1 50\n"]  # ranks dump stacks on their own a little before the deadline
    assert proc.child_env({"X": "y", AFTER_ENV: "7"}, 60, 5.0) == {"X": "y", AFTER_ENV: "7"}


def test_an_interrupt_of_the_caller_ends_the_group(tmp_path, monkeypatch):
    """Ctrl-C reaches only the caller (the run has its own session): the run must not outlive it."""
    import subprocess

    pidfile = tmp_path / "child.pid"
    child = f"""
        import os, time
        open({str(pidfile)!r}, "w").write(str(os.getpid()))
        time.sleep(120)
    """
    real_wait = subprocess.Popen.wait
    interrupted: list[bool] = []

    def wait(self, timeout=None):
        if not interrupted:  # the caller's first wait is where its Ctrl-C lands
            interrupted.append(True)
            wait_for(pidfile)
            raise KeyboardInterrupt
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", wait)
    with pytest.raises(KeyboardInterrupt):
        proc.run_group(py(child), timeout_s=60, **FAST)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), f"child {pid} outlived the interrupted caller"
