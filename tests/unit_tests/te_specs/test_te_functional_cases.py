"""The Transformer Engine functional cases: what they run, that each twin pair differs only in
the feature under test, that DETERMINISM is their one source of deterministic settings, and that
the driver refuses to PASS them without goldens (recorded only with --record)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hfsdp import te_determinism
from hfsdp.functional.recipe import Recipe, RecipeError, load_recipe
from hfsdp.functional.run_case import run_case

REPO_ROOT = Path(__file__).resolve().parents[3]
CASES = REPO_ROOT / "tests/functional_tests/test_cases"
TE_CASES = {
    "hybrid/hybrid_mcore_te_fsdp_1gpu_eager_no_db": None,
    "hybrid/hybrid_mcore_te_fsdp_1gpu_graph_maxpool": "hybrid/hybrid_mcore_te_fsdp_1gpu_eager_no_db",
    "hybrid/hybrid_mcore_te_fsdp_1gpu_fused_mamba_eager_no_db": None,
    "hybrid/hybrid_mcore_te_fsdp_1gpu_fused_mamba_maxpool":
        "hybrid/hybrid_mcore_te_fsdp_1gpu_fused_mamba_eager_no_db",
    "moe/moe_mcore_te_fsdp_1gpu_grouped_gemm_eager_no_db": None,
    "moe/moe_mcore_te_fsdp_1gpu_grouped_gemm_maxpool": "moe/moe_mcore_te_fsdp_1gpu_grouped_gemm_eager_no_db",
    # checkpoint resume: saved without double buffering, resumed with max-pool (MODEL_ARGS_2)
    "hybrid/hybrid_mcore_te_fsdp_1gpu_resume_no_db_to_maxpool": None,
    # evaluation every 4 steps, checkpoint at step 10 and resume (ckpt-resume), eager and graphed
    "hybrid/hybrid_mcore_te_fsdp_1gpu_eager_no_db_eval_resume": None,
    "hybrid/hybrid_mcore_te_fsdp_1gpu_graph_maxpool_eval_resume":
        "hybrid/hybrid_mcore_te_fsdp_1gpu_eager_no_db_eval_resume",
    # the precision-aware optimizer: checkpoint at step 10 and resume, DP=1 and DP=2, eager and graphed
    "hybrid/hybrid_mcore_te_fsdp_1gpu_pao_eager_no_db_resume": None,
    "hybrid/hybrid_mcore_te_fsdp_1gpu_pao_graph_maxpool_resume":
        "hybrid/hybrid_mcore_te_fsdp_1gpu_pao_eager_no_db_resume",
    "hybrid/hybrid_mcore_te_fsdp_2gpu_pao_eager_no_db_resume": None,
    "hybrid/hybrid_mcore_te_fsdp_2gpu_pao_graph_maxpool_resume":
        "hybrid/hybrid_mcore_te_fsdp_2gpu_pao_eager_no_db_resume",
    # FP8 recipes, the cases of the recipe table (hfsdp/functional/fp8_matrix.py)
    "moe/moe_mcore_te_fsdp_1gpu_fp8_delayed_eager_no_db": None,
    "moe/moe_mcore_te_fsdp_1gpu_fp8_delayed_graph_no_db": "moe/moe_mcore_te_fsdp_1gpu_fp8_delayed_eager_no_db",
    "moe/moe_mcore_te_fsdp_1gpu_fp8_blockwise_pg_eager_no_db": None,
    "moe/moe_mcore_te_fsdp_1gpu_fp8_blockwise_pg_graph_no_db":
        "moe/moe_mcore_te_fsdp_1gpu_fp8_blockwise_pg_eager_no_db",
    "moe/moe_mcore_te_fsdp_2gpu_fp8_tensorwise_pg_eager_no_db": None,
    "moe/moe_mcore_te_fsdp_2gpu_fp8_tensorwise_pg_maxpool": "moe/moe_mcore_te_fsdp_2gpu_fp8_tensorwise_pg_eager_no_db",
    **{f"moe/moe_mcore_te_fsdp_2gpu_fp8_{row}_{kind}": None if kind == "eager_no_db"
       else f"moe/moe_mcore_te_fsdp_2gpu_fp8_{row}_eager_no_db"
       for row in ("delayed", "delayed_pg", "tensorwise", "blockwise")
       for kind in ("eager_no_db", "graph_maxpool_nccl_ub", "graph_maxpool_lanes3")},
    **{f"moe/moe_mcore_te_fsdp_2gpu_fp8_{row}_pg_{kind}": f"moe/moe_mcore_te_fsdp_2gpu_fp8_{row}_pg_eager_no_db"
       for row in ("tensorwise", "blockwise") for kind in ("graph_maxpool_nccl_ub", "graph_maxpool_lanes3")},
    "moe/moe_mcore_te_fsdp_2gpu_fp8_blockwise_pg_eager_no_db": None,
    "moe/moe_mcore_te_fsdp_2gpu_fp8_blockwise_pg_maxpool": "moe/moe_mcore_te_fsdp_2gpu_fp8_blockwise_pg_eager_no_db",
}
TWO_RANKS = {case for case in TE_CASES if "_2gpu_" in case}
# The FP8 recipe rows with DP=2 graphed max-pool cases (NCCL user buffers, 3 lanes).
FP8_DP2_ROWS = ("delayed", "delayed_pg", "tensorwise", "tensorwise_pg", "blockwise", "blockwise_pg")
MAXPOOL = {"--fsdp-double-buffer": True, "--megatron-fsdp-max-pool-double-buffer": True}
GRAPH = {"--cuda-graph-impl": "full_iteration", "--cuda-graph-warmup-steps": 3, "--logging-level": 20}


def recipe(case: str) -> Recipe:
    return load_recipe(CASES / case)


def test_the_te_cases_exist_and_take_the_deterministic_settings() -> None:
    found = {f"{p.parent.parent.name}/{p.parent.name}" for p in CASES.glob("*/*_te_*/model_config.yaml")}
    assert found == set(TE_CASES)
    for case, twin in TE_CASES.items():
        r = recipe(case)
        assert r.nproc == (2 if case in TWO_RANKS else 1), case
        assert r.require_golden and r.determinism == te_determinism.PROFILE, case
        assert r.model_args["--transformer-impl"] == "transformer_engine", case
        assert {k: r.model_args[k] for k in te_determinism.flags()} == te_determinism.flags(), case
        assert r.env_vars == te_determinism.env("pin"), case
        assert (r.compare_to is None) == (twin is None), case
        if twin:
            assert (r.case_dir / r.compare_to).resolve() == (CASES / twin).resolve(), case


@pytest.mark.parametrize("case, added", [
    ("hybrid/hybrid_mcore_te_fsdp_1gpu_graph_maxpool", {**GRAPH, **MAXPOOL}),
    ("hybrid/hybrid_mcore_te_fsdp_1gpu_fused_mamba_maxpool", MAXPOOL),
    ("moe/moe_mcore_te_fsdp_1gpu_grouped_gemm_maxpool", MAXPOOL),
    ("hybrid/hybrid_mcore_te_fsdp_1gpu_graph_maxpool_eval_resume", {**GRAPH, **MAXPOOL}),
    ("hybrid/hybrid_mcore_te_fsdp_1gpu_pao_graph_maxpool_resume", {**GRAPH, **MAXPOOL}),
    ("hybrid/hybrid_mcore_te_fsdp_2gpu_pao_graph_maxpool_resume", {**GRAPH, **MAXPOOL}),
    ("moe/moe_mcore_te_fsdp_1gpu_fp8_delayed_graph_no_db", GRAPH),
    ("moe/moe_mcore_te_fsdp_1gpu_fp8_blockwise_pg_graph_no_db", GRAPH),
    ("moe/moe_mcore_te_fsdp_2gpu_fp8_tensorwise_pg_maxpool", MAXPOOL),
    ("moe/moe_mcore_te_fsdp_2gpu_fp8_blockwise_pg_maxpool", MAXPOOL),
    *[(f"moe/moe_mcore_te_fsdp_2gpu_fp8_{row}_graph_maxpool_nccl_ub", {**GRAPH, **MAXPOOL, "--use-nccl-ub": True})
      for row in FP8_DP2_ROWS],
    *[(f"moe/moe_mcore_te_fsdp_2gpu_fp8_{row}_graph_maxpool_lanes3",
       {**GRAPH, **MAXPOOL, "--megatron-fsdp-max-pool-lanes": 3})
      for row in FP8_DP2_ROWS],
])
def test_each_case_is_its_twin_plus_the_feature_under_test(case: str, added: dict) -> None:
    r, twin = recipe(case), recipe(TE_CASES[case])
    assert {k: v for k, v in r.model_args.items() if k not in twin.model_args} == added
    assert {k: v for k, v in twin.model_args.items() if r.model_args.get(k) != v} == {}
    assert r.env_vars == twin.env_vars and r.metrics == twin.metrics


def test_te_hybrid_twin_is_the_local_twin_on_te_specs() -> None:
    te, local = recipe("hybrid/hybrid_mcore_te_fsdp_1gpu_eager_no_db"), recipe(
        "hybrid/hybrid_mcore_local_fsdp_1gpu_eager_no_db")
    differ = {k for k in {*te.model_args, *local.model_args} if te.model_args.get(k) != local.model_args.get(k)}
    assert differ == {"--transformer-impl", "--attention-backend"}, differ


@pytest.mark.parametrize("case", TE_CASES)
def test_fused_mamba_cases_and_only_they_leave_the_mem_eff_path_on(case: str) -> None:
    r = recipe(case)
    fused = "fused_mamba" in case
    if r.model == "hybrid":
        assert ("--disable-mamba-mem-eff-path" not in r.model_args) == fused, case
    if r.model == "moe":
        assert r.model_args.get("--moe-grouped-gemm") is True and "--num-experts" in r.model_args


@pytest.mark.parametrize("yaml, words", [
    ("DETERMINISM: transformer_engine\nENV_VARS:\n  NCCL_ALGO: Tree\nMODEL_ARGS: {--a: 1}\n",
     "NCCL_ALGO also set by DETERMINISM"),
    ("DETERMINISM: transformer_engine\nMODEL_ARGS: {--deterministic-mode: true}\n",
     "--deterministic-mode also set by DETERMINISM"),
    ("DETERMINISM: transformer_engine\nMODEL_ARGS: {--a: 1}\nMODEL_ARGS_2: {--attention-backend: flash}\n",
     "--attention-backend also set by DETERMINISM"),
    ("DETERMINISM: local\nMODEL_ARGS: {--a: 1}\n", "DETERMINISM must be 'transformer_engine'"),
])
def test_determinism_is_the_only_source_of_its_settings(tmp_path: Path, yaml: str, words: str) -> None:
    case = tmp_path / "hybrid" / "c"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(yaml)
    with pytest.raises(RecipeError, match=words):
        load_recipe(case)


def fake_log(case: Recipe, steps: int = 20) -> str:
    """A log that satisfies the case's CHECKS and carries every metric of every step."""
    lines = [f"log_present: {p}" for p in case.checks.log_present]
    for it in range(1, steps + 1):
        lines.append(f" [t] iteration {it:8d}/{steps:8d} | consumed samples: {4 * it} | elapsed time per "
                     f"iteration (ms): 50.0 | lm loss: {10.0 - 0.1 * it:.6E} | num zeros: 0 |")
        lines.append(f"[Rank 0] (after {it} iterations) memory (MB) | allocated: 100.0 | "
                     "max allocated: 200.0 | reserved: 300.0 | max reserved: 300.0")
    return "\n".join(lines) + "\n"


# --evaluate-log judges single-run cases; the ckpt-resume driver path is tested with a fake trainer
# (tests/unit_tests/slurm/test_functional_driver.py).
@pytest.mark.parametrize("case", [c for c, twin in TE_CASES.items()
                                  if twin and load_recipe(CASES / c).test_type == "regular"])
def test_driver_passes_no_te_case_without_goldens(tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies of a case and its twin, judged on a log that meets every other condition, where TE and
    causal-conv1d import: no golden for this environment; PASS and a golden only with --record.
    Without TE the case is refused before anything runs."""
    from fake_environments import fake_environment

    from hfsdp.functional import environment

    assert run_case(CASES / case, output_root=tmp_path / "refused", evaluate_log=tmp_path / "none.log").status == \
        "REFUSED"
    with_te = fake_environment(packages=(("apex", None), ("causal_conv1d", "1.7.0"), ("mamba_ssm", "2.3.2.post1"),
                                         ("transformer_engine", "2.20.2")))
    monkeypatch.setattr(environment, "probe", lambda environ=None: with_te)
    cases, out = tmp_path / "cases", tmp_path / "out"
    copies = {}
    for name in (TE_CASES[case], case):
        dst = cases / name
        dst.mkdir(parents=True)
        shutil.copy(CASES / name / "model_config.yaml", dst / "model_config.yaml")
        log = tmp_path / f"{dst.name}.log"
        log.write_text(fake_log(load_recipe(dst)))
        copies[name] = (dst, log)
    twin_dir, twin_log = copies[TE_CASES[case]]
    assert run_case(twin_dir, output_root=out, evaluate_log=twin_log).status == "NO GOLDEN FOR THIS ENVIRONMENT"
    case_dir, case_log = copies[case]
    result = run_case(case_dir, output_root=out, evaluate_log=case_log)
    assert result.status == "NO GOLDEN FOR THIS ENVIRONMENT" and result.reasons == [
        "no golden for this environment: the case has no golden; record one here with --record (it is written to "
        "golden_values_te-conv1d_dgx_h200.json)"], result.reasons
    assert not list(case_dir.glob("golden_values_*.json"))
    result = run_case(case_dir, output_root=out, evaluate_log=case_log, record=True)
    assert result.status == "PASS", result.reasons
    assert (case_dir / "golden_values_te-conv1d_dgx_h200.json").is_file()


def test_te_resume_case_switches_only_the_max_pool_flag_at_the_resume() -> None:
    r = recipe("hybrid/hybrid_mcore_te_fsdp_1gpu_resume_no_db_to_maxpool")
    assert r.test_type == "ckpt-resume"
    assert r.model_args_2 == MAXPOOL
    assert not MAXPOOL.keys() & r.model_args.keys()
    assert r.model_args["--ckpt-format"] == "fsdp_dtensor"
