"""Orchestration of scripts/benchmark_double_buffer.py with the GPU runs faked out."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from hfsdp.bench import results as R
from hfsdp.bench import run as B
from hfsdp.proc import run_group

GIB = 2**30


@pytest.fixture(autouse=True)
def gpu_machine(monkeypatch):
    """The runs are faked: the machine they would run on has 8 GPUs and every optional package."""
    monkeypatch.setattr(B.fit, "gpu_memory", lambda *a, **k: [80 * GIB] * 8)
    monkeypatch.setattr(B.requirements, "importable", lambda package: True)


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
    assert list(doc["meta"]["primed"]) == ["no_db"] and doc["meta"]["primed"]["no_db"]["ok"]
    assert {r["repeat"] for r in doc["runs"]} == {0, 1, 2}  # the priming run is not a result
    maxpool = next(s for s in doc["summary"] if s["config"] == "maxpool")
    assert maxpool["runs"] == 3 and maxpool["step_time_ratio"] == pytest.approx(0.95)


def test_each_startup_class_is_primed_once(monkeypatch, tmp_path):
    """Eager and graphed runs of one spec share their kernels; user buffers add the NCCL
    allocator's build, and Transformer Engine specs their own kernels: one priming run each."""
    calls = []

    def launch(config, repeat, flags, opts, workdir, timeout_s=None):
        calls.append((config.name, repeat))
        return R.RunResult(config=config.name, repeat=repeat, step_times_s=(0.1,), tokens_per_step=4096,
                           peak_allocated_bytes=1, peak_reserved_bytes=1, startup_s=30.0), "log"

    monkeypatch.setattr(B, "launch", launch)
    out = tmp_path / "r.json"
    B.main(["--configs", "no_db,maxpool_graph,maxpool_ub_graph,te_maxpool,te_no_db", "--repeats", "1",
            "--no-plan", "--no-chart", "--out-json", str(out)])
    assert [c for c, r in calls if r == -1] == ["no_db", "maxpool_ub_graph", "te_maxpool"]
    assert all(r == -1 for _, r in calls[:3]) and all(r == 0 for _, r in calls[3:])
    doc = json.loads(out.read_text())
    assert doc["meta"]["primed"]["maxpool_ub_graph"] == {"wall_s": pytest.approx(0, abs=1), "ok": True,
                                                         "startup_s": 30.0}
    assert {r["startup_s"] for r in doc["runs"]} == {30.0}


def test_runs_share_triton_autotuning_unless_the_caller_chose(fake_launch, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    opts, _ = B.parse(["--configs", "no_db"])
    assert opts.env["TRITON_CACHE_AUTOTUNING"] == "1"
    opts, _ = B.parse(["--configs", "no_db", "--env", "TRITON_CACHE_AUTOTUNING=0"])
    assert opts.env["TRITON_CACHE_AUTOTUNING"] == "0"
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    opts, _ = B.parse(["--configs", "no_db"])
    assert "TRITON_CACHE_AUTOTUNING" not in opts.env  # the caller's own value passes through


def test_no_prime(fake_launch, tmp_path):
    B.main(["--configs", "no_db", "--repeats", "1", "--no-plan", "--no-chart", "--no-prime",
            "--out-json", str(tmp_path / "r.json")])
    assert [c[1] for c in fake_launch] == [0]


def test_time_budget_launches_no_run_that_would_end_past_it(fake_launch, monkeypatch, tmp_path, capsys):
    """Each faked run takes 100 s of a fake clock: with 250 s, two runs fit and the third would end at 300 s."""
    clock = [1000.0]
    monkeypatch.setattr(B.time, "time", lambda: clock[0])
    real_launch = B.launch

    def slow_launch(*args, **kwargs):
        clock[0] += 100.0
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(B, "launch", slow_launch)
    rc = B.main(["--configs", "no_db,maxpool", "--repeats", "2", "--no-plan", "--no-chart", "--no-prime",
                 "--time-budget", "250", "--out-json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 1 and len(fake_launch) == 2, out  # the invocation is incomplete: exit 1
    assert out.count("not launched: --time-budget 250s would end during it (estimate 100s, the longest run after "
                     "the first)") == 2
    assert len(json.loads((tmp_path / "r.json").read_text())["runs"]) == 2


def test_time_budget_estimate_leaves_out_the_cold_first_run(fake_launch, monkeypatch, tmp_path, capsys):
    """The first run pays for cold compile caches (150 s of a fake clock), the rest take 50 s. With 320 s
    all four fit (they end at 150, 200, 250, 300 s); the first run as the estimate would stop after two."""
    clock = [1000.0]
    monkeypatch.setattr(B.time, "time", lambda: clock[0])
    real_launch = B.launch

    def launch(*args, **kwargs):
        clock[0] += 150.0 if not fake_launch else 50.0
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(B, "launch", launch)
    rc = B.main(["--configs", "no_db,maxpool", "--repeats", "2", "--no-plan", "--no-chart", "--no-prime",
                 "--time-budget", "320", "--out-json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0 and len(fake_launch) == 4, out
    assert B.run_estimate([150.0])[0] == 150.0 and B.run_estimate([150.0, 50.0, 60.0])[0] == 60.0


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
        launched, printed = (tmp_path / "no_db-0.log").read_text().splitlines()
        assert launched.startswith("[hfsdp-bench] launched at [") and printed == expected
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


@pytest.fixture
def te_launch(monkeypatch):
    """Fake runs of every configuration: local and TE losses differ, as their kernels do."""
    seen = []
    steps = {"no_db": 0.300, "maxpool": 0.290, "no_db_graph": 0.070, "maxpool_graph": 0.065,
             "te_no_db": 0.250, "te_maxpool": 0.240, "te_no_db_graph": 0.050, "te_maxpool_graph": 0.045}

    def launch(config, repeat, flags, opts, workdir, timeout_s=None):
        seen.append((config.name, [*flags, *config.flags], dict(opts.env)))
        loss = (10.0, 9.5) if config.spec == "local" else (10.0, 9.4)
        if config.name == "te_maxpool" and repeat == 1:
            loss = (10.0, 9.400001)
        base = steps[config.name]
        return R.RunResult(config=config.name, repeat=repeat, step_times_s=(base,), tokens_per_step=4096,
                           peak_allocated_bytes=2**30, peak_reserved_bytes=2**31, lm_loss=loss), "log"

    monkeypatch.setattr(B, "launch", launch)
    monkeypatch.setattr(B.requirements, "importable", lambda package: True)
    return seen


def test_one_invocation_compares_te_and_local(te_launch, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = B.main(["--configs", ",".join(B.cfgs.TE_COMPARISON), "--repeats", "2", "--no-plan", "--no-chart",
                 "--no-prime", "--out-json", str(out)])
    assert rc == 0
    for name, flags, _ in te_launch:  # argparse keeps the last --transformer-impl
        impl = flags[len(flags) - 1 - flags[::-1].index("--transformer-impl") + 1]
        assert impl == ("transformer_engine" if name.startswith("te_") else "local"), (name, flags)
    doc = json.loads(out.read_text())
    te = {s["config"]: s for s in doc["summary_te"]}
    assert set(te) == {"te_no_db", "te_maxpool", "te_no_db_graph", "te_maxpool_graph"}
    assert te["te_maxpool_graph"]["step_time_ratio"] == pytest.approx(0.045 / 0.250)
    local = {s["config"]: s for s in doc["summary"]}
    assert local["te_no_db"]["step_time_ratio"] == pytest.approx(0.250 / 0.300)  # TE vs local
    # Each spec's losses are held to its own eager baseline, not to the other spec's.
    by_base = doc["loss_agreement_by_baseline"]
    assert set(by_base) == {"no_db", "te_no_db"}
    assert all(r["identical"] for r in by_base["no_db"]["runs"])
    assert {(r["config"], r["repeat"]) for r in by_base["te_no_db"]["runs"] if not r["identical"]} == {
        ("te_maxpool", 1)}
    text = capsys.readouterr().out
    assert "Transformer Engine configurations, x base against te_no_db:" in text
    assert "loss agreement vs 2 te_no_db run(s)" in text


def test_te_configurations_without_te_are_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(B.requirements, "importable", lambda package: package != "transformer_engine")
    monkeypatch.setattr(B, "launch", lambda *a, **k: pytest.fail("nothing may run"))
    rc = B.main(["--configs", "no_db,te_maxpool", "--no-plan", "--out-json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "te_maxpool need Transformer Engine, which is not importable here" in err, err
    assert "-e '.[te]'" in err and "drop the te_* configurations" in err, err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("configs, options, named", [
    ("te_no_db,te_no_db_fused", ["--deterministic"], "--cross-entropy-loss-fusion (te_no_db_fused)"),
    ("te_no_db", ["--deterministic", "--", "--use-flash-attn"], "--use-flash-attn (te_no_db)"),
    ("te_no_db_fused", ["--", "--deterministic-mode"], "--cross-entropy-loss-fusion (te_no_db_fused)"),
])
def test_deterministic_with_flags_megatron_refuses_is_refused_before_any_run(monkeypatch, tmp_path, capsys,
                                                                            configs, options, named):
    monkeypatch.setattr(B, "launch", lambda *a, **k: pytest.fail("nothing may run"))
    rc = B.main(["--configs", configs, "--no-plan", "--out-json", str(tmp_path / "r.json"), *options])
    err = capsys.readouterr().err
    assert rc == 2 and f"--deterministic-mode, which Megatron refuses together with {named}" in err, err
    assert not (tmp_path / "r.json").exists()


def test_deterministic_gives_every_run_the_te_settings(te_launch, tmp_path):
    from hfsdp import te_determinism

    rc = B.main(["--configs", "no_db,te_no_db", "--repeats", "1", "--no-plan", "--no-chart", "--no-prime",
                 "--deterministic", "--env", "NCCL_ALGO=Tree", "--out-json", str(tmp_path / "r.json"),
                 "--", "--attention-backend", "flash"])
    assert rc == 0
    for _, flags, env in te_launch:
        assert "--deterministic-mode" in flags
        assert flags[flags.index("--attention-backend") + 1] == "flash"  # flags after -- win
        assert env == {**te_determinism.env("cache"), "NCCL_ALGO": "Tree"}  # --env wins
    meta = json.loads((tmp_path / "r.json").read_text())["meta"]
    assert meta["deterministic"] is True
    # Whether TE is installed changes local-spec runs too (optimizer): the JSON says what was there.
    assert set(meta["optional_packages"]) == {"transformer-engine", "apex", "mamba-ssm", "causal-conv1d"}


def test_chart_titles_count_gpus_in_words():
    assert (B.gpus(1), B.gpus(2)) == ("1 GPU", "2 GPUs")


@pytest.mark.parametrize(("gpus", "missing", "args", "says"), [
    (0, None, ["--nproc", "2"], "2 ranks train on CUDA GPUs, one each, and this machine has none"),
    (2, None, ["--nproc", "4"], "4 ranks, one per CUDA GPU, need 4 GPUs, and 2 are visible"),
    (2, "mamba_ssm", ["--nproc", "2"], "mamba_ssm"),
])
def test_a_machine_every_run_would_fail_on_is_refused_before_any_run(monkeypatch, tmp_path, capsys, gpus, missing,
                                                                      args, says):
    monkeypatch.setattr(B.fit, "gpu_memory", lambda *a, **k: [80 * GIB] * gpus)
    monkeypatch.setattr(B.requirements, "importable", lambda package: package != missing)
    monkeypatch.setattr(B, "launch", lambda *a, **k: pytest.fail("no run may start"))
    assert B.main([*args, "--out-json", str(tmp_path / "r.json"), "--no-chart", "--no-plan"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_every_configuration_gets_its_mfu_from_the_models_flops(monkeypatch, tmp_path):
    """tokens/s per GPU x training FLOPs per token / 989 TFLOP/s on an H200 ([Note: model FLOPs])."""
    from hfsdp.bench import flops
    from hfsdp.planner.setup import parse_flags

    def launch(config, repeat, flags, opts, workdir, timeout_s=None):
        return R.RunResult(config=config.name, repeat=repeat, step_times_s=(0.5,), tokens_per_step=8192,
                           peak_allocated_bytes=2**30, peak_reserved_bytes=2**31, device="NVIDIA H200"), "log"

    monkeypatch.setattr(B, "launch", launch)
    out = tmp_path / "new" / "r.json"
    assert B.main(["--nproc", "4", "--configs", "no_db", "--repeats", "1", "--no-plan", "--no-chart",
                   "--out-json", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    per_token = flops.model_flops(parse_flags(meta["model_flags"])).training
    assert meta["model_flops_per_token"] == per_token and meta["peak_flops_per_gpu"] == 989e12
    assert meta["mfu"]["no_db"] == pytest.approx(8192 / 0.5 / 4 * per_token / 989e12)


def test_output_folders_are_made_or_refused_before_any_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(B, "launch", lambda *a, **k: pytest.fail("no run may start"))
    png = "/proc/hfsdp/chart.png"  # a folder no one can make there
    assert B.main(["--nproc", "2", "--out-json", str(tmp_path / "a" / "r.json"), "--out-png", png]) == 2
    assert "--out-png /proc/hfsdp/chart.png: " in capsys.readouterr().err  # no file can be made in /proc


def test_baseline_names_the_configuration_ratios_divide_by(fake_launch, tmp_path, capsys):
    out = tmp_path / "r.json"
    B.main(["--configs", "no_db,maxpool", "--baseline", "maxpool", "--repeats", "1", "--no-plan",
            "--no-chart", "--no-prime", "--out-json", str(out)])
    doc = json.loads(out.read_text())
    no_db = next(s for s in doc["summary"] if s["config"] == "no_db")
    assert no_db["step_time_ratio"] == pytest.approx(0.100 / 0.095) and doc["meta"]["baseline"] == "maxpool"
    assert "x base: against maxpool" in capsys.readouterr().out


def test_a_baseline_outside_the_configurations_is_one_sentence(fake_launch, tmp_path, capsys):
    rc = B.main(["--configs", "no_db,maxpool", "--baseline", "maxpool_graph", "--no-plan", "--no-chart",
                 "--out-json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "--baseline maxpool_graph is not among --configs" in err and not fake_launch


FAKE_PLANNER = """#!/bin/sh
# Stand-in for `python -m hfsdp.planner ... --plan-json OUT`: notes its start, waits, writes a plan.
echo "$$" >> "{log}"
for a; do out=$a; done
[ -f "{fail}" ] && {{ echo "planner: cannot build this model" >&2; exit 2; }}
sleep {delay}
echo '{plan}' > "$out"
"""


def fake_planner(tmp_path, monkeypatch, delay: float = 0.5) -> tuple[str, str]:
    alloc = {"maxpool_pool_bytes": 400, "fixed_pool_pool_bytes": 100, "analytic_minimum_bytes": 400, "lane_plans": {}}
    log, fail = str(tmp_path / "started"), str(tmp_path / "fail")
    exe = tmp_path / "python"
    exe.write_text(FAKE_PLANNER.format(log=log, fail=fail, delay=delay,
                                       plan=json.dumps({"allocators": {"weight": alloc}})))
    exe.chmod(0o755)
    monkeypatch.setattr(B.sys, "executable", str(exe))
    return log, fail


def test_planner_runs_start_together_and_are_read_after_the_runs(tmp_path, monkeypatch):
    log, _ = fake_planner(tmp_path, monkeypatch)
    plans = B.Plans(["--hidden-size", "64"], 2, names=["maxpool_graph", "te_maxpool_graph_bf16rs"])
    # Two sets of plan flags (fp32 and bf16 gradient buffers): both processes start before either ends.
    deadline = time.monotonic() + 5
    while not (os.path.exists(log) and len(open(log).read().split()) == 2):
        assert time.monotonic() < deadline, "the second planner run did not start while the first ran"
        time.sleep(0.01)
    pools = plans.result()
    assert pools == {name: {"pool_bytes": 400, "analytic_minimum_bytes": 400}
                     for name in ("maxpool_graph", "te_maxpool_graph_bf16rs")}


def test_a_failed_planner_run_leaves_no_sizes_and_says_why(tmp_path, monkeypatch, capsys):
    _, fail = fake_planner(tmp_path, monkeypatch)
    open(fail, "w").close()
    assert B.planned_pools(["--hidden-size", "64"], 2, names=["maxpool"]) == {}
    said = capsys.readouterr().out
    assert "planner failed; continuing without planned sizes:\nplanner: cannot build this model" in said


def test_the_main_jobs_planned_pool_comes_from_the_same_planner_run(tmp_path, monkeypatch, capsys):
    """hfsdp.planner.pools runs the planner for the benchmark and the main job alike."""
    from hfsdp.planner import pools

    _, fail = fake_planner(tmp_path, monkeypatch, delay=0)
    assert pools.planned_maxpool_bytes(["--hidden-size", "64"], 2) == 400
    open(fail, "w").close()
    assert pools.planned_maxpool_bytes(["--hidden-size", "64"], 2) is None
    assert "planner failed; continuing without the planned pool:\nplanner: cannot" in capsys.readouterr().out


def test_stopping_the_plans_ends_running_planners(tmp_path, monkeypatch):
    log, _ = fake_planner(tmp_path, monkeypatch, delay=60)
    plans = B.Plans(["--hidden-size", "64"], 2, names=["maxpool"])
    procs = [run.proc for _, run in plans._jobs]
    plans.stop()
    assert all(p.returncode is not None for p in procs)


def test_fp8_configurations_get_mfu_against_both_peaks(monkeypatch, capsys):
    """An FP8 configuration's MFU is printed and kept against the bf16 and the FP8 peak; bf16 ones
    against the bf16 peak only."""
    import argparse
    from types import SimpleNamespace

    from hfsdp.bench import flops as F
    from hfsdp.bench import results as R
    from hfsdp.bench import run as RUN

    monkeypatch.setattr(R, "machine", lambda runs: {"device": "NVIDIA H200"})
    monkeypatch.setattr(F, "model_flops", lambda args: F.ModelFlops(1e9 / 3, 0.0, 0.0, 0.0, 0.0))  # 1 GFLOP a token
    bf16, fp8 = "te_maxpool_ub_graph_bf16rs_fused_pao", "te_maxpool_ub_graph_bf16rs_fused_pao_fp8_tensorwise"
    summaries = [SimpleNamespace(config=bf16, tokens_per_s=98_900.0),
                 SimpleNamespace(config=fp8, tokens_per_s=197_900.0)]
    meta = RUN.model_speed(["--num-layers", "2"], summaries, [], argparse.Namespace(nproc=1, peak_tflops=None))
    assert meta["mfu"] == pytest.approx({bf16: 0.1, fp8: 197_900e9 / 989e12})
    assert meta["mfu_fp8_peak"] == pytest.approx({fp8: 0.1})
    out = capsys.readouterr().out
    assert "MFU 20.0 % (bf16 peak); 10.0 % of the FP8 peak" in out and "MFU 10.0 %\n" in out
