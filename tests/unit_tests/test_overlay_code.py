"""Rules for the product code we own (the overlay, ``patches/overlay/``), checked on its source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OVERLAY = Path(__file__).resolve().parents[2] / "patches" / "overlay"
MODULES = sorted(OVERLAY.rglob("*.py"))


def test_the_overlay_has_modules() -> None:
    assert len(MODULES) >= 20, f"only {len(MODULES)} modules under {OVERLAY}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(OVERLAY)))
def test_invariants_raise_instead_of_asserting(path: Path) -> None:
    """``python -O`` strips ``assert``: a runtime invariant raises an error naming its values."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert not found, f"{path.relative_to(OVERLAY)}: bare assert on line(s) {found}; raise an error instead"
