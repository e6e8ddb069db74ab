"""The main job: graphed when the model can be captured, eager (saying why) when not (CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from hfsdp import flagsets
from hfsdp import main_job as M
from hfsdp.main_job import cpu, gpu, logs, rehearsal, runs
from hfsdp.usererror import UserError

MIB = runs.MIB


def _line(step: int, ms: float) -> str:
    return (f" iteration {step:8d}/      30 | elapsed time per iteration (ms): {ms:.1f} | "
            f"lm loss: 1.000000E+01 |\n")


@pytest.fixture
def fake_train(monkeypatch, tmp_path):
    started = []
    monkeypatch.setenv(logs.OUT_ENV, str(tmp_path / "jobs"))

    def train(flags, nproc, steps, log_path, ranks_per_gpu=1, extra_env=None):
        graphed = "--cuda-graph-impl" in flags
        started.append({"graphed": graphed, "steps": steps, "nproc": nproc, "flags": list(flags)})
        with open(log_path, "w") as f:
            f.writelines(_line(s, 70.0 if graphed else 280.0) for s in range(1, steps + 1))
        return 0

    monkeypatch.setattr(gpu, "train", train)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key in ("NPROC", "TRAIN_ITERS", "EAGER_ITERS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("REHEARSAL_ITERS", "0")  # its own tests below
    return started


def test_default_model_trains_graphed_then_eager(fake_train, capsys):
    assert M.main([]) == 0
    graphed, eager = fake_train
    assert graphed["graphed"] and graphed["steps"] == 30
    assert flagsets.MAXPOOL_FLAG in graphed["flags"] and flagsets.MAXPOOL_FLAG in eager["flags"]
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


def test_the_jobs_own_megatron_noise_goes_to_its_log(fake_train, monkeypatch, capfd, tmp_path):
    """Megatron's import warnings from the job's own argument checks land in the job's log."""
    def noisy(flags, nproc):
        os.write(2, b"UserWarning: Apex is not installed. Falling back to Torch Norm\n")
        return []

    monkeypatch.setattr(gpu, "capture_problems", noisy)
    assert M.main([]) == 0
    assert "Apex" not in capfd.readouterr().err
    (log,) = (tmp_path / "jobs").glob("*/" + logs.IN_PROCESS_LOG)
    assert "Apex is not installed" in log.read_text()


def test_stderr_into_moves_the_descriptor_and_gives_it_back(tmp_path):
    """Warnings and a logging handler made inside the block go to the file; after it, stderr is
    the console again, and that handler writes there."""
    import subprocess
    import sys

    log = tmp_path / "noise.log"
    code = ("import logging, sys, warnings\n"
            "from hfsdp.main_job import stderr_into\n"
            "with stderr_into(sys.argv[1]):\n"
            "    warnings.warn('import noise')\n"
            "    logging.basicConfig()\n"
            "    logging.getLogger('megatron').warning('log noise')\n"
            "logging.getLogger('megatron').warning('after the block')\n")
    run = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True,
                         cwd=logs.REPO_ROOT, check=False)
    assert run.returncode == 0, run.stderr
    assert "import noise" in log.read_text() and "log noise" in log.read_text()
    assert "noise" not in run.stderr and "after the block" in run.stderr


def test_no_gpu_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("NPROC", raising=False)
    assert M.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_failed_training_returns_its_exit_code(monkeypatch, fake_train):
    monkeypatch.setattr(gpu, "train", lambda *a: 7)
    assert M.main([]) == 7


def test_train_logs_everything_and_shows_the_steps(monkeypatch, tmp_path, capsys):
    """train() runs the command as a process group: every line goes to the log (after the
    command), the step lines to the terminal too; a failed run also shows the end of its output."""
    import sys

    step = _line(1, 70.0).strip()
    script = f"import sys; print({step!r}); print('> arguments dump'); sys.exit(int(sys.argv[1]))"
    monkeypatch.setattr(runs.pretrain, "command",
                        lambda flags, nproc, steps, rpg=1: [sys.executable, "-c", script, str(flags[0])])
    log = tmp_path / "main.log"
    assert runs.train(["0"], 1, 2, str(log)) == 0
    command, *output = log.read_text().splitlines()
    assert command.startswith("$ ") and output == [step, "> arguments dump"]
    out = capsys.readouterr().out
    assert step in out and "arguments dump" not in out and str(log.name) in out
    assert runs.train(["3"], 1, 2, str(log)) == 3
    out = capsys.readouterr().out
    assert "the run failed (exit status 3)" in out and "  | > arguments dump" in out


def test_runs_share_triton_autotuning_unless_the_caller_chose(monkeypatch, tmp_path):
    """The eager comparison reuses the graphed run's Triton choices (TRITON_CACHE_AUTOTUNING=1)
    and the runs get expandable allocator segments; a caller's own values, and every other
    variable, reach the run unchanged."""
    import json
    import sys

    names = ("TRITON_CACHE_AUTOTUNING", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_NVLS_ENABLE")
    script = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"
    monkeypatch.setattr(runs.pretrain, "command",
                        lambda flags, nproc, steps, rpg=1: [sys.executable, "-c", script])
    log = tmp_path / "main.log"
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert runs.train([], 1, 2, str(log)) == 0
    assert json.loads(log.read_text().splitlines()[-1]) == {"TRITON_CACHE_AUTOTUNING": "1", "NCCL_NVLS_ENABLE": "1",
                                           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert runs.train([], 1, 2, str(log)) == 0
    assert json.loads(log.read_text().splitlines()[-1]) == {"TRITON_CACHE_AUTOTUNING": "0", "NCCL_NVLS_ENABLE": "1",
                                           "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}


def test_expandable_segments_only_where_measured():
    """One GPU without NCCL user buffers gets the allocator default; several ranks (NCCL in the
    graph) or --use-nccl-ub keep the caller's allocator settings exactly."""
    assert runs.run_env({}, 1)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in runs.run_env({}, 2)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in runs.run_env({}, 1, ["--use-nccl-ub"])
    assert runs.run_env({"PYTORCH_CUDA_ALLOC_CONF": "x"}, 1)["PYTORCH_CUDA_ALLOC_CONF"] == "x"
    assert runs.run_env({"PYTORCH_ALLOC_CONF": "x"}, 1) == {"PYTORCH_ALLOC_CONF": "x",
                                                        "TRITON_CACHE_AUTOTUNING": "1"}


def test_capture_check_sees_the_runs_allocator(monkeypatch):
    """A caller's expandable segments on several GPUs, without NCCL_GRAPH_REGISTER=0, is a
    capture problem (the job then trains eagerly and says why); on one GPU it is not."""
    monkeypatch.setenv("WORLD_SIZE", "1")  # the caller's values win over capture_problems' own
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    flags = [*gpu.DEFAULT_MODEL_FLAGS, *flagsets.MAXPOOL_FLAGS]
    (problem,) = runs.capture_problems(flags, 2)
    assert "NCCL_GRAPH_REGISTER=0" in problem
    assert runs.capture_problems(flags, 1) == []
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    assert runs.capture_problems(flags, 2) == []


def test_capture_check_leaves_the_environment_as_it_found_it(monkeypatch):
    """The parse gets WORLD_SIZE and RANK for itself; the job's environment does not keep them."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    before = dict(os.environ)
    runs.capture_problems([*gpu.DEFAULT_MODEL_FLAGS, *flagsets.MAXPOOL_FLAGS], 2)
    assert dict(os.environ) == before


def test_one_gpu_says_the_double_buffer_was_idle_and_rehearses_at_dp2(fake_train, monkeypatch, capsys):
    """DP=1 never gathers: the output says so; the rehearsal's verdict decides the exit status."""
    seen = []

    def rehearse(base, steps, graphed, workdir):
        seen.append((steps, graphed))
        return rehearsal.Rehearsal(steps=steps, identical_steps=steps, pool_bytes=384 * MIB,
                           planned_pool_bytes=384 * MIB, home_misses=0,
                           peak_allocated=(4323 * MIB, 4518 * MIB))

    monkeypatch.setattr(gpu, "rehearse", rehearse)
    monkeypatch.setenv("REHEARSAL_ITERS", "8")
    assert M.main([]) == 0
    out = capsys.readouterr().out
    assert seen == [(8, True)]
    assert "nothing passed through the double buffer in the runs above; the DP=2 rehearsal exercised it" in out
    assert ("DP=2 rehearsal (2 ranks on one GPU, 8 steps): max-pool vs no double buffer: lm loss bit-identical "
            "at every step; pool 384.00 MiB = plan; home misses 0") in out
    assert "4,518 MiB with max-pool, 4,323 MiB without (1.045x)" in out
    monkeypatch.setattr(gpu, "rehearse", lambda *a: rehearsal.Rehearsal(steps=8, identical_steps=5, home_misses=0))
    assert M.main([]) == 1
    assert "DIFFERS: identical at 5 of 8 steps" in capsys.readouterr().out


def test_several_gpus_need_no_rehearsal(fake_train, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(gpu, "rehearse", lambda *a: pytest.fail("DP=2 already gathers"))
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
        maxpool = flagsets.MAXPOOL_FLAG in flags
        with open(log_path, "w") as f:
            f.writelines(_line(s, 80.0) for s in range(1, steps + 1))
        for rank in range(nproc):
            with open(run_report.rank_path(extra_env[run_report.ENV], rank), "w") as f:
                json.dump({"peak_allocated_bytes": (110 if maxpool else 100) + rank, "peak_reserved_bytes": 1,
                           "pool_bytes_measured": 64 if maxpool else 0,
                           "maxpool_stats": {"home_misses": 0} if maxpool else None}, f)
        return 0

    monkeypatch.setattr(rehearsal, "train", train)
    monkeypatch.setattr(rehearsal.fit, "preflight", lambda placement, flags, environ=None: "fits")
    monkeypatch.setattr(rehearsal.pools, "planned_maxpool_bytes", lambda flags, dp_size, env=None: 64)
    base = [*gpu.DEFAULT_MODEL_FLAGS, *flagsets.MAXPOOL_FLAGS]
    result = rehearsal.rehearse(base, 8, True, str(tmp_path))
    (twin, _, twin_rpg, twin_env), (pooled, _, rpg, env) = calls
    assert flagsets.MAXPOOL_FLAG not in twin and "--fsdp-double-buffer" not in twin and "--cuda-graph-impl" not in twin
    assert flagsets.MAXPOOL_FLAG in pooled and "--cuda-graph-impl" in pooled
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
    assert runs.one_logger_flags([]) == [runs.NO_ONE_LOGGER]
    assert runs.one_logger_flags([runs.NO_ONE_LOGGER]) == []
    assert M.main([]) == 0
    assert all(r["flags"].count(runs.NO_ONE_LOGGER) == 1 for r in fake_train)
    installed(True)
    assert runs.one_logger_flags([]) == []


def test_each_job_keeps_its_logs_in_a_new_folder(fake_train, monkeypatch, tmp_path, capsys):
    """The runs' logs outlive the job, in a folder of their own: a second job makes another."""
    monkeypatch.setenv("EAGER_ITERS", "4")
    assert M.main([]) == 0 and M.main([]) == 0
    jobs = sorted((tmp_path / "jobs").iterdir())
    expected = ["eager.log", "main.log", logs.IN_PROCESS_LOG]
    assert len(jobs) == 2 and all(sorted(p.name for p in job.iterdir()) == expected for job in jobs)
    out = capsys.readouterr().out
    assert all(f"The runs' whole output: {job}" in out for job in jobs)


def test_job_folder_is_always_new_and_a_bad_root_is_one_sentence(tmp_path):
    root = tmp_path / "jobs"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    first, second = logs.job_folder("cpu", {logs.OUT_ENV: str(root)}), logs.job_folder("cpu", {logs.OUT_ENV: str(root)})
    assert first != second and first.parent == second.parent == root and first.name.startswith("cpu-")
    assert (root / "notes.txt").read_text() == "mine" and not any(first.iterdir())
    with pytest.raises(UserError) as info:
        logs.job_folder("cpu", {logs.OUT_ENV: str(root / "notes.txt")})
    assert "cannot make the job's log folder" in info.value.cause and logs.OUT_ENV in info.value.fix


PLAN = {
    "total_params": 1_000,
    "units": [{"cls": "MambaLayer", "params": 300}, {"cls": "MoETransformerLayer", "params": 500},
              {"cls": "MambaLayer", "params": 100}],
    "allocators": {
        "grad": {"analytic_minimum_bytes": 2 * MIB, "maxpool_pool_bytes": 3 * MIB,
                 "maxpool_arena_numel": {"torch.float32": 1}, "lane_plans": {},
                 "fixed_pool_pooled_units": [0, 2], "fixed_pool_outlier_units": [1], "fixed_pool_outlier_bytes": MIB},
        "weight": {"analytic_minimum_bytes": MIB, "maxpool_pool_bytes": MIB,
                   "maxpool_arena_numel": {"torch.bfloat16": 1}, "lane_plans": {"3": {"pool_bytes": MIB // 2}},
                   "fixed_pool_pooled_units": [0, 2], "fixed_pool_outlier_units": [1],
                   "fixed_pool_outlier_bytes": MIB // 2},
    },
}


def test_plan_summary_gives_units_pools_and_fixed_pool_in_sentences():
    assert cpu.plan_summary(PLAN) == [
        "1,000 parameters: 3 FSDP units (2 x MambaLayer, 1 x MoETransformerLayer) and 100 outside them, "
        "which are never pooled.",
        "weights (bfloat16): max-pool double buffer 1.00 MiB, 1.000 x the analytic minimum of 1.00 MiB; "
        "with --megatron-fsdp-max-pool-lanes 3: 0.50 MiB.",
        "grads (float32): max-pool double buffer 3.00 MiB, 1.500 x the analytic minimum of 2.00 MiB.",
        "0.18.2's FixedPool would pool only 2 of the 3 units (0, 2); the other unit gets memory outside the pool: "
        "0.50 MiB of weights, 1.00 MiB of grads.",
    ]


def test_smoke_summary_reports_steps_and_loss(tmp_path):
    log = tmp_path / "run1.log"
    log.write_text("".join(f" iteration {s:8d}/       3 | lm loss: {5 - s:.6E} |\n" for s in (1, 2)))
    result = {"status": "FAIL", "reasons": ["run1.log: 2 iterations logged, need 3"], "runs": [{"log": str(log)}]}
    assert cpu.smoke_summary(result, 3) == ["FAIL: 2 of 3 steps on 2 ranks, lm loss 4.0000 -> 3.0000.",
                                          "  - run1.log: 2 iterations logged, need 3"]
    assert cpu.smoke_summary({"status": "FAIL", "runs": []}, 3) == ["FAIL: 0 of 3 steps on 2 ranks, no lm loss logged."]


def test_a_failed_cpu_step_shows_its_error_or_the_end_of_its_output(monkeypatch, tmp_path, capsys):
    """A tool's one-sentence error is what the console shows of a failed step; without one, the
    last lines of its output (a traceback's end)."""
    noise = [f"line {i}" for i in range(40)]
    error = ["fsdp_memory_planner: error: --hidden-size 1000 is not a multiple", "  -> fix the flags"]
    log_path = tmp_path / "main_job.log"
    for output, shown in ((noise + error + ["  (set HFSDP_DEBUG=1 for a traceback)"], error),
                          (noise, noise[-logs.FAILED_TAIL_LINES:])):
        monkeypatch.setattr(cpu, "run_logged", lambda title, cmd, log, output=output: (2, output))
        with open(log_path, "w") as log:
            assert not cpu.plan_step(tmp_path, log, log_path)
        first, *rest = capsys.readouterr().out.splitlines()
        assert first.startswith("the memory planner failed (exit status 2);") and str(log_path) in first
        assert rest == [f"  | {line}" for line in shown]


def test_flags_megatron_refuses_are_one_sentence(fake_train, tmp_path, capsys):
    with pytest.raises(UserError, match="Megatron's parser refuses the job's flags: unrecognized arguments: --bogus"):
        runs.capture_problems(["--bogus"], 1)
    assert M.main(["--bogus"]) == 2 and not fake_train
    assert not (tmp_path / "jobs").exists()  # a refused job leaves no folder
    assert "main_job: error: Megatron's parser refuses" in capsys.readouterr().err
    assert M.write_capture_problems(str(tmp_path / "problems.json"), ["--bogus"]) == 2


def test_fork_report_is_two_lines_when_healthy_and_the_whole_status_when_not(tmp_path):
    import shutil

    from hfsdp.patchset.project import Project
    from hfsdp.patchset.series import read_series_names

    rc, lines = M.fork_report()
    pin = Project(logs.REPO_ROOT).pin()
    assert rc == 0 and len(lines) == 2, lines
    overlay = len(Project(logs.REPO_ROOT).overlay_files())
    series = read_series_names(logs.REPO_ROOT / "patches" / "series")
    assert lines[0] == (f"fork {pin.fork_version}: {pin.distribution} {pin.version} + {overlay} files of our own "
                        f"(patches/overlay/) + {len(series)} patches (patches/series)."), lines
    assert lines[1].startswith("Its stamp is up to date and megatron/ has no local edits;"), lines
    shutil.copytree(logs.REPO_ROOT / "patches", tmp_path / "patches")
    rc, lines = M.fork_report(tmp_path)
    assert rc == 1 and any("megatron/ not materialized" in line for line in lines), lines


def test_run_main_on_a_cpu_machine_is_a_short_report_with_the_whole_output_in_a_log(tmp_path):
    """The CPU branch of scripts/run_main.sh, set-up skipped (this interpreter is set up): at most
    80 lines on the console, the key sentences of each step, and Megatron's output in the log."""
    import re
    import subprocess
    import sys

    from hfsdp.patchset.project import Project

    env = {**os.environ, "HFSDP_SETUP_DONE": "1", "HFSDP_PY": sys.executable, "CUDA_VISIBLE_DEVICES": "",
           logs.OUT_ENV: str(tmp_path / "jobs"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(logs.REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(["bash", str(logs.REPO_ROOT / "scripts" / "run_main.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-3000:]
    lines = console.splitlines()
    assert len(lines) <= 80, console
    pin = Project(logs.REPO_ROOT).pin()
    for sentence in (f"fork {pin.fork_version}: {pin.distribution} {pin.version} + ",
                     "Training with Megatron-FSDP needs NVIDIA GPUs",
                     "planning the default model (hybrid layers M*EM*EM*EM*E, hidden size 1024, 16 experts;",
                     "for data-parallel size 2.", "12 FSDP units", "weights (bfloat16): max-pool double buffer",
                     "grads (float32): max-pool double buffer", "0.18.2's FixedPool would pool only 4 of the 12 units",
                     "the main job's model passes the CUDA-graph capture checks",
                     "PASS: 8 of 8 steps on 2 ranks, lm loss ",
                     "== run_main: done (no training: this machine has no CUDA GPU) =="):
        assert sentence in console, sentence
    assert "end of arguments" not in console and "one_logger" not in console and "https://" not in console
    (log_name,) = re.findall(r"^Full output: (.+)$", console, re.M)
    log = (logs.REPO_ROOT / log_name).read_text()
    assert log_name.startswith(str(tmp_path / "jobs"))
    for whole in ("Megatron-FSDP memory plan:", "[weight] 0.18.2 FixedPool", "end of arguments",
                  " iteration        8/       8 |", "HFSDP-FUNCTIONAL RESULT smoke/cpu_gloo_smoke: PASS"):
        assert whole in log, whole
    assert "one_logger package is required" not in log


def test_capture_step_writes_the_problems_and_says_them(tmp_path):
    """The CPU branch's capture check: a model that cannot be captured is named with the reason."""
    import json

    path = tmp_path / "problems.json"
    M.write_capture_problems(str(path), ["--moe-token-dispatcher-type", "allgather"])
    problems = json.loads(path.read_text())
    assert problems and any("allgather" in p for p in problems)
    verdict = cpu.capture_verdict(problems)
    assert verdict[0] == "the main job's model cannot be captured, so on a GPU it would train eagerly:"
    assert verdict[1:] == [f"  - {p}" for p in problems]
    M.write_capture_problems(str(path))
    assert json.loads(path.read_text()) == []


def test_each_module_of_the_main_job_is_at_most_300_lines():
    """The job is split along its concerns (GPU job, rehearsal, CPU fallback, logs, fork report):
    no module of the package grows past 300 lines."""
    from pathlib import Path

    modules = sorted(Path(M.__file__).parent.glob("*.py"))
    assert {m.name for m in modules} >= {"__init__.py", "__main__.py", "gpu.py", "cpu.py"}
    long = {m.name: n for m in modules if (n := len(m.read_text().splitlines())) > 300}
    assert not long, f"modules over 300 lines: {long}"
