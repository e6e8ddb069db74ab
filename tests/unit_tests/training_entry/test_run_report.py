"""HFSDP_RUN_REPORT: per-rank files, atomic writes, merged reads, off by default (CPU)."""

from __future__ import annotations

import pytest

from hfsdp.training import run_report as R


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(R, "_model_ref", None)


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(R.ENV, raising=False)
    R.note_forward_step(object())  # must not touch CUDA or remember anything
    assert R._model_ref is None and R.write_if_requested() is None


def test_each_rank_writes_its_own_file_and_read_merges(monkeypatch, tmp_path):
    path = tmp_path / "sub" / "report.json"
    monkeypatch.setenv(R.ENV, str(path))
    for rank, (alloc, misses) in enumerate([(10, 0), (30, 2)]):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setattr(R, "collect", lambda a=alloc, m=misses: {
            "peak_allocated_bytes": a, "peak_reserved_bytes": 50 - a,
            "maxpool_stats": {"home_misses": m}, "cuda_graph_captured": True})
        written = R.write_if_requested()
        assert written == R.rank_path(str(path), rank)
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json", "report.json.rank1"]
    merged = R.read(str(path), world_size=2)
    assert merged["peak_allocated_bytes"] == 30 and merged["peak_reserved_bytes"] == 40
    assert merged["maxpool_stats"] == {"home_misses": 2} and merged["cuda_graph_captured"] is True
    with pytest.raises(OSError):
        R.read(str(path), world_size=3)  # a rank that wrote nothing is an error, not a default


def test_read_rejects_a_torn_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"peak_allocated_bytes": 1')
    with pytest.raises(ValueError, match=r"r\.json is not JSON"):
        R.read(str(path), world_size=1)


@pytest.mark.parametrize(("text", "says"), [
    ("[]", "holds a JSON list, not an object"),
    ("{}", "lacks peak_allocated_bytes, peak_reserved_bytes"),
    ('{"peak_allocated_bytes": "lots", "peak_reserved_bytes": 1}', "has peak_allocated_bytes 'lots'"),
    ('{"peak_allocated_bytes": 1, "peak_reserved_bytes": -1}', "has peak_reserved_bytes -1"),
    ('{"peak_allocated_bytes": 1, "peak_reserved_bytes": 1, "maxpool_stats": [1]}', "has maxpool_stats [1]"),
])
def test_read_names_a_file_that_is_not_a_report(tmp_path, text, says):
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{path} {says}".replace("[", r"\[").replace("]", r"\]")):
        R.read(str(path), world_size=1)
