"""Every GPU functional case's arguments pass Megatron's validate_args (CPU), so a recipe
error shows here and not after a GPU machine has started."""

import contextlib
import io
import sys
from pathlib import Path

import pytest
import torch

import megatron.training.arguments as arguments
from hfsdp.functional import recipe

CASES = Path(__file__).resolve().parents[2] / "functional_tests" / "test_cases"
GPU_CASES = sorted(p.parent for p in CASES.glob("*/*/model_config.yaml")
                   if p.parent.parent.name != "smoke")


def test_the_one_gpu_graph_cases_exist():
    names = {c.name for c in GPU_CASES}
    assert {"hybrid_mcore_local_fsdp_1gpu_eager_no_db", "hybrid_mcore_local_fsdp_1gpu_graph_no_db",
            "hybrid_mcore_local_fsdp_1gpu_graph_maxpool"} <= names, names


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_case_arguments_validate(case, monkeypatch, tmp_path):
    rec = recipe.load_recipe(case)
    for key, value in rec.env_vars.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORLD_SIZE", str(rec.nproc))
    monkeypatch.setenv("RANK", "0")
    # Models built earlier in this process left Megatron's attention switches set.
    for key in ("CUDA_DEVICE_MAX_CONNECTIONS", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # --moe-grouped-gemm
    deterministic = torch.are_deterministic_algorithms_enabled()  # --deterministic-mode sets it
    paths = {k: str(tmp_path / k) for k in ("OUTPUT_PATH", "CHECKPOINT_SAVE_PATH",
                                            "CHECKPOINT_LOAD_PATH", "TENSORBOARD_PATH",
                                            "DATA_PATH", "DATA_CACHE_PATH")}
    monkeypatch.setattr(sys, "argv", ["pretrain"] + recipe.args_to_argv(rec.model_args, paths))
    args = arguments.parse_args()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            arguments.validate_args(args, {})
    finally:
        torch.use_deterministic_algorithms(deterministic)
    if "graph" in case.name:
        assert args.cuda_graph_impl == "full_iteration"
        assert args.global_batch_size // (args.micro_batch_size * rec.nproc) >= 2, \
            "a graphed case must accumulate over micro-batches"
