"""Our entry's call of ``megatron.training.pretrain`` binds as meant on every release it runs on.

0.19 moved ``model_provider`` behind ``forward_step_func`` in ``pretrain``'s signature, so a call that
passes them by position hands the forward step to ``get_model`` as the model provider on 0.19.2
(``forward_step() got an unexpected keyword argument 'pre_process'``). The entry passes everything but
the config container by keyword; each release's signature is read from its source (no import).
"""

from __future__ import annotations

import ast
import inspect
import os
import tarfile
from pathlib import Path

import pytest
from pristine_release import extract_pristine

REPO_ROOT = Path(__file__).resolve().parents[3]
ENTRY = REPO_ROOT / "hfsdp" / "training" / "entry.py"
TRAINING = Path("megatron") / "training" / "training.py"
MEANT = {"train_valid_test_dataset_provider", "model_provider", "model_type", "forward_step_func"}


def entry_call() -> ast.Call:
    calls = [n for n in ast.walk(ast.parse(ENTRY.read_text()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "pretrain"]
    assert len(calls) == 1, f"expected one pretrain(...) call in {ENTRY}, found {len(calls)}"
    return calls[0]


def signature_of_pretrain(source: str) -> inspect.Signature:
    (fn,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "pretrain"]
    args = fn.args.args
    first_default = len(args) - len(fn.args.defaults)
    return inspect.Signature([
        inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                          default=None if i >= first_default else inspect.Parameter.empty)
        for i, a in enumerate(args)])


def assert_binds(source: str, where: str) -> None:
    call = entry_call()
    keywords = {k.arg for k in call.keywords}
    sig = signature_of_pretrain(source)
    bound = sig.bind(*[object()] * len(call.args), **{k: object() for k in keywords})
    assert list(bound.arguments)[0] == "cfg_container", f"{where}: the config container is not first"
    assert keywords <= set(sig.parameters), f"{where}: pretrain lacks {sorted(keywords - set(sig.parameters))}"


def test_the_entry_passes_all_but_the_config_by_keyword() -> None:
    call = entry_call()
    assert len(call.args) == 1, f"pretrain gets {len(call.args)} positional arguments; only cfg may be positional"
    assert {k.arg for k in call.keywords} == MEANT


def test_the_call_binds_on_the_materialized_fork() -> None:
    assert_binds((REPO_ROOT / TRAINING).read_text(), "the fork")


def test_the_call_binds_on_pristine_0182(tmp_path: Path) -> None:
    assert_binds((extract_pristine(tmp_path) / TRAINING).read_text(), "0.18.2")


@pytest.mark.skipif(os.environ.get("HFSDP_NETWORK_TESTS") != "1", reason="set HFSDP_NETWORK_TESTS=1 (needs PyPI)")
def test_the_call_binds_on_0192() -> None:
    from hfsdp.patchset.check import _download_unpinned, _newer_pin
    from hfsdp.patchset.project import Project

    other, _ = _newer_pin(Project.default().pin(), "0.19.2")
    with tarfile.open(_download_unpinned(other)) as tar:
        (member,) = [m for m in tar.getmembers() if m.name.endswith("/" + TRAINING.as_posix())]
        source = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
    assert "model_provider=None" in source.replace(" ", ""), "not the 0.19.2 pretrain signature this test knows"
    assert_binds(source, "0.19.2")
