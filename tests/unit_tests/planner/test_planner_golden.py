"""The planner's output, byte for byte, for two configurations (CPU): the comparison pools moved from the
runtime's plan module to hfsdp/planner/compare.py, and the report must not change with such moves."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from test_planner_cli import TINY

from hfsdp.planner import cli

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    "tiny": [],
    "tiny_lanes_0182_units": ["--plan-lanes", "3,4", "--fsdp-unit-modules", "megatron-0.18.2"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_planner_output_is_unchanged(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(TINY + CASES[name] + ["--plan-json", "plan.json"]) == 0
    assert out.getvalue() == (GOLDEN / f"{name}.txt").read_text()
    assert (tmp_path / "plan.json").read_text() == (GOLDEN / f"{name}.json").read_text()
