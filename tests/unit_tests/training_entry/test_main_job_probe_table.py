"""Probe table of the main job (``scripts/run_main.sh`` -> ``hfsdp.main_job``): each input a user
may give it (its environment knobs, its extra pretrain flags, its log folder), the exit status,
and the sentence. A GPU is faked (``torch.cuda.device_count``) and training is never started: every
row is refused before a run would begin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hfsdp import main_job as M
from hfsdp.main_job import gpu, logs

KNOBS = ("NPROC", "TRAIN_ITERS", "EAGER_ITERS", "REHEARSAL_ITERS")

ROWS = [
    # (environment, extra flags, exit status, what stderr says)
    ({"NPROC": "abc"}, [], 2, "NPROC='abc': 'abc' is not a whole number"),
    ({"NPROC": "0"}, [], 2, "NPROC='0': must be > 0, got 0"),
    ({"NPROC": "-2"}, [], 2, "NPROC='-2': must be > 0, got -2"),
    ({"NPROC": "1.5"}, [], 2, "NPROC='1.5': '1.5' is not a whole number"),
    ({"TRAIN_ITERS": "x"}, [], 2, "TRAIN_ITERS='x': 'x' is not a whole number"),
    ({"TRAIN_ITERS": "0"}, [], 2, "TRAIN_ITERS='0': must be > 0, got 0"),
    ({"EAGER_ITERS": "-1"}, [], 2, "EAGER_ITERS='-1': must be >= 0, got -1"),
    ({"REHEARSAL_ITERS": "nan"}, [], 2, "REHEARSAL_ITERS='nan': 'nan' is not a whole number"),
    ({}, ["--bogus"], 2, "Megatron's parser refuses the job's flags: unrecognized arguments: --bogus"),
    ({}, ["--megatron-fsdp-max-pool-lanes", "abc"], 2, "Megatron's parser refuses the job's flags"),
    ({logs.OUT_ENV: "{file}"}, [], 2, "cannot make the job's log folder"),
]


@pytest.fixture
def no_training(monkeypatch, tmp_path):
    """One fake GPU, the user's knobs cleared, and a train() that records instead of launching."""
    started: list[list[str]] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def train(flags, nproc, steps, log_path, *args, **kwargs):
        started.append(list(flags))
        Path(log_path).write_text("".join(
            f" iteration {s:8d}/{steps:8d} | elapsed time per iteration (ms): 80.0 | lm loss: 1.0E+01 |\n"
            for s in range(1, steps + 1)))
        return 0

    monkeypatch.setattr(gpu, "train", train)
    for key in KNOBS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(logs.OUT_ENV, str(tmp_path / "jobs"))
    return started


@pytest.mark.parametrize(("env", "extra", "rc", "says"), ROWS,
                         ids=[" ".join([*(f"{k}={v}" for k, v in e.items()), *x]) for e, x, _, _ in ROWS])
def test_probe(no_training, monkeypatch, tmp_path: Path, capsys, env, extra, rc, says):
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(file=a_file))
    assert M.main(extra) == rc
    err = capsys.readouterr().err
    assert f"main_job: error: {says}" in err, err
    assert "Traceback" not in err and not no_training  # refused before any training started
    assert a_file.read_text() == "mine"


def test_a_bad_log_folder_on_a_cpu_machine_is_one_sentence(monkeypatch, tmp_path: Path, capsys):
    """The CPU path refuses the same folder before it plans, checks or smokes anything."""
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    monkeypatch.setenv(logs.OUT_ENV, str(a_file))
    assert M.cpu_main([]) == 2
    captured = capsys.readouterr()
    assert "main_job: error: cannot make the job's log folder" in captured.err and "Traceback" not in captured.err
    assert "memory planner" not in captured.out and a_file.read_text() == "mine"


def test_knobs_at_their_edges_are_taken(no_training, monkeypatch, capsys):
    """0 skips the eager comparison and the rehearsal (the documented values), and is no error."""
    monkeypatch.setenv("EAGER_ITERS", "0")
    monkeypatch.setenv("REHEARSAL_ITERS", "0")
    monkeypatch.setenv("TRAIN_ITERS", " 12 ")
    assert M.main([]) == 0 and len(no_training) == 1  # the main run only
    out = capsys.readouterr().out
    assert "median step 80.0 ms (steps " in out and "-12, 1 GPU(s))" in out, out


@pytest.mark.parametrize("python", ["/nonexistent/python", "README.md"])
def test_a_set_up_interpreter_that_is_none_is_one_sentence(python):
    """HFSDP_SETUP_DONE=1 trusts HFSDP_PY; one that is no Python >= 3.12 is said so, not bash's error."""
    import os
    import subprocess

    env = {**os.environ, "HFSDP_SETUP_DONE": "1", "HFSDP_PY": str(logs.REPO_ROOT / python)}  # absolute stays
    done = subprocess.run(["bash", str(logs.REPO_ROOT / "scripts" / "run_main.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "is not a Python >= 3.12 that runs here" in done.stderr, done.stderr
    assert "No such file or directory" not in done.stderr
