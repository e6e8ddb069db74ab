"""The FP8 recipe table ([Note: FP8 recipes] in hfsdp/functional/fp8_matrix.py): the page's copy is
current, each case cell's recipe runs its row and column, each refused cell is what validate_args
refuses (te_arg_checks), and no other cell is refused there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hfsdp.functional import environment, goldens_table
from hfsdp.functional import fp8_matrix as M
from hfsdp.functional.recipe import load_recipe
from megatron.training.te_arg_checks import te_arg_problems

REPO = Path(__file__).resolve().parents[3]
PAGE = REPO / "docs" / "transformer-engine.md"
CASES = REPO / "tests" / "functional_tests" / "test_cases"
BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 1 --bf16 --lr 1e-4 --train-iters 2 --ckpt-format fsdp_dtensor --use-megatron-fsdp "
    "--data-parallel-sharding-strategy optim_grads_params --use-distributed-optimizer "
    "--transformer-impl transformer_engine"
).split()
CELLS = [(row, feature) for row in M.ROWS for feature in M.FEATURES]
FEATURE_FLAGS = {k for f in M.FEATURES for k in f.flags}


def argv(flags: dict[str, Any]) -> list[str]:
    return [part for k, v in flags.items() for part in ([k] if v is True else [k, str(v)])]


def test_the_table_in_the_docs_is_current() -> None:
    text = PAGE.read_text(encoding="utf-8")
    fix = "run `python -m hfsdp.functional.fp8_matrix --write docs/transformer-engine.md`"
    assert goldens_table.replaced(text, M.table(), PAGE, M.START, M.END) == text, fix


FOUND = M.cases(CASES)


@pytest.mark.parametrize("key, case", sorted(FOUND.items()), ids=lambda x: str(x))
def test_a_case_runs_its_row_and_column(key: tuple[str, bool, str], case: str) -> None:
    recipe_name, param_gather, feature_name = key
    row = M.Row(recipe_name, param_gather)
    (feature,) = [f for f in M.FEATURES if f.name == feature_name]
    r = load_recipe(CASES / case)
    assert {k: r.model_args.get(k) for k in row.flags} == row.flags, case
    assert ("--fp8-param-gather" in r.model_args) == param_gather, case
    features = {k: r.model_args[k] for k in FEATURE_FLAGS if k in r.model_args}
    assert features.items() >= dict(feature.flags).items(), case
    if feature.name == "eager":
        assert features == {}, case
    if "--megatron-fsdp-max-pool-double-buffer" in feature.flags:
        assert r.nproc >= 2, f"{case}: a pool is allocated only at DP >= 2"


def test_every_fp8_case_covers_a_cell_and_none_a_refused_one() -> None:
    for config in CASES.glob("*/*_fp8_*/model_config.yaml"):
        r = load_recipe(config.parent)
        row = M.row_of(r)
        assert row is not None, config
        covered = [f for f in M.FEATURES if M.covers(r, f)]
        assert covered, config
        assert not [f for f in covered if (row.recipe, row.param_gather, f.name) in M.REFUSED], config


def test_a_cell_shows_its_most_specific_case() -> None:
    eager_twin = "moe/moe_mcore_te_fsdp_2gpu_fp8_tensorwise_pg_eager_no_db"
    assert FOUND["tensorwise", True, "eager"] == eager_twin
    assert FOUND["tensorwise", True, "max-pool"] == "moe/moe_mcore_te_fsdp_2gpu_fp8_tensorwise_pg_maxpool"
    assert FOUND["tensorwise", True, "lanes"] == "moe/moe_mcore_te_fsdp_2gpu_fp8_tensorwise_pg_graph_maxpool_lanes3"
    assert FOUND["delayed", False, "graph"] == "moe/moe_mcore_te_fsdp_1gpu_fp8_delayed_graph_no_db"
    assert FOUND["delayed", False, "nccl-ub"] == "moe/moe_mcore_te_fsdp_2gpu_fp8_delayed_graph_maxpool_nccl_ub"


def test_a_one_rank_max_pool_case_shows_no_pool_cell(tmp_path: Path) -> None:
    case = tmp_path / "moe" / "moe_x_fp8_one_rank_maxpool"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(
        "NPROC: 1\nMODEL_ARGS:\n  --fp8-format: e4m3\n  --fp8-recipe: delayed\n"
        "  --fsdp-double-buffer: true\n  --megatron-fsdp-max-pool-double-buffer: true\n")
    assert M.cases(tmp_path) == {}


def test_an_fp8_case_without_a_table_recipe_is_an_error(tmp_path: Path) -> None:
    case = tmp_path / "moe" / "moe_x_fp8_mx"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text("MODEL_ARGS:\n  --fp8-format: e4m3\n  --fp8-recipe: mxfp8\n")
    with pytest.raises(ValueError, match="without --fp8-recipe delayed"):
        M.cases(tmp_path)


@pytest.mark.parametrize("row, feature", CELLS, ids=[f"{r.recipe}-{'pg' if r.param_gather else 'bf16'}-{f.name}"
                                                      for r, f in CELLS])
def test_refused_cells_and_only_they_are_refused_by_validate_args(megatron_args, row, feature) -> None:
    args = megatron_args([*BASE, *argv(row.flags), *argv(dict(feature.flags))])
    problems = te_arg_problems(args, environ={}, device_arch=9)
    found = M.cell(row, feature, FOUND)
    if isinstance(found, M.Refusal):
        assert len(problems) == 1 and found.check_words in problems[0], problems
    else:
        assert problems == [], problems


REFUSAL = M.Refusal(mark="refused (a)", says="(a) A reason. The way out.", check_words="cannot")


def test_a_cell_is_a_case_or_a_refusal_not_both(monkeypatch: pytest.MonkeyPatch) -> None:
    key = ("blockwise", True, "max-pool")
    monkeypatch.setattr(M, "REFUSED", {key: REFUSAL})
    assert M.cell(M.Row("blockwise", True), M.FEATURES[2], {}) == REFUSAL
    with pytest.raises(ValueError, match=r"is both a case \(moe/some_case\) and a refusal"):
        M.cell(M.Row("blockwise", True), M.FEATURES[2], {**FOUND, key: "moe/some_case"})


def test_a_refused_cell_shows_its_mark_and_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(M, "REFUSED", {("blockwise", True, "max-pool"): REFUSAL})
    text = M.table(tmp_path)
    assert text.count("refused (a)") == 1 and "(a) A reason. The way out." in text


def test_blockwise_fp8_parameters_have_double_buffer_cases() -> None:
    """Re-quantized one pooled unit at a time, blockwise-FP8 parameters run every double buffer."""
    for feature, variant in (("max-pool", "maxpool"), ("lanes", "graph_maxpool_lanes3"),
                             ("nccl-ub", "graph_maxpool_nccl_ub")):
        assert FOUND["blockwise", True, feature] == f"moe/moe_mcore_te_fsdp_2gpu_fp8_blockwise_pg_{variant}"


def test_the_table_says_cases_refusals_and_mxfp8() -> None:
    text = M.table()
    assert "`moe/moe_mcore_te_fsdp_1gpu_fp8_delayed_eager_no_db` (golden: h200)" in text
    assert "`moe/moe_mcore_te_fsdp_2gpu_fp8_tensorwise_pg_maxpool` (golden: h200 shared)" in text
    assert "refused" not in text and not M.REFUSED
    assert "`mxfp8` has no row" in text


def test_a_case_without_a_golden_says_so(tmp_path: Path) -> None:
    case = tmp_path / "moe" / "moe_x_fp8_delayed_eager"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text("MODEL_ARGS:\n  --fp8-format: e4m3\n  --fp8-recipe: delayed\n")
    assert "`moe/moe_x_fp8_delayed_eager` (no golden yet)" in M.table(tmp_path)


def test_among_equally_specific_cases_a_cell_shows_one_with_a_golden(tmp_path: Path) -> None:
    golden = next((CASES / "moe" / "moe_mcore_te_fsdp_1gpu_fp8_delayed_eager_no_db").glob("golden_values_*.json"))
    flags = "MODEL_ARGS:\n  --fp8-format: e4m3\n  --fp8-recipe: delayed\n  --cuda-graph-impl: full_iteration\n"
    for name in ("moe_a_fp8_graph", "moe_b_fp8_graph"):
        (tmp_path / "moe" / name).mkdir(parents=True)
        (tmp_path / "moe" / name / "model_config.yaml").write_text(flags)
    assert M.cases(tmp_path)["delayed", False, "graph"] == "moe/moe_a_fp8_graph"  # no golden either: by name
    (tmp_path / "moe" / "moe_b_fp8_graph" / golden.name).write_bytes(golden.read_bytes())
    assert M.cases(tmp_path)["delayed", False, "graph"] == "moe/moe_b_fp8_graph"


def test_a_golden_that_records_no_environment_neither_ranks_nor_shows(tmp_path: Path) -> None:
    """A cell ranks and labels a case by the same goldens: those a run could be held to."""
    golden = next((CASES / "moe" / "moe_mcore_te_fsdp_1gpu_fp8_delayed_eager_no_db").glob("golden_values_*.json"))
    bare = {k: v for k, v in json.loads(golden.read_text()).items() if k != environment.KEY}
    case = tmp_path / "moe" / "moe_x_fp8_delayed_eager"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text("MODEL_ARGS:\n  --fp8-format: e4m3\n  --fp8-recipe: delayed\n")
    (case / golden.name).write_text(json.dumps(bare))
    assert M.survey(tmp_path)[1] == {"moe/moe_x_fp8_delayed_eager": []}
    assert "`moe/moe_x_fp8_delayed_eager` (no golden yet)" in M.table(tmp_path)
    (case / golden.name).write_bytes(golden.read_bytes())
    assert "`moe/moe_x_fp8_delayed_eager` (golden: " in M.table(tmp_path)
