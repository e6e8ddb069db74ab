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


def test_ci_allows_only_the_listed_skips(root_conftest: ModuleType) -> None:
    """[Note: skips in CI]: GPU tests and opt-in services may skip; root's may only while the
    capability-free pass runs them; anything else (a machine-dependent skip) fails in CI."""
    allowed = root_conftest.allowed_ci_skip
    assert allowed("needs torchrun with 2 or more ranks on CUDA with mamba_ssm", gpu=True)
    assert allowed("set HFSDP_SLURM_CI=1 to install slurm-wlm+munge", gpu=False)
    assert allowed("set HFSDP_NETWORK_TESTS=1 (needs PyPI)", gpu=False)
    assert allowed(root_conftest.ROOT_SKIP, gpu=False, environ={"HFSDP_UNPRIVILEGED_PASS": "1"})
    assert not allowed(root_conftest.ROOT_SKIP, gpu=False, environ={})
    for reason in ("no C++ compiler on this machine", "transformer_engine is installed here", "no bash"):
        assert not allowed(reason, gpu=False), reason


def test_the_tests_of_a_read_only_folder_are_marked_for_the_capability_free_pass(
        root_conftest: ModuleType) -> None:
    class Item:
        def __init__(self, fixtures: tuple[str, ...]) -> None:
            self.fixturenames, self.markers = fixtures, []

        def add_marker(self, marker: object) -> None:
            self.markers.append(marker)

    locked, plain = Item(("tmp_path", "lock_folder")), Item(("tmp_path",))
    root_conftest.pytest_collection_modifyitems([locked, plain])
    assert [m.name for m in locked.markers] == ["unprivileged"] and plain.markers == []


def test_the_unprivileged_marker_says_how_run_tests_runs_those_tests() -> None:
    """pyproject.toml's description of ``unprivileged`` matches scripts/run_tests.sh: as root, a second pass
    runs them as root without its capabilities (setpriv), not as another user."""
    import re
    import tomllib

    repo = Path(__file__).resolve().parents[2]
    markers = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    (described,) = [m for m in markers if m.startswith("unprivileged:")]
    script = (repo / "scripts" / "run_tests.sh").read_text()
    assert re.search(r"setpriv [^\n]*--bounding-set -all[^\n]*\\\n[^\n]*-m unprivileged", script), script
    assert "without root's capabilities (setpriv)" in described and "nobody" not in described, described
    assert not re.search(r"\b(nobody|runuser|su -|sudo -u)\b", script), "run_tests.sh now switches users"

