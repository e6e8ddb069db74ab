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

    def train(flags, nproc, steps, log_path, ranks_per_gpu=1, extra_env=None):
        graphed = "--cuda-graph-impl" in flags
        runs.append({"graphed": graphed, "steps": steps, "nproc": nproc, "flags": list(flags)})
        with open(log_path, "w") as f:
            f.writelines(_line(s, 70.0 if graphed else 280.0) for s in range(1, steps + 1))
        return 0

    monkeypatch.setattr(M, "train", train)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key in ("NPROC", "TRAIN_ITERS", "EAGER_ITERS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("REHEARSAL_ITERS", "0")  # its own tests below
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
    monkeypatch.setattr(M.pretrain_launch, "command", lambda flags, nproc, steps, rpg=1: [sys.executable, "-c", script])
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
    monkeypatch.setattr(M.pretrain_launch, "command", lambda flags, nproc, steps, rpg=1: [sys.executable, "-c", script])
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


def test_one_gpu_says_the_double_buffer_was_idle_and_rehearses_at_dp2(fake_train, monkeypatch, capsys):
    """DP=1 never gathers: the output says so; the rehearsal's verdict decides the exit status."""
    seen = []

    def rehearse(base, steps, graphed, workdir):
        seen.append((steps, graphed))
        return M.Rehearsal(steps=steps, identical_steps=steps, pool_bytes=384 * M.MIB,
                           planned_pool_bytes=384 * M.MIB, home_misses=0,
                           peak_allocated=(4323 * M.MIB, 4518 * M.MIB))

    monkeypatch.setattr(M, "rehearse", rehearse)
    monkeypatch.setenv("REHEARSAL_ITERS", "8")
    assert M.main([]) == 0
    out = capsys.readouterr().out
    assert seen == [(8, True)]
    assert "nothing passed through the double buffer in the runs above; the DP=2 rehearsal exercised it" in out
    assert ("DP=2 rehearsal (2 ranks on one GPU, 8 steps): max-pool vs no double buffer: lm loss bit-identical "
            "at every step; pool 384.00 MiB = plan; home misses 0") in out
    assert "4,518 MiB with max-pool, 4,323 MiB without (1.045x)" in out
    monkeypatch.setattr(M, "rehearse", lambda *a: M.Rehearsal(steps=8, identical_steps=5, home_misses=0))
    assert M.main([]) == 1
    assert "DIFFERS: identical at 5 of 8 steps" in capsys.readouterr().out


def test_several_gpus_need_no_rehearsal(fake_train, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(M, "rehearse", lambda *a: pytest.fail("DP=2 already gathers"))
    monkeypatch.setenv("REHEARSAL_ITERS", "8")
    assert M.main([]) == 0
    assert "never all-gathers" not in capsys.readouterr().out


def test_rehearse_compares_twin_and_maxpool(monkeypatch, tmp_path):
    """Two runs of 2 ranks on one GPU, deterministic, each with a run report; pool vs plan."""
    import json

    from hfsdp.training import run_report

    calls = []

    def train(flags, nproc, steps, log_path, ranks_per_gpu=1, extra_env=None):
        calls.append((list(flags), nproc, ranks_per_gpu, dict(extra_env or {})))
        maxpool = M.MAXPOOL_FLAG in flags
        with open(log_path, "w") as f:
            f.writelines(_line(s, 80.0) for s in range(1, steps + 1))
        for rank in range(nproc):
            with open(run_report.rank_path(extra_env[run_report.ENV], rank), "w") as f:
                json.dump({"peak_allocated_bytes": (110 if maxpool else 100) + rank, "peak_reserved_bytes": 1,
                           "pool_bytes_measured": 64 if maxpool else 0,
                           "maxpool_stats": {"home_misses": 0} if maxpool else None}, f)
        return 0

    monkeypatch.setattr(M, "train", train)
    monkeypatch.setattr(M.fit, "preflight", lambda placement, flags, environ=None: "fits")
    import hfsdp.bench.run as bench_run

    monkeypatch.setattr(bench_run, "planned_pools", lambda flags, nproc, names=None: {"maxpool": {"pool_bytes": 64}})
    base = [*M.DEFAULT_MODEL_FLAGS, *M.MAXPOOL_FLAGS]
    result = M.rehearse(base, 8, True, str(tmp_path))
    (twin, _, twin_rpg, twin_env), (pooled, _, rpg, env) = calls
    assert M.MAXPOOL_FLAG not in twin and "--fsdp-double-buffer" not in twin and "--cuda-graph-impl" not in twin
    assert M.MAXPOOL_FLAG in pooled and "--cuda-graph-impl" in pooled
    assert "--deterministic-mode" in twin and "--deterministic-mode" in pooled and twin_rpg == rpg == 2
    assert env["NCCL_ALGO"] == "Ring" and env["HFSDP_TRITON_PIN_AUTOTUNE"] == "1"
    assert (result.identical_steps, result.pool_bytes, result.planned_pool_bytes, result.home_misses) == (8, 64, 64, 0)
    assert result.peak_allocated == (101, 111)


def test_runs_turn_one_logger_off_unless_it_is_installed(monkeypatch, fake_train):
    """Without one_logger Megatron warns with a link outside users cannot open: the runs pass
    --no-one-logger; with the package installed, or the flag given, nothing is added."""
    import importlib.util

    real = importlib.util.find_spec

    def installed(present):
        def find_spec(name, *a):
            return (object() if present else None) if name == "one_logger" else real(name, *a)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    installed(False)
    assert M.one_logger_flags([]) == [M.NO_ONE_LOGGER]
    assert M.one_logger_flags([M.NO_ONE_LOGGER]) == []
    assert M.main([]) == 0
    assert all(r["flags"].count(M.NO_ONE_LOGGER) == 1 for r in fake_train)
    installed(True)
    assert M.one_logger_flags([]) == []
