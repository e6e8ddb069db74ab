"""Optional packages the flags need (hfsdp/training/requirements.py), and the entry point's error
when one is missing. Flags are parsed by Megatron's own parser, so a wrong dest shows here."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

import pytest

from hfsdp.training import requirements as R

REPO_ROOT = Path(__file__).resolve().parents[3]
HYBRID = ["--hybrid-layer-pattern", "M*-"]


@pytest.fixture(scope="module")
def parse():
    from hfsdp.training.entry import megatron_parser

    parser = megatron_parser()

    def run(flags: list[str], fusion: bool = False) -> Namespace:
        """Megatron's defaults but gradient-accumulation fusion, unless ``fusion`` (the tests below say why)."""
        args, unknown = parser.parse_known_args(flags if fusion else [*flags, "--no-gradient-accumulation-fusion"])
        assert not unknown, unknown
        return args

    return run


def packages(args: Namespace) -> list[str]:
    return [n.package for n in R.needs(args)]


@pytest.mark.parametrize("flags, expected", [
    (["--transformer-impl", "local"], []),
    ([], ["transformer_engine"]),  # Megatron's default impl is TE
    (["--transformer-impl", "local", "--fp8-format", "hybrid"], ["transformer_engine"]),
    (["--transformer-impl", "local", "--fp4-format", "e2m1"], ["transformer_engine"]),
    (["--transformer-impl", "local", "--tp-comm-overlap"], ["transformer_engine"]),
    (["--transformer-impl", "local", "--moe-permute-fusion"], ["transformer_engine"]),
    (["--transformer-impl", "local", "--moe-router-fusion"], ["transformer_engine"]),
    (["--transformer-impl", "local", "--cuda-graph-impl", "transformer_engine"], ["transformer_engine"]),
    (["--transformer-impl", "local", "--cuda-graph-impl", "full_iteration"], []),
    (["--transformer-impl", "local", "--position-embedding-type", "rope"], ["transformer_engine"]),
    (["--transformer-impl", "local", "--position-embedding-type", "rope", "--no-rope-fusion"], []),
    (["--transformer-impl", "local", *HYBRID], ["mamba_ssm", "causal_conv1d"]),
    (["--transformer-impl", "local", *HYBRID, "--disable-mamba-mem-eff-path"], ["mamba_ssm"]),
    (["--transformer-impl", "local", "--hybrid-layer-pattern", "*-E"], []),
    (HYBRID, ["transformer_engine", "mamba_ssm", "causal_conv1d"]),
])
def test_what_the_flags_need(parse, flags: list[str], expected: list[str]) -> None:
    assert packages(parse(flags)) == expected


def test_te_need_names_every_te_flag_and_every_way_out(parse) -> None:
    need, = R.needs(parse(["--num-experts", "4", "--moe-grouped-gemm", "--fp8-format", "e4m3",
                           "--position-embedding-type", "rope"]))
    for flag in ("--transformer-impl transformer_engine", "--moe-grouped-gemm", "--fp8-format e4m3",
                 "--position-embedding-type rope"):
        assert flag in need.why, need.why
    for way in ("pass --transformer-impl local", "drop --moe-grouped-gemm", "drop --fp8-format",
                "pass --no-rope-fusion"):
        assert way in need.avoid, need.avoid
    # Without experts the grouped-GEMM flag does nothing and is not reported.
    assert "--moe-grouped-gemm" not in R.needs(parse(["--moe-grouped-gemm"]))[0].why


def test_gradient_accumulation_fusion_needs_apexs_kernel(parse) -> None:
    """On by default in Megatron; every model's local linear layers (the output layer at least) refuse it without
    NVIDIA Apex's fused_weight_gradient_mlp_cuda, late: the check says so before any GPU work."""
    args = parse(["--transformer-impl", "local"], fusion=True)
    assert packages(args) == ["fused_weight_gradient_mlp_cuda"]
    R.check(args, lambda p: True, torch_cuda=lambda: "13.0")
    with pytest.raises(R.MissingPackage) as err:
        R.check(args, lambda p: p != "fused_weight_gradient_mlp_cuda", torch_cuda=lambda: "13.0")
    assert err.value.cause == ("--gradient-accumulation-fusion (Megatron's default: the local linear layers) needs "
                               "NVIDIA Apex's wgrad kernel (fused_weight_gradient_mlp_cuda), which is not importable "
                               "here"), err.value.cause
    assert err.value.fix.startswith("pass --no-gradient-accumulation-fusion; or install NVIDIA Apex built with it ("
                                    "tests/gpu/build_apex_wheel.sh"), err.value.fix


ALL = ("transformer_engine", "mamba_ssm", "causal_conv1d")


@pytest.mark.parametrize("present", [set(c) for n in range(4) for c in itertools.combinations(ALL, n)],
                         ids=lambda s: "+".join(sorted(s)) or "none")
def test_each_missing_combination_is_reported_with_its_extra(parse, monkeypatch, present: set[str]) -> None:
    monkeypatch.setattr(R, "_dist_version", lambda dist: None)  # no TE core wheel to compare
    args = parse(HYBRID)  # TE specs, Mamba layers, fused Mamba path: needs all three
    lacking = [p for p in ALL if p not in present]
    assert [n.package for n in R.missing(args, lambda p: p in present)] == lacking
    if not lacking:
        R.check(args, lambda p: p in present, torch_cuda=lambda: "13.0")
        return
    with pytest.raises(R.MissingPackage) as err:
        R.check(args, lambda p: p in present, torch_cuda=lambda: "13.0")
    cause, fix = err.value.cause, err.value.fix
    for package in ALL:
        assert (f"({package}), which is not importable" in cause) == (package in lacking), cause
    if "transformer_engine" in lacking:
        assert ".[te]" in fix and "--transformer-impl local" in fix, fix
    if {"mamba_ssm", "causal_conv1d"} & set(lacking):
        assert ".[ssm]" in fix, fix
    if "causal_conv1d" in lacking:
        assert "--disable-mamba-mem-eff-path" in fix, fix
    if "mamba_ssm" in lacking:
        assert "without 'M'" in fix, fix


def test_missing_te_with_a_cuda12_torch_names_the_cu12_extra(parse) -> None:
    need, = R.needs(parse([]))
    fix = R.missing_error(need, "12.8").fix
    assert ".[te-cu12]" in fix and "core-cu12" in fix, fix
    assert ".[te]" in R.missing_error(need, "13.0").fix


@pytest.mark.parametrize("torch_cuda, cores, wrong, extra", [
    ("13.0", {"transformer-engine-cu12": "2.20.2"}, "transformer-engine-cu12", "te"),
    ("13.0", {"transformer-engine-cu12": "2.20.2", "transformer-engine-cu13": "2.20.2"},
     "transformer-engine-cu12", "te"),
    ("12.8", {"transformer-engine-cu12": "2.20.2", "transformer-engine-cu13": "2.20.2"},
     "transformer-engine-cu13", "te-cu12"),
])
def test_te_core_for_the_wrong_cuda_is_named(torch_cuda: str, cores: dict[str, str], wrong: str,
                                             extra: str) -> None:
    problem = R.te_variant_problem(torch_cuda, cores.get)
    assert problem is not None
    assert f"{wrong} 2.20.2 is installed" in problem.cause and f"CUDA {torch_cuda}" in problem.cause
    assert f"pip uninstall -y {wrong}`" in problem.fix and f".[{extra}]" in problem.fix, problem.fix


@pytest.mark.parametrize("torch_cuda, cores", [
    ("13.0", {"transformer-engine-cu13": "2.20.2"}),
    ("12.4", {"transformer-engine-cu12": "2.20.2"}),
    (None, {"transformer-engine-cu12": "2.20.2"}),  # CPU torch: nothing to compare
    ("13.0", {}),  # TE built from source: no core wheel
])
def test_matching_or_unknown_te_core_is_fine(torch_cuda: str | None, cores: dict[str, str]) -> None:
    assert R.te_variant_problem(torch_cuda, cores.get) is None


def test_check_reports_the_wrong_te_core_when_te_is_present(parse, monkeypatch) -> None:
    monkeypatch.setattr(R, "_dist_version", {"transformer-engine-cu12": "2.20.2"}.get)
    with pytest.raises(R.MissingPackage, match="transformer-engine-cu12 2.20.2 is installed"):
        R.check(parse(["--transformer-impl", "transformer_engine"]), lambda p: True, torch_cuda=lambda: "13.0")
    R.check(parse(["--transformer-impl", "local"]), lambda p: True, torch_cuda=lambda: "13.0")


def test_importable_follows_how_megatron_imports(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", None)
    assert not R.importable("causal_conv1d") and not R.importable("mamba_ssm")
    # TE counts only with its torch extension (an empty meta package is not usable).
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    monkeypatch.delitem(sys.modules, "transformer_engine_torch", raising=False)
    assert not R.importable("transformer_engine")
    (tmp_path / "transformer_engine_torch.py").write_text("")
    assert R.importable("transformer_engine")


@pytest.mark.parametrize("where", ["wheel_lib", "package", "top-level"])
def test_te_torch_extension_found_where_te_loads_it(monkeypatch, tmp_path: Path, where: str) -> None:
    """TE 2.x wheels ship the torch extension as a shared object inside the package
    (transformer_engine/wheel_lib/), not importable by name until transformer_engine.pytorch
    loads it: such an install is usable, and an extension for nothing else does not count."""
    package = tmp_path / "transformer_engine"
    (package / "wheel_lib").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    monkeypatch.delitem(sys.modules, "transformer_engine_torch", raising=False)
    (package / "wheel_lib" / "transformer_engine_jax.cpython-312-x86_64-linux-gnu.so").write_text("")
    assert not R.importable("transformer_engine")
    folder = {"wheel_lib": package / "wheel_lib", "package": package, "top-level": tmp_path}[where]
    (folder / "transformer_engine_torch.cpython-312-x86_64-linux-gnu.so").write_text("")
    assert R.importable("transformer_engine")



def test_a_package_that_breaks_on_import_is_not_importable(monkeypatch, tmp_path: Path) -> None:
    """A kernel package built for another torch can raise anything at import, not only ImportError."""
    (tmp_path / "causal_conv1d").mkdir()
    (tmp_path / "causal_conv1d" / "__init__.py").write_text(
        "raise RuntimeError('compiled for another torch')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "causal_conv1d", raising=False)
    assert not R.importable("causal_conv1d")

# ---- through the real entry point (pretrain_*.py), the package faked missing -----------------

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128"]


def run_entry(script: str, argv: list[str], hidden: list[str]) -> subprocess.CompletedProcess:
    """Run ``script`` as ``python script argv`` with the ``hidden`` modules made unimportable."""
    code = textwrap.dedent(f"""
        import runpy, sys
        for name in {hidden!r}:
            sys.modules[name] = None  # import fails, find_spec finds nothing
        sys.argv = [{script!r}, *{argv!r}]
        runpy.run_path({str(REPO_ROOT / script)!r}, run_name="__main__")
    """)
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("HFSDP_DEBUG", None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)


def assert_one_error(proc: subprocess.CompletedProcess, prog: str) -> tuple[str, str]:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith((f"{prog}: error:", "  -> "))]
    assert len(lines) == 2, proc.stderr[-3000:]
    return lines[0], lines[1]


def test_entry_point_without_transformer_engine() -> None:
    proc = run_entry("pretrain_gpt.py", TINY, ["transformer_engine", "transformer_engine_torch"])
    cause, fix = assert_one_error(proc, "pretrain_gpt.py")
    assert "--transformer-impl transformer_engine needs Transformer Engine" in cause, cause
    assert "`pip install --no-build-isolation -e '.[te" in fix, fix
    assert "or pass --transformer-impl local" in fix, fix


def test_entry_point_with_gradient_accumulation_fusion_and_no_apex() -> None:
    proc = run_entry("pretrain_gpt.py", [*TINY, "--transformer-impl", "local"], ["fused_weight_gradient_mlp_cuda"])
    cause, fix = assert_one_error(proc, "pretrain_gpt.py")
    assert "--gradient-accumulation-fusion (Megatron's default: the local linear layers) needs NVIDIA Apex" in cause
    assert "pass --no-gradient-accumulation-fusion" in fix, fix


def test_entry_point_without_the_mamba_kernels() -> None:
    argv = [*TINY, "--transformer-impl", "local", "--hybrid-layer-pattern", "M*"]
    proc = run_entry("pretrain_hybrid.py", argv, ["mamba_ssm", "causal_conv1d"])
    cause, fix = assert_one_error(proc, "pretrain_hybrid.py")
    assert "Mamba layers ('M' in --hybrid-layer-pattern) needs mamba-ssm (mamba_ssm)" in cause, cause
    assert "Mamba's fused path" in cause and "causal-conv1d (causal_conv1d)" in cause, cause
    assert fix.count("-e '.[ssm]'") == 2 and "pass --disable-mamba-mem-eff-path" in fix, fix


def test_installed_versions_names_every_recorded_dist(monkeypatch):
    monkeypatch.setattr(R, "apex_report", lambda: None)
    monkeypatch.setattr(R, "_dist_version", {"transformer-engine": "2.20.2", "mamba-ssm": "2.3.2.post1"}.get)
    assert R.installed_versions() == {"transformer-engine": "2.20.2", "apex": None,
                                      "mamba-ssm": "2.3.2.post1", "causal-conv1d": None}
