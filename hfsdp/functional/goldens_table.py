"""Which goldens each functional case has, by environment and GPU kind: ``python -m hfsdp.functional.goldens_table``.

``--write FILE`` replaces the table between ``<!-- goldens-table:start -->`` and ``<!-- goldens-table:end -->``
in ``FILE`` (docs/goldens.md); without it the table is printed. A cell lists the platforms
whose golden was recorded in that environment (``h200``, ``h200 0.19.2``, ``h100 shared``), or says
the case refuses the environment (its recipe's ``ENVIRONMENT``), or ``-`` where no golden exists.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hfsdp.atomic import write_text_atomic
from hfsdp.functional import environment, selection
from hfsdp.functional.recipe import REPO_ROOT, Recipe, load_recipe
from hfsdp.usererror import UserError, run_cli

CASES = REPO_ROOT / "tests" / "functional_tests" / "test_cases"
START, END = "<!-- goldens-table:start -->", "<!-- goldens-table:end -->"
# The environments users have, in the order the table shows them, as their labels
# ([Note: the environment of a golden] in environment.py).
COLUMNS = ("torch", "te-conv1d", "te-conv1d-apex", "apex")
SHORT = dict(environment.LABEL_PARTS)
HEADINGS = {"torch": "torch + mamba_ssm", "te-conv1d": "+ TE + causal-conv1d",
            "te-conv1d-apex": "+ TE + causal-conv1d + Apex", "apex": "Apex, no TE"}


def packages_of(label: str) -> set[str]:
    """The optional packages an environment of ``label`` has (besides mamba_ssm)."""
    parts = set(label.split("-")) - {environment.BASE_LABEL}
    return {name for name, short in SHORT.items() if short in parts}


def refusal(recipe: Recipe, label: str) -> str | None:
    """Why ``recipe`` refuses an environment of ``label`` (its ``ENVIRONMENT``), None when it runs there."""
    has = packages_of(label)
    needs = recipe.environment_needs
    lacking = [p for p in needs.requires if p != "mamba_ssm" and p not in has]
    present = [p for p in needs.excludes if p in has]
    if not lacking and not present:
        return None
    return "refused: " + "; ".join(
        [*(f"needs {SHORT.get(p, p)}" for p in lacking), *(f"excludes {SHORT.get(p, p)}" for p in present)])


def platform_text(platform: str) -> str:
    """``dgx_h200_mcore0.19.2_shared`` -> ``h200 0.19.2 shared``."""
    kind = selection.kind_of(platform)
    rest = platform[len(kind):].replace("_mcore", " ").replace("_", " ").strip()
    return f"{kind.removeprefix('dgx_')} {rest}".strip()


def table(cases_root: Path = CASES) -> str:
    rows = ["| case | " + " | ".join(HEADINGS[c] for c in COLUMNS) + " |",
            "|---|" + "---|" * len(COLUMNS)]
    for case_dir in sorted(p.parent for p in cases_root.glob("*/*/model_config.yaml")):
        recipe = load_recipe(case_dir)
        found = selection.candidates(recipe)
        cells = []
        for label in COLUMNS:
            platforms = sorted(platform_text(c.platform) for c in found if c.label == label)
            why = refusal(recipe, label)
            if not recipe.require_golden:
                cells.append("no golden needed")
            else:
                cells.append(why if why else ", ".join(platforms) if platforms else "-")
        extra = sorted({c.label for c in found} - set(COLUMNS))
        name = f"{recipe.model}/{recipe.name}" + (f" (also: {', '.join(extra)})" if extra else "")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def replaced(text: str, body: str, where: Path, start: str = START, end: str = END) -> str:
    """``text`` with the part between the markers (``start`` and ``end``) replaced by ``body``."""
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise UserError(f"{where} does not hold one {start} ... {end} block",
                        "put the two markers, in that order, where the table goes")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{body}{end}{tail}"


def block_main(prog: str, what: str, body: Callable[[], str], start: str, end: str,
               argv: Sequence[str] | None = None) -> int:
    """The command of a generated Markdown block: print ``body()``, or with ``--write FILE``
    replace the block between ``start`` and ``end`` in FILE (written only when it changed)."""
    parser = argparse.ArgumentParser(prog=f"python -m hfsdp.functional.{prog}", description=f"Print {what}.")
    parser.add_argument("--write", type=Path, default=None, help="replace the table in this Markdown file")

    def run() -> int:
        ns = parser.parse_args(argv)
        text_body = body()
        if ns.write is None:
            sys.stdout.write(text_body)
            return 0
        text = ns.write.read_text(encoding="utf-8")
        new = replaced(text, text_body, ns.write, start, end)
        if new != text:
            write_text_atomic(ns.write, new)
            print(f"wrote {what} into {ns.write}")
        return 0

    return run_cli(prog, run, lambda: "nothing was written")


def main(argv: Sequence[str] | None = None) -> int:
    return block_main("goldens_table", "the goldens table", table, START, END, argv)


if __name__ == "__main__":
    sys.exit(main())
