"""What a new user tries on pretrain_gpt.py / pretrain_hybrid.py (and ``python -m hfsdp.flags``) on
a machine without a GPU, as a table: each row is an input, the exit status it must end with, and
a fragment of the one sentence it must print; no row may end in a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_entry import TINY  # the tiny dense GPT every entry test uses

REPO_ROOT = Path(__file__).resolve().parents[3]
GPT, HYBRID = str(REPO_ROOT / "pretrain_gpt.py"), str(REPO_ROOT / "pretrain_hybrid.py")
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
MAX_POOL = [*FSDP, "--megatron-fsdp-max-pool-double-buffer"]
NO_GPU = "training needs CUDA GPUs"

# (id, argv, extra environment, exit status, fragment of the output, runs only without CUDA)
ROWS = [
    ("valid dense GPT", [GPT, *TINY], {}, 2, NO_GPU, True),
    ("valid Megatron-FSDP", [GPT, *TINY, *FSDP], {}, 2, f"{NO_GPU} and torch", True),
    ("valid max-pool, 2 lanes", [GPT, *TINY, *MAX_POOL, "--megatron-fsdp-max-pool-lanes", "2"], {}, 2, NO_GPU, True),
    ("valid hybrid without Mamba", [HYBRID, *TINY, "--hybrid-layer-pattern", "*-"], {}, 2, NO_GPU, True),
    ("hybrid script without a pattern", [HYBRID, *TINY], {}, 2, "the hybrid family needs --hybrid-layer-pattern",
     False),
    ("lanes not a number", [GPT, *TINY, "--megatron-fsdp-max-pool-lanes", "abc"], {}, 2,
     "--megatron-fsdp-max-pool-lanes 'abc' is not a whole number", False),
    # More lanes than units: the allocator that counts the units refuses it when the buffer is built
    # (test_entry_errors.py: one sentence); the flags alone pass.
    ("more lanes than units", [GPT, *TINY, *MAX_POOL, "--megatron-fsdp-max-pool-lanes", "1000"], {}, 2, NO_GPU, True),
    ("one lane", [GPT, *TINY, *MAX_POOL, "--megatron-fsdp-max-pool-lanes", "1"], {}, 2,
     "--megatron-fsdp-max-pool-lanes must be an integer >= 2, got 1", False),
    ("lanes without max-pool", [GPT, *TINY, *FSDP, "--megatron-fsdp-max-pool-lanes", "3"], {}, 2,
     "needs --megatron-fsdp-max-pool-double-buffer", False),
    ("max-pool without FSDP", [GPT, *TINY, "--megatron-fsdp-max-pool-double-buffer"], {}, 2,
     "requires --use-megatron-fsdp", False),
    ("unknown flag", [GPT, *TINY, "--megatron-fsdp-max-pool-lane", "3"], {}, 2,
     "did you mean --megatron-fsdp-max-pool-lanes?", False),
    ("bad choice", [GPT, *TINY, "--transformer-impl", "te"], {}, 2, "--transformer-impl: invalid choice: 'te'", False),
    ("per-layer graphs with FSDP", [GPT, *TINY, *FSDP, "--cuda-graph-impl", "local"], {}, 2,
     "per-layer CUDA graphs", False),
    ("grouped GEMM with local specs", [GPT, *TINY, "--moe-grouped-gemm", "--num-experts", "2"], {}, 2,
     "--moe-grouped-gemm has no effect with --transformer-impl local", False),
    ("tensor parallelism without its variable", [GPT, *TINY, "--tensor-model-parallel-size", "2"],
     {"WORLD_SIZE": "2"}, 2, "CUDA_DEVICE_MAX_CONNECTIONS", False),
    ("micro-batch 0", [GPT, *TINY, "--micro-batch-size", "0"], {}, 2, "micro_batch_size > 0", False),
    ("--yaml-cfg missing", [GPT, *TINY, "--yaml-cfg", "/nonexistent/cfg.yaml"], {}, 2,
     "--yaml-cfg /nonexistent/cfg.yaml cannot be read", False),
    ("unit list naming no class", [GPT, *TINY, *FSDP], {"HFSDP_FSDP_UNIT_MODULES": "NoSuchLayer"}, 2,
     "unknown unit class 'NoSuchLayer'", False),
    ("help", [GPT, "--help"], {}, 0, "The fork's own flags, one line each: python -m hfsdp.flags", False),
    ("the fork's flags", ["-m", "hfsdp.flags"], {}, 0, "--megatron-fsdp-max-pool-lanes N", False),
]


@pytest.mark.parametrize(("argv", "env", "status", "fragment"), [
    pytest.param(*r[1:5], id=r[0], marks=[pytest.mark.no_cuda] if r[5] else []) for r in ROWS])
def test_probe_row(argv, env, status, fragment):
    base = {k: v for k, v in os.environ.items()
            if k not in ("HFSDP_DEBUG", "RANK", "WORLD_SIZE", "CUDA_DEVICE_MAX_CONNECTIONS", "HFSDP_FSDP_UNIT_MODULES")}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, *argv], cwd="/", env={**base, **env}, capture_output=True, text=True,
                          timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == status, output[-3000:]
    assert fragment in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
