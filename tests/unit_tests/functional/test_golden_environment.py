"""Goldens know the environment they were recorded in, and the driver compares environments before numbers.

Fake environments stand in for machines: each class of difference (GPU, base, torch, CUDA, NCCL, an
optional package present, absent or of another version, NVIDIA Apex's modules, a Megatron path) gives
one phrase of a one-line "no golden for this environment" verdict, never a list of per-step mismatches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from fake_environments import fake_environment

from hfsdp.functional import environment, golden, selection
from hfsdp.functional.batch import Outcome, count_line
from hfsdp.functional.recipe import RecipeError, load_recipe
from hfsdp.functional.run_case import NO_GOLDEN, PASS, REFUSED, RESULT_MARK, run_case
from hfsdp.training import requirements
from hfsdp.usererror import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]
CASES = REPO_ROOT / "tests/functional_tests/test_cases"

LOG = "".join(
    f" [t] iteration {i:8d}/       4 | consumed samples: {8 * i} | elapsed time per iteration (ms): 80.0 | "
    f"lm loss: {9.0 - 0.25 * i:.6E} | num zeros: 0 |\n" for i in range(1, 5))
TE_PATHS = tuple(sorted(requirements.megatron_paths(
    lambda m: m in {requirements.TE_OPTIMIZERS, "causal_conv1d"}).items()))
ENV_A = fake_environment()
ENV_B = fake_environment(packages=(("apex", None), ("causal_conv1d", "1.7.0"), ("mamba_ssm", "2.3.2.post1"),
                                   ("transformer_engine", "2.20.2")), megatron_paths=TE_PATHS)


def _with(env: environment.Environment, name: str, value: str | None) -> environment.Environment:
    return replace(env, packages=tuple(sorted({**dict(env.packages), name: value}.items())))


@pytest.mark.parametrize(("changed", "phrase"), [
    (replace(ENV_A, gpu="dgx_h100"), "GPU dgx_h200 here, dgx_h100 there"),
    (replace(ENV_A, base="0.19.2"), "megatron-core base"),
    (replace(ENV_A, torch="2.12.0+cu130"), "torch 2.11.0+cu130 here, 2.12.0+cu130 there"),
    (replace(ENV_A, cuda="12.9"), "CUDA 13.0 here, 12.9 there"),
    (replace(ENV_A, nccl="2.27.3"), "NCCL 2.28.9 here, 2.27.3 there"),
    (_with(ENV_A, "mamba_ssm", "2.2.4"), "mamba_ssm 2.3.2.post1 here, 2.2.4 there"),
    (_with(ENV_A, "transformer_engine", "2.20.2"), "Transformer Engine absent here, 2.20.2 there"),
    (_with(ENV_A, "causal_conv1d", "1.7.0"), "causal-conv1d absent here, 1.7.0 there"),
    (_with(ENV_A, "apex", "NVIDIA Apex 0.1: amp_C"), "NVIDIA Apex absent here"),
    (replace(ENV_A, megatron_paths=(*ENV_A.megatron_paths[:-1], ("optimizer", "Apex's FusedAdam/FusedSGD"))),
     "Megatron's optimizer path: torch's AdamW/SGD (Adam in the distributed optimizer) here, Apex's"),
])
def test_each_difference_is_one_phrase(changed: environment.Environment, phrase: str) -> None:
    found = environment.differences(ENV_A, changed)
    assert len(found) == 1, found
    assert phrase in found[0], found
    assert environment.differences(ENV_A, ENV_A) == []


def test_paths_that_follow_from_a_package_are_one_phrase() -> None:
    """TE and causal-conv1d change four of Megatron's paths: the verdict names the packages, then the paths."""
    assert environment.differences(ENV_A, ENV_B) == [
        "Transformer Engine absent here, 2.20.2 there", "causal-conv1d absent here, 1.7.0 there",
        "so Megatron's mamba_conv, multi_tensor, optimizer paths differ"]


def test_apex_modules_and_versions_compare_exactly() -> None:
    one = _with(ENV_A, "apex", "NVIDIA Apex 0.1: amp_C, apex.optimizers")
    two = _with(ENV_A, "apex", "NVIDIA Apex 0.1: amp_C")
    assert environment.differences(one, two) == [
        "NVIDIA Apex's modules differ ('NVIDIA Apex 0.1: amp_C, apex.optimizers' here, 'NVIDIA Apex 0.1: amp_C' there)"]


def test_labels_name_the_optional_packages_present() -> None:
    assert ENV_A.label() == "torch"
    assert ENV_B.label() == "te-conv1d"
    assert _with(ENV_B, "apex", "NVIDIA Apex 0.1: amp_C").label() == "te-conv1d-apex"
    assert _with(ENV_A, "apex", "NVIDIA Apex 0.1: amp_C").label() == "apex"


def test_environment_block_roundtrips_and_refuses_junk() -> None:
    assert environment.from_json(ENV_B.to_json()) == ENV_B
    bad = ENV_A.to_json() | {"gpu": ""}
    with pytest.raises(ValueError, match="'environment.gpu' is ''"):
        environment.from_json(bad)
    with pytest.raises(ValueError, match="must map exactly"):
        environment.from_json(ENV_A.to_json() | {"packages": {"transformer_engine": None}})
    with pytest.raises(ValueError, match="unknown fields"):
        environment.from_json(ENV_A.to_json() | {"driver": "580"})


@pytest.mark.real_environment_probe
def test_the_probe_reports_this_interpreter() -> None:
    """The real probe, in a fresh interpreter: what it prints is an environment block of this machine."""
    found = environment.probe()
    import torch

    assert found.torch == torch.__version__
    assert found.megatron_paths == tuple(sorted(requirements.megatron_paths().items()))
    assert found.gpu == ("cpu" if not torch.cuda.is_available() else found.gpu)


@pytest.mark.real_environment_probe
def test_a_probe_that_fails_is_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "torch.py").write_text("raise ImportError('no torch in this environment')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"}
    with pytest.raises(UserError, match="no torch in this environment") as err:
        environment.probe(env)
    assert "run that command yourself" in err.value.fix


# --- the driver, on a fake trainer log ------------------------------------------------------------

def _case(root: Path, name: str, extra: str = "") -> Path:
    case = root / "hybrid" / name
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(
        f"TEST_TYPE: regular\nNPROC: 1\n{extra}METRICS:\n  - lm loss\nMODEL_ARGS:\n  --train-iters: 4\n")
    return case


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "run.log"
    path.write_text(LOG)
    return path


def _probe_as(monkeypatch: pytest.MonkeyPatch, env: environment.Environment) -> None:
    monkeypatch.setattr(environment, "probe", lambda environ=None: env)


def test_no_golden_for_this_environment_until_one_is_recorded(tmp_path: Path, log: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A local case whose golden was recorded with torch only, run where TE and causal-conv1d import:
    one verdict line naming each difference and the way out; after --record-missing, PASS."""
    case = _case(tmp_path / "cases", "local")
    out = tmp_path / "out"
    assert run_case(case, record=True, output_root=out, evaluate_log=log).status == PASS
    assert [p.name for p in case.glob("golden_values_*.json")] == ["golden_values_torch_dgx_h200.json"]
    assert golden.read_environment(case / "golden_values_torch_dgx_h200.json") == ENV_A

    _probe_as(monkeypatch, ENV_B)
    changed = tmp_path / "changed.log"
    changed.write_text(LOG.replace("8.750000E+00", "8.750001E+00"))  # other numbers too: still no mismatch list
    result = run_case(case, output_root=out, evaluate_log=changed)
    assert result.status == NO_GOLDEN
    assert len(result.reasons) == 1, result.reasons
    line = result.reasons[0]
    assert "golden_values_torch_dgx_h200.json" in line
    assert "Transformer Engine 2.20.2 here, absent there" in line
    assert "causal-conv1d 1.7.0 here, absent there" in line
    assert "--record" in line and "golden_values_te-conv1d_dgx_h200.json" in line
    assert "must be identical" not in line

    assert run_case(case, record_missing=True, output_root=out, evaluate_log=changed).status == PASS
    assert sorted(p.name for p in case.glob("golden_values_*.json")) == [
        "golden_values_te-conv1d_dgx_h200.json", "golden_values_torch_dgx_h200.json"]
    assert run_case(case, output_root=out, evaluate_log=changed).status == PASS
    # Back in the first environment, its own golden holds, and a changed number there is a FAIL.
    _probe_as(monkeypatch, ENV_A)
    assert run_case(case, output_root=out, evaluate_log=log).status == PASS
    failed = run_case(case, output_root=out, evaluate_log=changed)
    assert failed.status == "FAIL" and any("must be identical" in r for r in failed.reasons)


def test_record_missing_never_replaces_another_environments_golden(tmp_path: Path, log: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    case = _case(tmp_path / "cases", "local")
    out = tmp_path / "out"
    assert run_case(case, record=True, output_root=out, evaluate_log=log).status == PASS
    path = case / "golden_values_torch_dgx_h200.json"
    before = path.read_bytes()
    _probe_as(monkeypatch, replace(ENV_A, torch="2.12.0+cu130"))  # same label, other torch
    with pytest.raises(UserError, match="holds a golden of another environment") as err:
        run_case(case, record_missing=True, output_root=out, evaluate_log=log)
    assert "torch 2.12.0+cu130 here, 2.11.0+cu130 there" in err.value.cause
    assert "--record" in err.value.fix
    assert path.read_bytes() == before


def test_a_declared_need_is_refused_before_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = _case(tmp_path / "cases", "apex_case",
                 "ENVIRONMENT:\n  requires: [apex]\n  excludes: [transformer_engine]\n"
                 "  why: it checks Apex's FusedAdam\n")
    _probe_as(monkeypatch, ENV_B)
    never = tmp_path / "never.log"  # a launch would fail on the missing trainer; a refusal launches nothing
    result = run_case(case, output_root=tmp_path / "out", evaluate_log=never)
    assert result.status == REFUSED
    assert result.reasons == [
        "needs NVIDIA Apex, absent here; excludes Transformer Engine, importable here (it checks Apex's FusedAdam) -> "
        "run it in an environment with NVIDIA Apex and without Transformer Engine (docs/functional-tests.md lists "
        "what each case needs)"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("block", "message"), [
    ("ENVIRONMENT: [apex]\n", "must be a mapping"),
    ("ENVIRONMENT:\n  requires: [tensorflow]\n  why: x\n", "not optional packages the driver knows"),
    ("ENVIRONMENT:\n  requires: [apex]\n  excludes: [apex]\n  why: x\n", "both requires and excludes"),
    ("ENVIRONMENT:\n  requires: [apex]\n", "must say in one phrase why"),
    ("ENVIRONMENT:\n  needs: [apex]\n", "unknown keys"),
])
def test_environment_block_of_a_recipe_is_checked(tmp_path: Path, block: str, message: str) -> None:
    case = _case(tmp_path, "bad", block)
    with pytest.raises(RecipeError, match=message):
        load_recipe(case)


def test_shared_mode_falls_back_only_to_goldens_of_its_own_base(tmp_path: Path) -> None:
    """With several ranks per GPU: the mode's golden, a real one of this kind, one of another kind;
    never a golden of another base, whatever its name."""
    case = _case(tmp_path, "shared")
    recipe = load_recipe(case)
    other_base = replace(ENV_A, base="0.19.2", gpu="dgx_h100")
    golden.save(recipe.golden_path("torch", "dgx_h100_mcore0.19.2"), {"lm loss": {1: 1.0}}, ["lm loss"], other_base)
    chosen = selection.select(recipe, ENV_A, ["dgx_h200_shared", "dgx_h200"], any_kind=True)
    assert not chosen.matched and chosen.path.name == "golden_values_torch_dgx_h200_shared.json"
    golden.save(recipe.golden_path("torch", "dgx_h100"), {"lm loss": {1: 1.0}}, ["lm loss"],
                replace(ENV_A, gpu="dgx_h100"))
    chosen = selection.select(recipe, ENV_A, ["dgx_h200_shared", "dgx_h200"], any_kind=True)
    assert chosen.matched and chosen.path.name == "golden_values_torch_dgx_h100.json"


def test_an_explicit_platform_of_another_kind_compares_everything_but_the_gpu(tmp_path: Path) -> None:
    case = _case(tmp_path, "kinds")
    recipe = load_recipe(case)
    golden.save(recipe.golden_path("torch", "dgx_h100"), {"lm loss": {1: 1.0}}, ["lm loss"],
                replace(ENV_A, gpu="dgx_h100"))
    assert selection.select(recipe, ENV_A, ["dgx_h100"], ignore_gpu=True).matched
    mismatch = selection.select(recipe, replace(ENV_A, torch="2.12.0"), ["dgx_h100"], ignore_gpu=True)
    assert not mismatch.matched and mismatch.differences == ("torch 2.12.0 here, 2.11.0+cu130 there",)
    own_kind = selection.select(recipe, ENV_A, ["dgx_h200"])
    assert not own_kind.matched and "GPU dgx_h200 here, dgx_h100 there" in own_kind.differences


def test_batch_counts_each_verdict() -> None:
    def outcome(verdict: str, rc: int) -> Outcome:
        return Outcome("hybrid/x", rc, 1.0, f"{RESULT_MARK} hybrid/x: {verdict}", "", False)

    line = count_line([outcome(PASS, 0), outcome(REFUSED, 4), outcome(NO_GOLDEN, 3), outcome(REFUSED, 4)])
    assert line == f"1 of 4 cases passed, 1 {NO_GOLDEN}, 2 {REFUSED}"


def test_every_golden_in_the_tree_records_its_environment_and_label() -> None:
    found = sorted(CASES.glob("*/*/golden_values_*.json"))
    assert found
    for path in found:
        label, platform = selection.parse_name(path.name) or ("", "")
        env = golden.read_environment(path)
        assert env is not None, f"{path} records no environment"
        assert env.label() == label, path
        assert selection.kind_of(platform) == env.gpu, path
        assert platform_base(platform) == env.base, path


def platform_base(platform: str) -> str:
    from hfsdp.patchset.project import Project

    return platform.split("_mcore")[1].split("_")[0] if "_mcore" in platform else Project.default().pin().version


@pytest.mark.real_environment_probe
def test_run_case_cli_exit_status_names_the_verdict(tmp_path: Path, log: Path) -> None:
    """The command line: NO GOLDEN exits 3, with the verdict on the result line (real probe of this machine)."""
    case = _case(tmp_path / "cases", "cli")
    cmd = [sys.executable, "-m", "hfsdp.functional.run_case", str(case), "--output-dir", str(tmp_path / "out"),
           "--evaluate-log", str(log)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, check=False)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].endswith(f": {NO_GOLDEN}")
    recorded = subprocess.run([*cmd, "--record-missing"], capture_output=True, text=True, cwd=REPO_ROOT, check=False)
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    (name,) = [p.name for p in case.glob("golden_values_*.json")]
    assert json.loads((case / name).read_text())[environment.KEY]["torch"]


def test_the_goldens_table_in_the_docs_is_current() -> None:
    """docs/goldens.md carries the generated case x environment x GPU kind table; it must match the tree."""
    from hfsdp.functional import goldens_table

    page = REPO_ROOT / "docs" / "goldens.md"
    text = page.read_text(encoding="utf-8")
    fix = "run `python -m hfsdp.functional.goldens_table --write docs/goldens.md`"
    assert goldens_table.replaced(text, goldens_table.table(), page) == text, fix


def test_the_goldens_table_says_refused_and_lists_platforms(tmp_path: Path) -> None:
    from hfsdp.functional import goldens_table

    case = _case(tmp_path / "cases", "apex_case",
                 "ENVIRONMENT:\n  requires: [apex]\n  excludes: [transformer_engine]\n  why: x\n")
    recipe = load_recipe(case)
    golden.save(recipe.golden_path("apex", "dgx_h200_mcore0.19.2"), {"lm loss": {1: 1.0}}, ["lm loss"],
                _with(replace(ENV_A, base="0.19.2"), "apex", "NVIDIA Apex 0.1: amp_C"))
    rows = goldens_table.table(tmp_path / "cases").splitlines()
    assert rows[-1] == ("| hybrid/apex_case | refused: needs apex | refused: needs apex; excludes te | "
                        "refused: excludes te | h200 0.19.2 |")
    with pytest.raises(UserError, match="does not hold one"):
        goldens_table.replaced("no markers here", "x", tmp_path / "page.md")
