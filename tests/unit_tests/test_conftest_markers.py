"""The markers tests/unit_tests/conftest.py acts on: no_cuda skips where a GPU is seen, only there."""

from __future__ import annotations

import conftest  # tests/unit_tests/conftest.py, on sys.path as pytest's rootdir conftest
import pytest


class _Item:
    def __init__(self, *markers: str) -> None:
        self.markers = markers

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name in self.markers else None


def test_no_cuda_skips_where_torch_sees_a_gpu_and_runs_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "cuda_available", lambda: True)
    with pytest.raises(pytest.skip.Exception, match="without CUDA"):
        conftest.pytest_runtest_setup(_Item("no_cuda"))
    conftest.pytest_runtest_setup(_Item())  # unmarked: runs on a GPU machine too
    monkeypatch.setattr(conftest, "cuda_available", lambda: False)
    conftest.pytest_runtest_setup(_Item("no_cuda"))
