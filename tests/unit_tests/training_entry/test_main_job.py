"""The main job: graphed when the model can be captured, eager (saying why) when not (CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from hfsdp import main_job as M


def _line(step: int, ms: float) -> str:
    return (f" iteration {step:8d}/      30 | elapsed time per iteration (ms): {ms:.1f} | "
            f"lm loss: 1.000000E+01 |\n")


@pytest.fixture
def fake_train(monkeypatch):
    runs = []

    def train(flags, nproc, steps, log_path):
        graphed = "--cuda-graph-impl" in flags
        runs.append({"graphed": graphed, "steps": steps, "nproc": nproc, "flags": list(flags)})
        with open(log_path, "w") as f:
            f.writelines(_line(s, 70.0 if graphed else 280.0) for s in range(1, steps + 1))
        return 0

    monkeypatch.setattr(M, "train", train)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key in ("NPROC", "TRAIN_ITERS", "EAGER_ITERS"):
        monkeypatch.delenv(key, raising=False)
    return runs


def test_default_model_trains_graphed_then_eager(fake_train, capsys):
    assert M.main([]) == 0
    graphed, eager = fake_train
    assert graphed["graphed"] and graphed["steps"] == 30
    assert M.MAXPOOL_FLAG in graphed["flags"] and M.MAXPOOL_FLAG in eager["flags"]
    assert not eager["graphed"] and eager["steps"] == 10
    out = capsys.readouterr().out
    assert "max-pool + full-iteration CUDA graph: median step 70.0 ms" in out
    assert "the graph runs 4.00x faster" in out


def test_uncapturable_model_trains_eagerly_and_says_why(fake_train, capsys):
    assert M.main(["--moe-token-dispatcher-type", "allgather"]) == 0
    assert [r["graphed"] for r in fake_train] == [False]
    out = capsys.readouterr().out
    assert "cannot run under a full-iteration CUDA graph" in out and "allgather" in out
    assert "max-pool, eager: median step 280.0 ms (steps 3-30" in out
    assert "faster" not in out  # no comparison of eager with itself


def test_no_gpu_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("NPROC", raising=False)
    assert M.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_failed_training_returns_its_exit_code(monkeypatch, fake_train):
    monkeypatch.setattr(M, "train", lambda *a: 7)
    assert M.main([]) == 7


def test_train_tees_output_and_returns_the_exit_code(monkeypatch, tmp_path, capsys):
    """train() runs the command as a process group, copying every line to the log and the terminal."""
    import sys

    script = "import sys; print('iteration 1'); print('iteration 2'); sys.exit(3)"
    monkeypatch.setattr(M.pretrain_launch, "command", lambda flags, nproc, steps: [sys.executable, "-c", script])
    log = tmp_path / "main.log"
    assert M.train([], 1, 2, str(log)) == 3
    assert log.read_text() == "iteration 1\niteration 2\n"
    assert "iteration 2" in capsys.readouterr().out


def test_runs_share_triton_autotuning_unless_the_caller_chose(monkeypatch, tmp_path):
    """The eager comparison reuses the graphed run's Triton choices (TRITON_CACHE_AUTOTUNING=1)
    and the runs get expandable allocator segments; a caller's own values, and every other
    variable, reach the run unchanged."""
    import json
    import sys

    names = ("TRITON_CACHE_AUTOTUNING", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_NVLS_ENABLE")
    script = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"
    monkeypatch.setattr(M.pretrain_launch, "command", lambda flags, nproc, steps: [sys.executable, "-c", script])
    log = tmp_path / "main.log"
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert M.train([], 1, 2, str(log)) == 0
    assert json.loads(log.read_text()) == {"TRITON_CACHE_AUTOTUNING": "1", "NCCL_NVLS_ENABLE": "1",
                                           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert M.train([], 1, 2, str(log)) == 0
    assert json.loads(log.read_text()) == {"TRITON_CACHE_AUTOTUNING": "0", "NCCL_NVLS_ENABLE": "1",
                                           "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}


def test_expandable_segments_only_where_measured():
    """One GPU without NCCL user buffers gets the allocator default; several ranks (NCCL in the
    graph) or --use-nccl-ub keep the caller's allocator settings exactly."""
    assert M.run_env({}, 1)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in M.run_env({}, 2)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in M.run_env({}, 1, ["--use-nccl-ub"])
    assert M.run_env({"PYTORCH_CUDA_ALLOC_CONF": "x"}, 1)["PYTORCH_CUDA_ALLOC_CONF"] == "x"
    assert M.run_env({"PYTORCH_ALLOC_CONF": "x"}, 1) == {"PYTORCH_ALLOC_CONF": "x",
                                                        "TRITON_CACHE_AUTOTUNING": "1"}


def test_capture_check_sees_the_runs_allocator(monkeypatch):
    """A caller's expandable segments on several GPUs, without NCCL_GRAPH_REGISTER=0, is a
    capture problem (the job then trains eagerly and says why); on one GPU it is not."""
    monkeypatch.setenv("WORLD_SIZE", "1")  # the caller's values win over capture_problems' own
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    flags = [*M.DEFAULT_MODEL_FLAGS, *M.MAXPOOL_FLAGS]
    (problem,) = M.capture_problems(flags, 2)
    assert "NCCL_GRAPH_REGISTER=0" in problem
    assert M.capture_problems(flags, 1) == []
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    assert M.capture_problems(flags, 2) == []


def test_capture_check_leaves_the_environment_as_it_found_it(monkeypatch):
    """The parse gets WORLD_SIZE and RANK for itself; the job's environment does not keep them."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    before = dict(os.environ)
    M.capture_problems([*M.DEFAULT_MODEL_FLAGS, *M.MAXPOOL_FLAGS], 2)
    assert dict(os.environ) == before
