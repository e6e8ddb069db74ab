"""FP8 recipes x the fork's features, each cell a functional case or a refusal:
``python -m hfsdp.functional.fp8_matrix``.

[Note: FP8 recipes]
The one source of the recipe table of docs/transformer-engine.md (``--write FILE`` replaces it between
``<!-- fp8-recipes:start -->`` and ``<!-- fp8-recipes:end -->``; a unit test fails when the page's table
is stale). Rows: the FP8 recipes Hopper runs (``--fp8-recipe delayed``, ``tensorwise``, ``blockwise``),
with bf16 parameters (FP8 only in TE's GEMMs) and with FP8 parameters (``--fp8-param-gather``: FSDP
keeps and all-gathers the weights in FP8). Columns: the fork's features on Transformer Engine specs.
A cell is one of

* a functional case, with the GPU kinds its golden was recorded on, or "no golden yet" (the case
  exists and validates on CPU; only a GPU run can say it trains, and then its golden says so);
* a refusal: ``validate_args`` rejects the combination before any GPU work, naming the way out
  ([Note: TE combinations] in megatron/training/te_arg_checks.py; the unit test holds each refused
  cell to that check, and every other cell to its silence);
* open: no case yet, and nothing in the code says it fails.

MXFP8 is Blackwell's recipe: below compute capability 10 ``validate_args`` refuses it, so it has no
row. Only the max-pool column and those built on it (lanes, NCCL user buffers) allocate a pool, and
only at DP >= 2: their cases run two ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hfsdp.functional import goldens_table, selection
from hfsdp.functional.recipe import load_recipe

START, END = "<!-- fp8-recipes:start -->", "<!-- fp8-recipes:end -->"
RECIPES = ("delayed", "tensorwise", "blockwise")
MAX_POOL: Mapping[str, Any] = MappingProxyType(
    {"--fsdp-double-buffer": True, "--megatron-fsdp-max-pool-double-buffer": True})


@dataclass(frozen=True)
class Row:
    recipe: str
    param_gather: bool

    @property
    def flags(self) -> dict[str, Any]:
        flags: dict[str, Any] = {"--fp8-format": "e4m3", "--fp8-recipe": self.recipe}
        if self.param_gather:
            flags["--fp8-param-gather"] = True
        return flags

    @property
    def label(self) -> str:
        return f"`{self.recipe}`" + (" + `--fp8-param-gather`" if self.param_gather else "")


@dataclass(frozen=True)
class Feature:
    name: str
    heading: str
    flags: Mapping[str, Any]


FEATURES = (
    Feature("eager", "eager", MappingProxyType({})),
    Feature("graph", "full-iteration graph", MappingProxyType({"--cuda-graph-impl": "full_iteration"})),
    Feature("max-pool", "max-pool", MAX_POOL),
    Feature("lanes", "3 lanes", MappingProxyType({**MAX_POOL, "--megatron-fsdp-max-pool-lanes": 3})),
    Feature("nccl-ub", "max-pool + NCCL UB", MappingProxyType({**MAX_POOL, "--use-nccl-ub": True})),
)
ROWS = tuple(Row(recipe, pg) for recipe in RECIPES for pg in (False, True))


@dataclass(frozen=True)
class Refusal:
    """A refused cell: its mark in the table, the sentence under it (reason and way out), and the words
    of the te_arg_checks sentence it stands for."""

    mark: str
    says: str
    check_words: str


BLOCKWISE_DOUBLE_BUFFER = Refusal(
    mark="refused (a)",
    says="(a) After each optimizer step, re-quantizing blockwise-FP8 parameters holds every unit's weight bucket\n"
         "at once, more than a double buffer's groups (max-pool, lanes and FixedPool alike). Use another recipe,\n"
         "drop `--fp8-param-gather`, or train without a double buffer.",
    check_words="cannot hold blockwise-FP8 parameters",
)
OPEN = "open"
LEGEND = ("A case cell gives the GPU kinds of its golden, or \"no golden yet\": only a GPU run tells. Open: no case\n"
          "yet, and nothing in the code says it fails.")
CASES: Mapping[tuple[str, bool, str], str] = MappingProxyType({
    ("delayed", False, "eager"): "moe/moe_mcore_te_fsdp_1gpu_fp8_delayed_eager_no_db",
    ("delayed", False, "graph"): "moe/moe_mcore_te_fsdp_1gpu_fp8_delayed_graph_no_db",
    ("tensorwise", True, "eager"): "moe/moe_mcore_te_fsdp_2gpu_fp8_tensorwise_pg_eager_no_db",
    ("tensorwise", True, "max-pool"): "moe/moe_mcore_te_fsdp_2gpu_fp8_tensorwise_pg_maxpool",
    ("blockwise", True, "eager"): "moe/moe_mcore_te_fsdp_1gpu_fp8_blockwise_pg_eager_no_db",
    ("blockwise", True, "graph"): "moe/moe_mcore_te_fsdp_1gpu_fp8_blockwise_pg_graph_no_db",
})
REFUSED: Mapping[tuple[str, bool, str], Refusal] = MappingProxyType(
    {("blockwise", True, feature): BLOCKWISE_DOUBLE_BUFFER for feature in ("max-pool", "lanes", "nccl-ub")})
MXFP8 = ("`mxfp8` has no row: it is Blackwell's recipe, and below compute capability 10 `validate_args` refuses\n"
         "it (TE would raise in the first forward step); on Hopper use `delayed`, `tensorwise` or `blockwise`.")


def cell(row: Row, feature: Feature) -> str | Refusal | None:
    """The case (its path under test_cases), the refusal, or None (open) of one cell."""
    key = (row.recipe, row.param_gather, feature.name)
    if key in CASES and key in REFUSED:
        raise ValueError(f"cell {key} is both a case ({CASES[key]}) and a refusal")
    return CASES.get(key) or REFUSED.get(key)


def case_text(case: str, cases_root: Path) -> str:
    recipe = load_recipe(cases_root / case)
    kinds = sorted({goldens_table.platform_text(c.platform) for c in selection.candidates(recipe)})
    return f"`{case}` ({'golden: ' + ', '.join(kinds) if kinds else 'no golden yet'})"


def table(cases_root: Path = goldens_table.CASES) -> str:
    rows = ["| recipe | " + " | ".join(f.heading for f in FEATURES) + " |", "|---|" + "---|" * len(FEATURES)]
    for row in ROWS:
        cells = []
        for feature in FEATURES:
            found = cell(row, feature)
            cells.append(OPEN if found is None else found.mark if isinstance(found, Refusal)
                         else case_text(found, cases_root))
        rows.append(f"| {row.label} | " + " | ".join(cells) + " |")
    refusals = sorted({r.says for r in REFUSED.values()})
    return "\n".join([*rows, "", LEGEND, "", *refusals, "", MXFP8]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return goldens_table.block_main("fp8_matrix", "the FP8 recipe table", table, START, END, argv)


if __name__ == "__main__":
    sys.exit(main())
