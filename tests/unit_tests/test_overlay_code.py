"""Rules for the product code we own (the overlay, ``patches/overlay/``), checked on its source."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PATCHES = Path(__file__).resolve().parents[2] / "patches"
OVERLAY = PATCHES / "overlay"
MODULES = sorted(OVERLAY.rglob("*.py"))


def test_the_overlay_has_modules() -> None:
    assert len(MODULES) >= 20, f"only {len(MODULES)} modules under {OVERLAY}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(OVERLAY)))
def test_invariants_raise_instead_of_asserting(path: Path) -> None:
    """``python -O`` strips ``assert``: a runtime invariant raises an error naming its values."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert not found, f"{path.relative_to(OVERLAY)}: bare assert on line(s) {found}; raise an error instead"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(OVERLAY)))
def test_the_product_does_not_import_the_tooling(path: Path) -> None:
    """``megatron/`` runs without ``hfsdp`` (our patch-set tooling): no overlay module imports it."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level]
    assert not [n for n in names if n == "hfsdp" or n.startswith("hfsdp.")], (path, names)


def test_no_patch_adds_an_import_of_the_tooling() -> None:
    added = re.compile(r"^\+(?!\+\+).*\b(?:import hfsdp|from hfsdp[. ])", re.MULTILINE)
    offenders = {p.name: added.findall(p.read_text(encoding="utf-8")) for p in sorted(PATCHES.glob("*.patch"))}
    assert not {k: v for k, v in offenders.items() if v}
