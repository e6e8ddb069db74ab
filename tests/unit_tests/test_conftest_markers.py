"""The markers tests/unit_tests/conftest.py acts on: no_cuda skips where a GPU is seen, only there."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest


class _Item:
    def __init__(self, *markers: str) -> None:
        self.markers = markers

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name in self.markers else None


@pytest.fixture
def root_conftest(pytestconfig: pytest.Config) -> ModuleType:
    """This folder's conftest as pytest loaded it (each test folder's conftest is a "conftest" module,
    so `import conftest` finds whichever came last)."""
    path = Path(__file__).with_name("conftest.py").resolve()
    found = [p for p in pytestconfig.pluginmanager.get_plugins()
             if isinstance(p, ModuleType) and p.__file__ and Path(p.__file__).resolve() == path]
    assert len(found) == 1, f"pytest loaded {len(found)} plugins from {path}"
    return found[0]


def test_no_cuda_skips_where_torch_sees_a_gpu_and_runs_elsewhere(root_conftest: ModuleType,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(root_conftest, "cuda_available", lambda: True)
    with pytest.raises(pytest.skip.Exception, match="without CUDA"):
        root_conftest.pytest_runtest_setup(_Item("no_cuda"))
    root_conftest.pytest_runtest_setup(_Item())  # unmarked: runs on a GPU machine too
    monkeypatch.setattr(root_conftest, "cuda_available", lambda: False)
    root_conftest.pytest_runtest_setup(_Item("no_cuda"))
