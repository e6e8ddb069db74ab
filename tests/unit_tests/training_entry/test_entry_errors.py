"""pretrain_gpt.py / pretrain_hybrid.py on bad flags and on a machine without CUDA: one sentence.

Each run is a fresh ``python pretrain_gpt.py ...`` (no torchrun, 1 rank), as a user would start it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_entry import TINY  # the tiny dense GPT every entry test uses

REPO_ROOT = Path(__file__).resolve().parents[3]


def pretrain(*extra: str, debug: bool = False, script: str = "pretrain_gpt.py") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HFSDP_DEBUG", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    if debug:
        env["HFSDP_DEBUG"] = "1"
    return subprocess.run([sys.executable, str(REPO_ROOT / script), *TINY, *extra], env=env, cwd="/",
                          capture_output=True, text=True, timeout=300)


CASES = [
    (["--megatron-fsdp-max-pool-double-buffer"], "--megatron-fsdp-max-pool-double-buffer requires --use-megatron-fsdp"),
    (["--nccl-comm-warmup", "--distributed-backend", "gloo"],
     "--nccl-comm-warmup warms NCCL communicators, but --distributed-backend is 'gloo'"),
    (["--num-attention-heads", "5"], "assert args.hidden_size % args.num_attention_heads == 0"),
]


def test_flag_errors_are_user_errors_naming_the_flag():
    """All cases in one process (Megatron is imported once): parse_args raises a UserError."""
    code = (
        "import sys\n"
        "from hfsdp.training.entry import parse_args\n"
        "from hfsdp.usererror import UserError\n"
        f"for extra in {[c[0] for c in CASES]!r}:\n"
        f"    try:\n"
        f"        parse_args({TINY!r} + extra)\n"
        "    except UserError as exc:\n"
        "        print('CAUSE:', exc.cause)\n"
        "        print('FIX:', exc.fix)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, timeout=300)
    causes = [line for line in proc.stdout.splitlines() if line.startswith("CAUSE: invalid flags: ")]
    assert len(causes) == len(CASES), proc.stdout + proc.stderr[-3000:]
    for (_, expected), cause in zip(CASES, causes, strict=True):
        assert expected in cause, cause
    assert proc.stdout.count("FIX: fix the flags; `python pretrain_gpt.py --help`") == len(CASES)


def test_hfsdp_debug_shows_the_traceback():
    """The script's own run: exit status 2, and the traceback only because HFSDP_DEBUG=1 asks for it."""
    proc = pretrain("--megatron-fsdp-max-pool-double-buffer", debug=True)
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "validate_double_buffer_args" in proc.stderr


@pytest.mark.no_cuda  # checks the message on a machine without CUDA
def test_a_valid_configuration_on_a_cpu_machine_says_training_needs_gpus():
    script = "pretrain_gpt.py"
    proc = pretrain(script=script)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{script}: error: training needs CUDA GPUs" in proc.stderr and "fsdp_memory_planner.py" in proc.stderr
    assert "Traceback" not in proc.stderr and "Found no NVIDIA driver" not in proc.stderr
    assert "Megatron requires CUDA" not in proc.stderr
    # The advice for this machine: the memory planner with the same flags, which needs no GPU.
    planner = next(c for c in re.findall(r"`([^`]+)`", proc.stderr) if "fsdp_memory_planner.py" in c)
    argv = planner.replace("--plan-dp-size N", "--plan-dp-size 1").replace("<the same flags>", "").split()
    assert argv[:2] == ["python", "scripts/fsdp_memory_planner.py"], planner
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    plan = subprocess.run([sys.executable, *argv[1:], *TINY], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    # At data-parallel size 1 no unit is ever all-gathered: the plan says no pool is allocated.
    assert plan.returncode == 0 and "no double-buffer pool is allocated" in plan.stdout, plan.stderr[-3000:]


def test_too_many_lanes_found_while_building_is_one_sentence():
    """More lanes than a model chunk's units is only known once its buffer is built (inside
    pretrain); the entry reports it like a flag error, not as a traceback."""
    code = f"""
import sys
import hfsdp.training.entry as entry
import megatron.training.training as training
from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.plan import lanes_units_problem
from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy import LANES_EVERYWHERE
from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.lanes import MaxPoolLanesError

def pretrain(*args, **kwargs):  # what LaneMaxPoolAllocator raises while the buffer is built
    raise MaxPoolLanesError("[fsdp_params] " + lanes_units_problem(6, 5, setting=LANES_EVERYWHERE))

training.pretrain = pretrain
entry.require_cuda = lambda: None
sys.argv = ["pretrain_gpt.py", *{TINY!r}]
entry.main()
"""
    env = {k: v for k, v in os.environ.items() if k not in ("HFSDP_DEBUG", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("error: [fsdp_params] megatron_fsdp_max_pool_lanes (--megatron-fsdp-max-pool-lanes, fully_shard: "
            "maxpool_lanes) asks for 6 lanes, more than the 5 FSDP units") in proc.stderr, proc.stderr[-3000:]


FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]


@pytest.mark.no_cuda  # checks validation on a machine without CUDA
def test_megatron_fsdp_flags_are_validated_without_a_gpu():
    """validate_args asks the GPU's architecture with Megatron-FSDP (and with tensor parallelism);
    without a driver an assumed GPU answers ([Note: validation without a GPU] in
    hfsdp/training/assumed_device.py), so valid flags end in the sentence about the GPU."""
    proc = pretrain(*FSDP)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "pretrain_gpt.py: error: training needs CUDA GPUs" in proc.stderr, proc.stderr[-3000:]
    assert "checked as for a Hopper GPU (compute capability 9)" in proc.stderr
    assert "Traceback" not in proc.stderr and "Found no NVIDIA driver" not in proc.stderr


@pytest.mark.no_cuda  # checks validation on a machine without CUDA
def test_checks_after_the_gpu_query_run_without_a_gpu():
    """The checks validate_args runs after its device queries (CUDA-graph and TE checks) and the
    device queries themselves (--moe-grouped-gemm, tensor parallelism) reject flags on a CPU machine."""
    cases = [
        (FSDP + ["--cuda-graph-impl", "local"], "per-layer CUDA graphs"),
        (["--moe-grouped-gemm", "--num-experts", "2"], "--moe-grouped-gemm has no effect with --transformer-impl"),
        (["--tensor-model-parallel-size", "2"], "CUDA_DEVICE_MAX_CONNECTIONS"),
    ]
    code = (
        "import os, sys\n"
        "from hfsdp.training.entry import parse_args\n"
        "from hfsdp.usererror import UserError\n"
        f"for extra in {[c[0] for c in cases]!r}:\n"
        "    os.environ['WORLD_SIZE'] = '2' if '--tensor-model-parallel-size' in extra else '1'\n"
        "    try:\n"
        f"        parse_args({TINY!r} + extra)\n"
        "    except UserError as exc:\n"
        "        print('CAUSE:', exc.cause.replace(chr(10), ' '))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HFSDP_DEBUG", "CUDA_DEVICE_MAX_CONNECTIONS")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, timeout=300)
    causes = [line for line in proc.stdout.splitlines() if line.startswith("CAUSE: ")]
    assert len(causes) == len(cases), proc.stdout + proc.stderr[-3000:]
    for (_, expected), cause in zip(cases, causes, strict=True):
        assert expected in cause, cause


def test_a_bad_value_of_a_fork_flag_is_one_sentence():
    """Not argparse's usage of every Megatron flag (hundreds of lines) before its one-line error."""
    proc = pretrain("--megatron-fsdp-max-pool-lanes", "abc")
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr[proc.stderr.index("pretrain_gpt.py: error: "):]
    assert error.splitlines()[:2] == [
        "pretrain_gpt.py: error: --megatron-fsdp-max-pool-lanes 'abc' is not a whole number",
        "  -> `python -m hfsdp.flags` says what --megatron-fsdp-max-pool-lanes takes and its default"]
    assert "usage:" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("extra", "expected"), [
    (["--megatron-fsdp-max-pool-lane", "3"],
     "unrecognized arguments: --megatron-fsdp-max-pool-lane 3 (did you mean --megatron-fsdp-max-pool-lanes?)"),
    (["--lr", "fast"], "--lr 'fast' is not a number"),
    (["--transformer-impl", "te"], "--transformer-impl: invalid choice: 'te'"),
])
def test_argparse_errors_are_one_sentence(extra, expected):
    from hfsdp.training import entry

    parser = entry.megatron_parser()
    with pytest.raises(entry.UserError) as info:
        parser.parse_args([*TINY, *extra])
    assert info.value.cause.startswith(expected), info.value.cause
    assert "--help" in info.value.fix


def test_help_has_no_warnings_a_short_usage_and_points_at_the_fork_listing():
    env = {k: v for k, v in os.environ.items() if k != "HFSDP_DEBUG"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), "--help"], env=env, cwd="/",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: pretrain_gpt.py [Megatron flags ...]\n")
    assert proc.stdout.rstrip().endswith("The fork's own flags, one line each: python -m hfsdp.flags")


@pytest.mark.parametrize(("content", "expected"), [
    (None, "cannot be read: No such file or directory"),
    ("folder", "is a folder, not a YAML file"),
    ("a: [1\n", "is not valid YAML (line 2, column 1)"),
    ("- a\n", "holds a YAML list, not a mapping of flag values"),
])
def test_a_yaml_cfg_megatron_cannot_read_is_one_sentence(tmp_path, content, expected):
    from hfsdp.training.entry import check_yaml_cfg
    from hfsdp.usererror import UserError

    path = tmp_path / "cfg.yaml"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(UserError) as info:
        check_yaml_cfg(str(path))
    assert info.value.cause == f"--yaml-cfg {path} {expected}" or info.value.cause.startswith(
        f"--yaml-cfg {path} {expected}"), info.value.cause


def test_a_yaml_cfg_and_a_unit_list_naming_no_class_are_refused_by_the_script(tmp_path):
    proc = pretrain("--yaml-cfg", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "error: --yaml-cfg" in proc.stderr and "Traceback" not in proc.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("HFSDP_DEBUG", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO_ROOT), HFSDP_FSDP_UNIT_MODULES="no_such_module.Layer")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *TINY, *FSDP], env=env, cwd="/",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: HFSDP_FSDP_UNIT_MODULES='no_such_module.Layer': No module named 'no_such_module'" in proc.stderr
    assert "Traceback" not in proc.stderr
