"""Orchestration of scripts/benchmark_double_buffer.py with the GPU runs faked out."""

from __future__ import annotations

import json

import pytest

from hfsdp.bench import results as R
from hfsdp.bench import run as B


@pytest.fixture
def fake_launch(monkeypatch):
    calls = []

    def launch(config, repeat, flags, opts, workdir, timeout_s=None):
        calls.append((config.name, repeat, timeout_s))
        base = {"no_db": 0.100, "maxpool": 0.095}[config.name]
        return R.RunResult(config=config.name, repeat=repeat,
                           step_times_s=(base, base + 0.001, base - 0.001),
                           tokens_per_step=4096, peak_allocated_bytes=2**30,
                           peak_reserved_bytes=2**31), "log"

    monkeypatch.setattr(B, "launch", launch)
    for key in B.NVLS_GUARDS:
        monkeypatch.delenv(key, raising=False)
    return calls


def test_prime_run_is_discarded_and_timed_runs_interleave(fake_launch, tmp_path):
    out = tmp_path / "r.json"
    rc = B.main(["--configs", "no_db,maxpool", "--repeats", "3", "--no-plan", "--no-chart",
                 "--run-timeout", "100", "--out-json", str(out)])
    assert rc == 0
    # One priming run (repeat -1, longer timeout) before the 3 x 2 interleaved timed runs.
    assert fake_launch[0] == ("no_db", -1, 300)
    timed = fake_launch[1:]
    assert sorted(timed) == sorted((c, r, None) for r in range(3) for c in ("no_db", "maxpool"))
    doc = json.loads(out.read_text())
    assert doc["meta"]["primed"]["config"] == "no_db" and doc["meta"]["primed"]["ok"]
    assert {r["repeat"] for r in doc["runs"]} == {0, 1, 2}  # the priming run is not a result
    maxpool = next(s for s in doc["summary"] if s["config"] == "maxpool")
    assert maxpool["runs"] == 3 and maxpool["step_time_ratio"] == pytest.approx(0.95)


def test_no_prime(fake_launch, tmp_path):
    B.main(["--configs", "no_db", "--repeats", "1", "--no-plan", "--no-chart", "--no-prime",
            "--out-json", str(tmp_path / "r.json")])
    assert [c[1] for c in fake_launch] == [0]


@pytest.mark.parametrize(("own", "expected"), [
    (["--profile-dir", "/p", "--profile-stack"], ["--profile-dir", "/p", "--profile-stack"]),
    (["--profile-dir", "/p"], ["--profile-dir", "/p"]),
    (["--pyprofile-dir", "/p", "--profile-stack"], ["--pyprofile-dir", "/p"]),  # no trace, no stacks
])
def test_worker_gets_profile_stack_only_with_a_profile_dir(monkeypatch, tmp_path, own, expected):
    seen = []

    def fake_run(cmd, log, timeout_s, env=None):
        seen.append(cmd)
        return 1

    monkeypatch.setattr(B, "run_in_group", fake_run)
    opts, _ = B.parse(own)
    B.launch(B.cfgs.CONFIGS["maxpool"], 0, ["--x"], opts, str(tmp_path))
    cmd = seen[0]
    worker_own = cmd[cmd.index("--timed-steps") + 2: cmd.index("--")]
    assert worker_own == expected


def test_timeout_ends_the_whole_process_group(tmp_path):
    """A timed-out run must not leave torchrun's workers behind (they did in session 6)."""
    import sys
    import time

    pidfile = tmp_path / "child.pid"
    # The leader starts a child that ignores nothing and would outlive a leader-only kill.
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    with open(tmp_path / "log", "w") as log:
        t0 = time.monotonic()
        rc = B.run_in_group([sys.executable, "-c", script], log, timeout_s=2, grace_s=2)
    assert rc == "timeout" and time.monotonic() - t0 < 30
    child = int(pidfile.read_text())
    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
        except FileNotFoundError:
            return False

    for _ in range(50):
        if not alive(child):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"child {child} of the timed-out run is still alive")


def test_run_in_group_returns_the_exit_code(tmp_path):
    import sys

    with open(tmp_path / "log", "w") as log:
        assert B.run_in_group([sys.executable, "-c", "raise SystemExit(3)"], log, timeout_s=30) == 3
