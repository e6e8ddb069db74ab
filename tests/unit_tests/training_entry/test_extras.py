"""The optional extras: setup.py declares exactly hfsdp.extras.EXTRAS, and the hints name them."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from hfsdp import extras
from hfsdp.training.requirements import TE_CORE_DISTS, te_variant_problem

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_setup_py_declares_the_extras(tmp_path: Path) -> None:
    """Build setup.py's metadata (no materialize) and read back every extra's requirements."""
    env = dict(os.environ, HFSDP_SKIP_MATERIALIZE="1")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    requires = next(tmp_path.glob("*.egg-info")) / "requires.txt"
    parser = configparser.ConfigParser(allow_no_value=True, delimiters=("\0",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keep requirement case
    parser.read_string("[base]\n" + requires.read_text())
    declared = {section: normal(parser[section]) for section in parser.sections() if section in extras.EXTRAS}
    assert declared == {name: normal(reqs) for name, reqs in extras.EXTRAS.items()}, declared


def normal(reqs: Iterable[str]) -> list[str]:
    """Requirements compared by meaning (setuptools sorts the extras of a requirement)."""
    return sorted(str(Requirement(r)) for r in reqs)


def test_every_extra_is_pinned_to_one_version() -> None:
    for name, reqs in extras.EXTRAS.items():
        assert reqs and all(r.count("==") == 1 for r in reqs), (name, reqs)


@pytest.mark.parametrize("major", sorted(TE_CORE_DISTS))
def test_the_te_extra_for_a_torch_installs_the_core_of_its_cuda_major(major: int) -> None:
    """The extra te_extra picks for torch's CUDA major brings the core wheel that
    te_variant_problem accepts for it, at the one pinned TE version."""
    (req,) = (Requirement(r) for r in extras.EXTRAS[extras.te_extra(f"{major}.0")])
    assert req.name == "transformer-engine" and str(req.specifier) == f"=={extras.TE_VERSION}", req
    cores = {e for e in req.extras if e.startswith("core-")}
    assert cores == {f"core-cu{major}"} and TE_CORE_DISTS[major] == f"transformer-engine-cu{major}", req
    assert te_variant_problem(f"{major}.0", {TE_CORE_DISTS[major]: extras.TE_VERSION}.get) is None


@pytest.mark.parametrize("package", sorted(extras.PACKAGE_EXTRA))
def test_the_extra_named_for_a_package_installs_it(package: str) -> None:
    """A missing-package error's install hint must install that package."""
    extra = extras.PACKAGE_EXTRA[package] if package != "transformer_engine" else extras.te_extra(None)
    names = {canonicalize_name(Requirement(r).name) for r in extras.EXTRAS[extra]}
    assert canonicalize_name(package) in names, (package, extra, names)


@pytest.mark.parametrize("extra", sorted(extras.EXTRAS))
def test_install_hint_names_the_extra_and_no_build_isolation(extra: str) -> None:
    hint = extras.install_hint(extra)
    assert f"-e '.[{extra}]'" in hint and "--no-build-isolation" in hint, hint
    assert all(req in hint for req in extras.EXTRAS[extra]), hint
    assert (REPO_ROOT / extras.DOC).is_file(), f"the hint points at {extras.DOC}, which does not exist"


def test_install_hint_refuses_an_unknown_extra() -> None:
    with pytest.raises(AssertionError, match="unknown extra 'tee'"):
        extras.install_hint("tee")


@pytest.mark.parametrize("cuda, extra", [("13.0", "te"), ("12.8", "te-cu12"), ("12", "te-cu12"),
                                         (None, "te")])
def test_te_extra_follows_torch_cuda_major(cuda: str | None, extra: str) -> None:
    assert extras.te_extra(cuda) == extra


@pytest.mark.parametrize("doc", ["README.md", extras.DOC])
def test_docs_name_every_extra_and_its_pins(doc: str) -> None:
    text = (REPO_ROOT / doc).read_text()
    for name, reqs in extras.EXTRAS.items():
        assert f".[{name}]" in text, f"{doc} does not mention .[{name}]"
        for req in reqs:
            assert req in text, f"{doc} does not name {req} (the {name} extra)"
    assert "--no-build-isolation" in text, doc
