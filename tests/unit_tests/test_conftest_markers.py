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


SKIPS = """
import pytest


def test_unlisted():
    pytest.skip("no C++ compiler on this machine")


@pytest.mark.skipif(True, reason="transformer_engine is installed here")
def test_unlisted_at_setup():
    pass


def test_listed():
    pytest.skip("set HFSDP_NETWORK_TESTS=1 (needs PyPI)")


@pytest.mark.gpu
def test_gpu():
    pytest.skip("needs torchrun with 2 or more ranks on CUDA")


@pytest.mark.xfail(reason="known")
def test_expected_failure():
    raise AssertionError


def test_passes():
    pass
"""


@pytest.mark.parametrize("ci", ["1", None])
def test_ci_turns_an_unlisted_skip_into_a_failure_in_a_real_session(tmp_path: Path, ci: str | None) -> None:
    """[Note: skips in CI] end to end: a pytest session with this folder's conftest (copied beside a test file)
    fails, with HFSDP_CI=1, the skips the note does not allow (raised in a test or by a skipif mark) and keeps
    the listed ones, GPU tests' and xfails as they are; without HFSDP_CI every skip stays a skip."""
    import os
    import shutil
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    shutil.copy(here / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_skips.py").write_text(SKIPS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA GPUs\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HFSDP_CI", "HFSDP_UNPRIVILEGED_PASS", "PYTEST_ADDOPTS")}
    env.update({"PYTHONPATH": os.pathsep.join([str(here.parents[1]), str(here)]), **({"HFSDP_CI": ci} if ci else {})})
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--strict-markers",
                           "test_skips.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    summary = out.strip().splitlines()[-1]
    if ci:
        assert done.returncode == 1, out
        # A skip in the test fails it; one at setup (a skipif mark) is an error of the test's setup.
        assert "1 failed, 1 passed, 2 skipped, 1 xfailed, 1 error" in summary, out
        assert "FAILED test_skips.py::test_unlisted -" in out and "ERROR test_skips.py::test_unlisted_at_setup" in out
        assert "skipped in CI (no C++ compiler on this machine); CI allows only the skips ALLOWED_CI_SKIPS" in out
        assert "set HFSDP_NETWORK_TESTS=1 (needs PyPI)" in out and "needs torchrun with 2 or more ranks" in out
    else:
        assert done.returncode == 0 and "1 passed, 4 skipped, 1 xfailed" in summary, out

