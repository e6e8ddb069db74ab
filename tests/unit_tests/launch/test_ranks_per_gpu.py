"""Several ranks on one GPU: the torchrun line, each rank's environment, refusals, the memory fit (CPU).

[Note: several ranks on one GPU] in hfsdp/launch/torchrun.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfsdp.launch import fit, shared_gpu, torchrun
from hfsdp.launch.torchrun import Placement
from hfsdp.planner.setup import DEFAULT_MODEL_FLAGS
from hfsdp.usererror import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]
GIB = 2**30


def _opt(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_one_rank_per_gpu_is_plain_torchrun():
    cmd = torchrun.command(Placement(nproc=2, master_port=1234), ["train.py", "--x"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert _opt(cmd, "--nproc-per-node") == "2" and _opt(cmd, "--master-port") == "1234"
    assert _opt(cmd, "--master-addr") == "127.0.0.1" and _opt(cmd, "--max-restarts") == "0"
    assert cmd[-2:] == ["train.py", "--x"] and torchrun.SHARED_GPU_MODULE not in cmd


def test_a_free_port_when_none_is_given():
    ports = {int(_opt(torchrun.command(Placement(nproc=1), ["t.py"]), "--master-port")) for _ in range(3)}
    assert all(0 < p < 65536 for p in ports)


def test_shared_mode_starts_each_rank_through_the_wrapper():
    cmd = torchrun.command(Placement(nproc=4, ranks_per_gpu=2, master_port=9), ["-m", "pytest", "-q"])
    at = cmd.index("-m", 3)
    assert cmd[at:] == ["-m", torchrun.SHARED_GPU_MODULE, "--ranks-per-gpu", "2", "--", "-m", "pytest", "-q"]
    assert _opt(cmd, "--nproc-per-node") == "4"


@pytest.mark.parametrize(("placement", "match"), [
    (Placement(nproc=4, ranks_per_gpu=2, nnodes=2, master_port=1), "one host only"),
    (Placement(nproc=3, ranks_per_gpu=2), "do not split evenly"),
    (Placement(nproc=2, ranks_per_gpu=4), r"--ranks-per-gpu 4 is more than the 2 ranks of this launch"),
    (Placement(nproc=2, nnodes=2, node_rank=2, master_port=1), "node rank 2 is not in"),
    (Placement(nproc=2, nnodes=2), "needs the master's port"),
    (Placement(nproc=0), "must all be >= 1"),
])
def test_placements_that_cannot_start_are_one_sentence(placement, match):
    with pytest.raises(UserError, match=match):
        torchrun.command(placement, ["t.py"])


def test_gpu_count_checks():
    torchrun.check_gpus(Placement(nproc=8), 0)  # one rank per GPU: torchrun and Megatron say it
    with pytest.raises(UserError, match="this machine has none"):
        torchrun.check_gpus(Placement(nproc=2, ranks_per_gpu=2), 0)
    with pytest.raises(UserError, match=r"(?s)need 2 GPUs, and this machine has 1.*--ranks-per-gpu 4"):
        torchrun.check_gpus(Placement(nproc=4, ranks_per_gpu=2), 1)
    torchrun.check_gpus(Placement(nproc=4, ranks_per_gpu=4), 1)
    assert torchrun.ranks_per_gpu_for(2, 1) == 2 and torchrun.ranks_per_gpu_for(2, 8) == 1


def test_rank_env_gives_each_rank_of_a_gpu_its_own_host():
    caller = {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "RANK": "3", "NCCL_NVLS_ENABLE": "1",
              "MASTER_ADDR": "10.0.0.1", "X": "y"}
    env = shared_gpu.rank_env(caller, ranks_per_gpu=2, hostname="box")
    assert env["LOCAL_RANK"] == "1"  # GPU 1 for local ranks 1 and 3 (round robin)
    assert env["NCCL_HOSTID"] == "box-slot1"
    assert env["NCCL_SOCKET_IFNAME"] == "lo" and env["NCCL_IB_DISABLE"] == "1"
    assert env[torchrun.RANKS_PER_GPU_ENV] == "2"
    for key in ("RANK", "NCCL_NVLS_ENABLE", "MASTER_ADDR", "X"):  # the caller's, unchanged
        assert env[key] == caller[key]
    placed = [shared_gpu.rank_env({"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "4"}, 2, "box") for r in range(4)]
    # Ranks of one GPU differ in slot; one slot per GPU shares it. GPU = rank % GPUs: where torch's
    # NCCL process group puts a collective issued before set_device (Megatron's first barrier).
    assert [(e["LOCAL_RANK"], e["NCCL_HOSTID"]) for e in placed] == [
        ("0", "box-slot0"), ("1", "box-slot0"), ("0", "box-slot1"), ("1", "box-slot1")]
    assert [int(e["LOCAL_RANK"]) for e in placed] == [r % 2 for r in range(4)]
    # An srun task (one host): WORLD_SIZE stands in for LOCAL_WORLD_SIZE.
    assert shared_gpu.rank_env({"LOCAL_RANK": "2", "WORLD_SIZE": "4"}, 2, "box")["LOCAL_RANK"] == "0"


def test_rank_env_keeps_what_the_user_set():
    env = shared_gpu.rank_env({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "NCCL_SOCKET_IFNAME": "eth1",
                               "NCCL_IB_DISABLE": "0", "NCCL_HOSTID": "mine"}, 2, "box")
    assert env["NCCL_SOCKET_IFNAME"] == "eth1" and env["NCCL_IB_DISABLE"] == "0"
    assert env["NCCL_HOSTID"] == "mine-slot0"  # still one per rank: a shared id would refuse the GPU


def test_each_rank_runs_the_target_with_its_environment(tmp_path):
    """The real chain on CPU: torchrun -> the wrapper -> exec of the target, per rank."""
    target = tmp_path / "show.py"
    target.write_text("import os, sys\nkeys = ('RANK', 'LOCAL_RANK', 'NCCL_HOSTID', 'NCCL_SOCKET_IFNAME')\n"
                      "path = sys.argv[1] + '.' + os.environ['RANK']\n"
                      "open(path, 'w').write(' '.join(os.environ[k] for k in keys))\n")
    cmd = torchrun.command(Placement(nproc=4, ranks_per_gpu=2), [str(target), str(tmp_path / "env")])
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "NCCL_SOCKET_IFNAME": "eth9", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = sorted((tmp_path / f"env.{r}").read_text().split() for r in range(4))
    host = __import__("socket").gethostname()
    assert ranks == [["0", "0", f"{host}-slot0", "eth9"], ["1", "1", f"{host}-slot0", "eth9"],
                     ["2", "0", f"{host}-slot1", "eth9"], ["3", "1", f"{host}-slot1", "eth9"]]


def test_a_failing_rank_fails_the_launch(tmp_path):
    """exec keeps torchrun's view of the rank: its exit status is the job's."""
    target = tmp_path / "fail.py"
    target.write_text("import os, sys\nsys.exit(7 if os.environ['RANK'] == '1' else 0)\n")
    cmd = torchrun.command(Placement(nproc=2, ranks_per_gpu=2), [str(target)])
    done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0


def test_the_wrapper_refuses_to_run_outside_torchrun():
    done = subprocess.run([sys.executable, "-m", "hfsdp.launch.shared_gpu", "--ranks-per-gpu", "2"],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 2 and "give --ranks-per-gpu N" in done.stderr


# ------------------------------------------------------------------------ memory fit


def test_fit_refuses_what_cannot_fit_and_says_the_numbers():
    memory = fit.RankMemory(weights=GIB, main_params=2 * GIB, main_grads=2 * GIB, optimizer=4 * GIB, pools=GIB)
    line = fit.check_fits(memory, 2, 80 * GIB)
    assert "2 x (10.00 GiB" in line and "= 22.00 GiB of the GPU's 80.00 GiB" in line
    with pytest.raises(UserError, match=r"4 ranks on one GPU need at least 44.00 GiB, more than its 40.00 GiB"):
        fit.check_fits(memory, 4, 40 * GIB)


def test_planned_rank_memory_of_the_default_model():
    """The planner's buckets, sharded: ZeRO-3 halves every shard at DP=2 against DP=1 (up to the
    padding that makes each bucket divide by the DP size)."""
    flags = [*DEFAULT_MODEL_FLAGS, "--megatron-fsdp-main-params-dtype", "fp32",
             "--megatron-fsdp-main-grads-dtype", "fp32", "--fsdp-double-buffer",
             "--megatron-fsdp-max-pool-double-buffer"]
    one, two = fit.rank_memory([*flags, "--global-batch-size", "2"], 1), fit.rank_memory(flags, 2)
    for field in ("weights", "optimizer"):
        halved = getattr(two, field) * 2 / getattr(one, field)
        assert 1.0 <= halved < 1.001, (field, one, two)
    assert two.main_params == 2 * two.weights and two.optimizer == 4 * two.weights  # fp32 vs bf16
    assert abs(two.pools / 2**20 - (128.07 + 256.14)) < 0.01  # the planner's max-pool plan, weights + grads
    lanes = fit.rank_memory([*flags, "--megatron-fsdp-max-pool-lanes", "3"], 2)
    assert lanes.pools < two.pools  # the 3-lane plan (0.688x here)


def test_data_parallel_size_divides_out_model_parallelism():
    assert fit.data_parallel_size(["--tensor-model-parallel-size", "2"], 8) == 4
    with pytest.raises(UserError, match="do not divide"):
        fit.data_parallel_size(["--tensor-model-parallel-size=4"], 6)


def test_preflight():
    assert fit.preflight(Placement(nproc=2), ["--anything"], gpus=[]) is None  # one rank per GPU
    with pytest.raises(UserError, match="this machine has none"):
        fit.preflight(Placement(nproc=2, ranks_per_gpu=2), None, gpus=[])
    assert "no model to plan" in (fit.preflight(Placement(nproc=2, ranks_per_gpu=2), None, gpus=[80 * GIB]) or "")


def test_the_launch_cli_refuses_shared_mode_without_a_gpu(tmp_path):
    """On this CPU machine ``python -m hfsdp.launch`` says why, before anything starts."""
    script = tmp_path / "ran.py"
    script.write_text("print('ran')\n")
    done = subprocess.run([sys.executable, "-m", "hfsdp.launch", "--nproc", "2", "--ranks-per-gpu", "auto",
                           "--", str(script)], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and "this machine has none" in done.stderr and "ran" not in done.stdout
    done = subprocess.run([sys.executable, "-m", "hfsdp.launch", "--nproc", "1", "--", str(script)],
                          capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0 and "ran" in done.stdout


def test_the_plan_reads_the_jobs_environment(monkeypatch):
    """--deterministic-mode asks for NCCL_ALGO, which the job's environment has and the caller's
    may not (a recipe's ENV_VARS): the plan is parsed with the job's environment."""
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    flags = [*DEFAULT_MODEL_FLAGS, "--deterministic-mode"]
    with pytest.raises(UserError, match="NCCL_ALGO"):
        fit.rank_memory(flags, 2)
    assert fit.rank_memory(flags, 2, {"NCCL_ALGO": "Ring"}).total > 0
    assert "NCCL_ALGO" not in os.environ


def test_the_plan_takes_the_jobs_unit_list(monkeypatch):
    """$HFSDP_FSDP_UNIT_MODULES of the job (a recipe's ENV_VARS, --env), not the launcher's, names
    the units the plan has: the plan once read the launcher's."""
    from hfsdp.training import fsdp_units

    monkeypatch.setenv(fsdp_units.ENV, "none")  # the launcher's: would leave the model no unit
    job = {fsdp_units.ENV: "MambaLayer,MoETransformerLayer,TransformerLayer"}
    assert fit.rank_memory(DEFAULT_MODEL_FLAGS, 2, job).pools > 0
    monkeypatch.delenv(fsdp_units.ENV)
    with pytest.raises(UserError, match="no FSDP unit"):
        fit.rank_memory(DEFAULT_MODEL_FLAGS, 2, {fsdp_units.ENV: "none"})


def test_lanes_are_planned_as_training_holds_them():
    """The plan takes its lanes from training's rule (fsdp_units.training_lanes): lanes with the
    max-pool double buffer, and lanes without it refused in training's sentence."""
    lanes = ["--megatron-fsdp-max-pool-lanes", "3"]
    maxpool = [*DEFAULT_MODEL_FLAGS, "--fsdp-double-buffer", "--megatron-fsdp-max-pool-double-buffer"]
    assert fit.rank_memory([*maxpool, *lanes], 2).pools < fit.rank_memory(maxpool, 2).pools
    with pytest.raises(UserError, match="--megatron-fsdp-max-pool-lanes 3 needs --megatron-fsdp-max-pool-double"):
        fit.rank_memory([*DEFAULT_MODEL_FLAGS, *lanes], 2)


@pytest.mark.parametrize("value", ["auto", "AUTO"])
def test_auto_is_named_where_only_a_count_is_taken(value, capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="run_case")
    torchrun.add_ranks_per_gpu_option(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--ranks-per-gpu", value])
    assert "'auto' is taken only by `python -m hfsdp.launch`" in capsys.readouterr().err


CASES_ROOT = Path(__file__).resolve().parents[3] / "tests/functional_tests/test_cases"
TWO_RANK_CASES = sorted(p.parent for p in CASES_ROOT.glob("*/*/model_config.yaml") if "_2gpu_" in p.parent.name)


@pytest.mark.parametrize("case", TWO_RANK_CASES, ids=lambda p: p.name)
def test_every_two_rank_case_can_be_planned_for_ranks_sharing_a_gpu(case, monkeypatch):
    """run_case plans a shared-mode launch before it starts (fit.preflight): the plan takes every
    two-rank case's flags, TE-only ones (--moe-grouped-gemm) included."""
    from hfsdp.functional.recipe import args_to_argv, load_recipe
    from hfsdp.functional.run_case import path_variables
    from hfsdp.training import entries

    recipe = load_recipe(case)
    argv = args_to_argv(recipe.model_args, path_variables(Path("/nonexistent/out")))
    argv = entries.megatron_flags(recipe.training_script.split()[0], argv)  # as run_case plans them
    if importlib.util.find_spec("transformer_engine") is None:  # run_case plans where the case runs: TE 2.x
        import megatron.core.transformer.transformer_config as transformer_config
        import megatron.training.arguments as arguments

        for module in (arguments, transformer_config):
            monkeypatch.setattr(module, "is_te_min_version", lambda version, check_equality=True: True)
        if "--no-rope-fusion" not in argv:
            argv.append("--no-rope-fusion")  # validate_args asks TE for RoPE fusion; the plan does not change
    environ = {k: v for k, v in recipe.env_vars.items() if v is not None}
    assert fit.rank_memory(argv, recipe.nproc, environ).total > 0
