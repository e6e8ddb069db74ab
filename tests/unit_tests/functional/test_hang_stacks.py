"""A timed-out functional run leaves every rank's Python stacks in its log (hfsdp.diagnostics)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

from hfsdp import diagnostics
from hfsdp.functional import run_case

REPO_ROOT = Path(__file__).resolve().parents[3]

# Stands in for torchrun: a parent that starts one "rank", which hangs in a named function.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys
    rank = '''
    import sys, time
    sys.path.insert(0, %r)
    from hfsdp.diagnostics import install_stack_dump_signal
    install_stack_dump_signal({})  # SIGUSR1 only: the watchdog path has its own test
    def waiting_in_a_collective_nobody_else_joined():
        print("rank ready", flush=True)
        time.sleep(600)
    waiting_in_a_collective_nobody_else_joined()
    '''
    subprocess.run([sys.executable, "-c", rank])
""")


def test_timeout_dumps_each_rank_stack_before_killing(tmp_path, monkeypatch):
    monkeypatch.setattr(run_case, "STACK_DUMP_GRACE_S", 1.0)
    log = tmp_path / "run1.log"
    rec = run_case.run_logged([sys.executable, "-c", LAUNCHER % str(REPO_ROOT)],
                              dict(os.environ), log, timeout_s=5.0)
    text = log.read_text()
    assert rec.timed_out and rec.returncode != 0
    assert "rank ready" in text
    assert "waiting_in_a_collective_nobody_else_joined" in text, text[-2000:]


def test_child_pids_finds_direct_children_only():
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in diagnostics.child_pids(os.getpid())
        assert child.pid not in diagnostics.child_pids(child.pid)
    finally:
        child.kill()
        child.wait()


def test_stack_dump_after_env_dumps_without_any_signal():
    import subprocess

    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from hfsdp.diagnostics import install_stack_dump_signal
        install_stack_dump_signal()
        def still_saving_the_checkpoint():
            time.sleep(3)
        still_saving_the_checkpoint()
    """)
    env = dict(os.environ, **{diagnostics.AFTER_ENV: "1"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0  # the dump does not end the process
    assert "still_saving_the_checkpoint" in out.stderr


def test_descendants_include_grandchildren():
    import subprocess

    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                               "'import time; time.sleep(30)'])"])
    try:
        import time

        for _ in range(50):
            below = diagnostics.descendant_pids(os.getpid())
            if len(below) >= 2:
                break
            time.sleep(0.1)
        assert parent.pid in below and len(below) >= 2
    finally:
        for pid in diagnostics.descendant_pids(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


def test_handles_signal_reads_the_caught_mask():
    import signal
    import subprocess

    code = (f"import sys, time; sys.path.insert(0, {str(REPO_ROOT)!r}); from hfsdp.diagnostics import "
            "install_stack_dump_signal; install_stack_dump_signal({}); print('ok', flush=True); "
            "time.sleep(30)")
    catcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert catcher.stdout.readline().strip() == "ok"
        assert diagnostics.handles_signal(catcher.pid, signal.SIGUSR1)
        assert not diagnostics.handles_signal(plain.pid, signal.SIGUSR1)
    finally:
        for p in (catcher, plain):
            p.kill()
            p.wait()


def test_a_run_the_timer_fired_on_fails_even_with_exit_code_0():
    from hfsdp.functional.run_case import RunRecord, run_problem

    assert run_problem(RunRecord("l", 0, False), 1) is None
    assert run_problem(RunRecord("l", 1, False), 2) == "run 2 exited with 1"
    assert run_problem(RunRecord("l", -15, True), 1) == "run 1 exited with -15 (timeout)"
    assert "exceeded its timeout" in run_problem(RunRecord("l", 0, True), 1)
