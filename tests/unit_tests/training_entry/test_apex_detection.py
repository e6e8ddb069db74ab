"""NVIDIA Apex is recognised by the modules Megatron imports from it, not by the distribution name
``apex`` (PyPI's is an unrelated web toolkit), and the paths megatron-core 0.18.2 takes follow what
imports: Transformer Engine first, then Apex, then torch (hfsdp/training/requirements.py,
[Note: NVIDIA Apex]). Stand-in packages on sys.path play each installation."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hfsdp.training import requirements as R

APEX_ALL = set(R.APEX_MODULES)
TE = {R.TE_OPTIMIZERS}


def only(modules: set[str]):
    return lambda module: module in modules


@pytest.mark.parametrize(("importable", "expected"), [
    (set(), {"optimizer": "torch's", "multi_tensor": "Megatron's torch fallbacks", "fusion": "none, so"}),
    (APEX_ALL, {"optimizer": "Apex's FusedAdam", "multi_tensor": "Apex's amp_C",
                "fusion": "Apex's fused_weight_gradient_mlp_cuda"}),
    (TE, {"optimizer": "Transformer Engine's", "multi_tensor": "Transformer Engine's", "fusion": "none, so"}),
    (TE | APEX_ALL, {"optimizer": "Transformer Engine's", "multi_tensor": "Transformer Engine's",
                     "fusion": "Apex's fused_weight_gradient_mlp_cuda"}),
    # amp_C without apex.multi_tensor_apply is not enough for Megatron's multi-tensor path.
    ({"amp_C", "apex.optimizers"}, {"optimizer": "Apex's", "multi_tensor": "Megatron's torch fallbacks",
                                    "fusion": "none, so"}),
], ids=["nothing", "apex", "te", "te+apex", "apex-without-multi-tensor-apply"])
def test_megatron_paths_follow_the_import_order(importable: set[str], expected: dict[str, str]) -> None:
    paths = R.megatron_paths(only(importable))
    assert paths["optimizer"].startswith(expected["optimizer"]), paths
    assert paths["multi_tensor"].startswith(expected["multi_tensor"]), paths
    assert paths["gradient_accumulation_fusion"].startswith(f"local layers: {expected['fusion']}"), paths
    assert paths["gradient_accumulation_fusion"].endswith("Transformer Engine layers: their own"), paths
    # Megatron-FSDP's main grads take TE's general_gemm whenever TE imports, Apex's kernel otherwise.
    fsdp_te = "(Megatron-FSDP's weights: Transformer Engine's general_gemm)" in paths["gradient_accumulation_fusion"]
    assert fsdp_te == (expected["optimizer"].startswith("Transformer Engine") and expected["fusion"] != "none, so")


@pytest.mark.parametrize(("importable", "conv"), [
    (set(), "torch's nn.Conv1d"),
    ({"causal_conv1d"}, "causal-conv1d's causal_conv1d_fn"),
    (TE | APEX_ALL | {"causal_conv1d"}, "causal-conv1d's causal_conv1d_fn"),
])
def test_mamba_convolution_follows_causal_conv1d(importable: set[str], conv: str) -> None:
    """mamba_mixer.py calls causal-conv1d on its non-fused path too whenever it imports."""
    assert R.megatron_paths(only(importable))["mamba_conv"].startswith(conv)


@pytest.mark.parametrize(("importable", "norm"), [
    (set(), "torch's"),
    ({"apex"}, "Megatron's FusedLayerNorm, which refuses to build"),  # PyPI's apex
    ({"apex", "apex.normalization.fused_layer_norm"}, "Apex's FusedLayerNorm, whose kernel"),  # our wheel
    ({"apex", "apex.normalization.fused_layer_norm", "fused_layer_norm_cuda"}, "Apex's FusedLayerNorm;"),
])
def test_local_layer_norm_follows_import_apex(importable: set[str], norm: str) -> None:
    assert R.megatron_paths(only(importable))["layer_norm"].startswith(f"local LayerNorm layers: {norm}")


def test_apex_report_names_version_and_modules() -> None:
    line = R.apex_report(only(APEX_ALL), {"apex": "0.1"}.get)
    assert line == ("NVIDIA Apex 0.1: amp_C, apex.multi_tensor_apply, apex.optimizers, "
                    "fused_weight_gradient_mlp_cuda"), line
    partial = R.apex_report(only({"amp_C", "apex.multi_tensor_apply", "apex.optimizers"}), {"apex": "0.1"}.get)
    assert partial is not None and partial.endswith("; not importable: fused_weight_gradient_mlp_cuda"), partial
    assert "\n" not in line and "\n" not in partial


def test_no_apex_is_none() -> None:
    assert R.apex_report(only(set()), lambda dist: None) is None


def test_pypi_apex_is_one_sentence_with_the_way_out() -> None:
    line = R.apex_report(only(set()), {"apex": "0.9.10"}.get)
    assert line is not None and "\n" not in line
    cause, fix = line.split(" -> ")
    assert "a distribution named apex (0.9.10) is installed but amp_C is not importable" in cause, cause
    assert "not NVIDIA Apex" in cause, cause
    assert "`pip uninstall apex`" in fix and R.APEX_WHEEL_SCRIPT in fix, fix
    assert (Path(__file__).resolve().parents[3] / R.APEX_WHEEL_SCRIPT).is_file()


def test_python_only_apex_build_is_one_sentence() -> None:
    line = R.apex_report(only({"apex.optimizers", "apex.multi_tensor_apply"}), {"apex": "0.1"}.get)
    assert line is not None and line.startswith("NVIDIA Apex 0.1 is installed without its CUDA extensions"), line
    assert " -> install Apex's wheel" in line and "\n" not in line


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder first on sys.path for stand-in packages; every module they define is forgotten after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    importlib.invalidate_caches()


def dist_info(root: Path, name: str, version: str) -> None:
    write(root, {f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"})


def test_pypi_apex_on_sys_path(site: Path) -> None:
    """The web toolkit: a package ``apex`` with no optimizers and no amp_C, real import machinery."""
    for name in R.APEX_MODULES:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            pytest.skip(f"{name} is importable here")
    write(site, {"apex/__init__.py": "TOOLKIT = True\n"})
    dist_info(site, "apex", "0.9.10")
    line = R.apex_report()
    assert line is not None and line.startswith("a distribution named apex (0.9.10) is installed"), line
    assert R.installed_versions()["apex"] == line
    assert R.megatron_paths()["optimizer"].startswith("torch's"), R.megatron_paths()


def test_nvidia_apex_stand_in_on_sys_path(site: Path) -> None:
    """NVIDIA Apex's modules as stand-ins (no CUDA): recognised, and Megatron's paths become Apex's."""
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is importable here: its paths come first")
    write(site, {
        "apex/__init__.py": "",
        "apex/optimizers/__init__.py": "class FusedAdam: ...\nclass FusedSGD: ...\n",
        "apex/multi_tensor_apply/__init__.py": "multi_tensor_applier = object()\n",
        "amp_C.py": "def multi_tensor_scale(*a): ...\ndef multi_tensor_l2norm(*a): ...\n",
        "fused_weight_gradient_mlp_cuda.py": "",
    })
    dist_info(site, "apex", "0.1")
    assert R.apex_report() == f"NVIDIA Apex 0.1: {', '.join(R.APEX_MODULES)}"
    assert R.megatron_paths() == {
        "optimizer": "Apex's FusedAdam/FusedSGD",
        "multi_tensor": "Apex's amp_C with apex.multi_tensor_apply",
        "mamba_conv": "torch's nn.Conv1d (the fused path needs causal-conv1d)",
        "gradient_accumulation_fusion": "local layers: Apex's fused_weight_gradient_mlp_cuda; "
                                        "Transformer Engine layers: their own",
        "layer_norm": "local LayerNorm layers: Megatron's FusedLayerNorm, which refuses to build (this apex has no "
                      "apex.normalization); RMSNorm, Transformer Engine and the hybrid local specs' layers: not Apex's",
    }


@pytest.mark.no_cuda  # the run stops at "training needs CUDA GPUs", after the warning
def test_entry_point_warns_once_about_pypi_apex(tmp_path: Path) -> None:
    """pretrain_gpt.py with PyPI's apex first on the path: one warning line with the way out, then
    the run goes on (here: to the CPU machine's one error)."""
    from test_entry import TINY  # the tiny dense GPT every entry test uses

    write(tmp_path, {"apex/__init__.py": "TOOLKIT = True\n"})
    dist_info(tmp_path, "apex", "0.9.10")
    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k not in ("HFSDP_DEBUG", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(root)])
    proc = subprocess.run([sys.executable, str(root / "pretrain_gpt.py"), *TINY], env=env, cwd="/",
                          capture_output=True, text=True, timeout=300)
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("hfsdp: warning: ")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "a distribution named apex (0.9.10) is installed but amp_C is not importable" in warnings[0]
    assert proc.returncode == 2 and "pretrain_gpt.py: error: training needs CUDA GPUs" in proc.stderr, proc.stderr
