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
from hfsdp.training import entries

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
    script = rec.training_script.split()[0]  # the reference example's own flags are its, not Megatron's
    argv = entries.megatron_flags(script, recipe.args_to_argv(rec.model_args, paths))
    monkeypatch.setattr(sys, "argv", ["pretrain", *argv])
    args = arguments.parse_args()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            arguments.validate_args(args, {})
    finally:
        torch.use_deterministic_algorithms(deterministic)
    if entries.training_entry(script) == entries.REFERENCE_EXAMPLE:
        from hfsdp.training import reference

        reference.check_args(args)  # the layouts the example takes
    if "graph" in case.name:
        assert args.cuda_graph_impl == "full_iteration"
        assert args.global_batch_size // (args.micro_batch_size * rec.nproc) >= 2, \
            "a graphed case must accumulate over micro-batches"


@pytest.mark.parametrize("spec", ["local", "te"])
def test_the_graphed_eval_resume_case_is_its_eager_twin_plus_graphs_and_max_pool(spec):
    """Evaluation, a checkpoint and a resume: the graphed case may differ from its eager twin only
    in the graph and max-pool flags, and both must evaluate on a schedule a golden can hold."""
    graph = recipe.load_recipe(CASES / "hybrid" / f"hybrid_mcore_{spec}_fsdp_1gpu_graph_maxpool_eval_resume")
    eager = recipe.load_recipe(CASES / "hybrid" / f"hybrid_mcore_{spec}_fsdp_1gpu_eager_no_db_eval_resume")
    assert (graph.case_dir / graph.compare_to).resolve() == eager.case_dir.resolve()
    added = {k: v for k, v in graph.model_args.items() if k not in eager.model_args}
    assert added == {"--cuda-graph-impl": "full_iteration", "--cuda-graph-warmup-steps": 3, "--logging-level": 20,
                     "--fsdp-double-buffer": True, "--megatron-fsdp-max-pool-double-buffer": True}
    assert all(graph.model_args[k] == v for k, v in eager.model_args.items())
    for r in (graph, eager):
        assert r.test_type == "ckpt-resume" and "lm loss validation" in r.metrics
        assert r.model_args["--eval-iters"] >= 1 and r.train_iters % r.model_args["--eval-interval"] == 0
    assert "CUDA graph capture done for validation" in graph.checks.log_present
