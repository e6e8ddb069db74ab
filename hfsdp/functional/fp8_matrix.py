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
  exists and validates on CPU; only a GPU run can say it trains, and then its golden says so). The
  cases are found, not listed (:func:`cases`): an ``*_fp8_*`` case sits in every cell of its row whose
  feature it runs (a graph over max-pool with user buffers shows the graph, max-pool and UB columns),
  and a cell shows its most specific case, one with a golden before one without;
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
from hfsdp.functional.recipe import Recipe, load_recipe

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
FEATURE_FLAGS = frozenset(k for f in FEATURES for k in f.flags)
MAX_POOL_FLAG = "--megatron-fsdp-max-pool-double-buffer"
CASE_MARK = "_fp8_"


@dataclass(frozen=True)
class Refusal:
    """A refused cell: its mark in the table, the sentence under it (reason and way out), and the words
    of the te_arg_checks sentence it stands for."""

    mark: str
    says: str
    check_words: str


OPEN = "open"
LEGEND = ("A case cell gives the GPU kinds of its golden, or \"no golden yet\": only a GPU run tells. Open: no case\n"
          "yet, and nothing in the code says it fails.")
# No cell is refused: under a double buffer, blockwise-FP8 parameters are re-quantized one pooled unit at a
# time (patch mfsdp-blockwise-fp8-requantize-per-unit).
REFUSED: Mapping[tuple[str, bool, str], Refusal] = MappingProxyType({})
MXFP8 = ("`mxfp8` has no row: it is Blackwell's recipe, and below compute capability 10 `validate_args` refuses\n"
         "it (TE would raise in the first forward step); on Hopper use `delayed`, `tensorwise` or `blockwise`.")


def row_of(recipe: Recipe) -> Row | None:
    """The table row a case trains in, or None for a case without an FP8 recipe of the table."""
    name = recipe.model_args.get("--fp8-recipe")
    return Row(name, recipe.model_args.get("--fp8-param-gather") is True) if name in RECIPES else None


def covers(recipe: Recipe, feature: Feature) -> bool:
    """Whether a case's run shows ``feature`` working: it sets the feature's flags (``eager``: no
    graph and no double buffer), and a pool-based feature runs at DP >= 2, where the pool exists."""
    args = recipe.model_args
    if feature.name == "eager":
        return not any(k in args for f in FEATURES for k in f.flags)
    if any(args.get(k) != v for k, v in feature.flags.items()):
        return False
    return recipe.nproc >= 2 or MAX_POOL_FLAG not in feature.flags


def extra_features(recipe: Recipe, feature: Feature) -> int:
    """How many feature flags a case sets beyond ``feature``'s: the cell shows its most specific case."""
    return sum(k in recipe.model_args for k in FEATURE_FLAGS if k not in feature.flags)


def golden_kinds(recipe: Recipe) -> list[str]:
    """The GPU kinds of the goldens a run of ``recipe`` could be held to (those that record their
    environment), sorted; empty when it has none."""
    return sorted({goldens_table.platform_text(c.platform) for c in selection.candidates(recipe) if c.problem is None})


def survey(cases_root: Path = goldens_table.CASES) -> tuple[dict[tuple[str, bool, str], str], dict[str, list[str]]]:
    """Each cell's case, found from the cases themselves, and each case's :func:`golden_kinds`, read once:
    every ``*/*_fp8_*`` case under ``cases_root``, in the cells of its row that it covers, the most
    specific case first, then one with a golden (a cell shows what was run where there is a choice),
    then by name."""
    found: dict[tuple[str, bool, str], tuple[int, bool, str]] = {}
    kinds: dict[str, list[str]] = {}
    for config in sorted(cases_root.glob(f"*/*{CASE_MARK}*/model_config.yaml")):
        recipe = load_recipe(config.parent)
        row = row_of(recipe)
        if row is None:
            raise ValueError(f"{config}: an FP8 case (its name has {CASE_MARK!r}) without --fp8-recipe "
                             f"{' | '.join(RECIPES)}")
        name = f"{config.parent.parent.name}/{config.parent.name}"
        kinds[name] = golden_kinds(recipe)
        unrun = not kinds[name]
        for feature in FEATURES:
            if covers(recipe, feature):
                key = (row.recipe, row.param_gather, feature.name)
                mine = (extra_features(recipe, feature), unrun, name)
                found[key] = min(found[key], mine) if key in found else mine
    return {key: name for key, (_, _, name) in found.items()}, kinds


def cases(cases_root: Path = goldens_table.CASES) -> dict[tuple[str, bool, str], str]:
    """Each cell's case (:func:`survey`)."""
    return survey(cases_root)[0]


def cell(row: Row, feature: Feature, found: Mapping[tuple[str, bool, str], str]) -> str | Refusal | None:
    """The case (its path under test_cases), the refusal, or None (open) of one cell, given
    :func:`cases`."""
    key = (row.recipe, row.param_gather, feature.name)
    if key in found and key in REFUSED:
        raise ValueError(f"cell {key} is both a case ({found[key]}) and a refusal")
    return found.get(key) or REFUSED.get(key)


def case_text(case: str, kinds: Sequence[str]) -> str:
    return f"`{case}` ({'golden: ' + ', '.join(kinds) if kinds else 'no golden yet'})"


def table(cases_root: Path = goldens_table.CASES) -> str:
    found, kinds = survey(cases_root)
    rows = ["| recipe | " + " | ".join(f.heading for f in FEATURES) + " |", "|---|" + "---|" * len(FEATURES)]
    for row in ROWS:
        cells = []
        for feature in FEATURES:
            here = cell(row, feature, found)
            cells.append(OPEN if here is None else here.mark if isinstance(here, Refusal)
                         else case_text(here, kinds[here]))
        rows.append(f"| {row.label} | " + " | ".join(cells) + " |")
    refusals = sorted({r.says for r in REFUSED.values()})
    return "\n".join([*rows, "", LEGEND, "", *([*refusals, ""] if refusals else []), MXFP8]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return goldens_table.block_main("fp8_matrix", "the FP8 recipe table", table, START, END, argv)


if __name__ == "__main__":
    sys.exit(main())
