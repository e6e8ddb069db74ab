"""Orchestration of scripts/benchmark_double_buffer.py with the GPU runs faked out."""

from __future__ import annotations

import json
import os
import sys

import pytest

from hfsdp.bench import results as R
from hfsdp.bench import run as B
from hfsdp.proc import run_group


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

    def fake_run(cmd, *, timeout_s, env, stdout):
        seen.append(cmd)
        return run_group([sys.executable, "-c", "raise SystemExit(1)"])

    monkeypatch.setattr(B, "run_group", fake_run)
    opts, _ = B.parse(own)
    B.launch(B.cfgs.CONFIGS["maxpool"], 0, ["--x"], opts, str(tmp_path))
    cmd = seen[0]
    worker_own = cmd[cmd.index("--timed-steps") + 2: cmd.index("--")]
    assert worker_own == expected


def test_runs_get_the_callers_environment_plus_env(monkeypatch, tmp_path):
    """No NVLS pinning by the product: NCCL_NVLS_ENABLE=1 reaches the worker, --env overrides it."""
    seen = []

    def fake_run(cmd, *, timeout_s, env, stdout):
        seen.append(env)
        return run_group([sys.executable, "-c", "import os; print(os.environ['NCCL_NVLS_ENABLE'])"],
                           env=env, stdout=stdout)

    monkeypatch.setattr(B, "run_group", fake_run)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    for own, expected in (([], "1"), (["--env", "NCCL_NVLS_ENABLE=0", "--env", "X=a=b"], "0")):
        opts, _ = B.parse(own)
        B.launch(B.cfgs.CONFIGS["no_db"], 0, [], opts, str(tmp_path))
        assert seen[-1]["NCCL_NVLS_ENABLE"] == expected
        assert (tmp_path / "no_db-0.log").read_text() == expected + "\n"
    assert seen[-1]["X"] == "a=b"
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"  # the runner's own environment is untouched


def test_main_leaves_the_environment_alone(fake_launch, monkeypatch, tmp_path):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    B.main(["--configs", "no_db", "--repeats", "1", "--no-plan", "--no-chart", "--no-prime",
            "--out-json", str(tmp_path / "r.json")])
    assert os.environ["NCCL_NVLS_ENABLE"] == "1" and "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in os.environ


def test_bad_env_option_is_a_sentence(capsys):
    assert B.main(["--env", "NCCL_NVLS_ENABLE"]) == 2
    assert "is not KEY=VALUE" in capsys.readouterr().err
