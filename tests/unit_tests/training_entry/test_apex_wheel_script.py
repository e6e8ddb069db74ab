"""tests/gpu/build_apex_wheel.sh on a CPU machine: its arguments, its pin, the commit of the source it
is given, the environment it builds under, and the wheel it makes from a stand-in Apex source (a fake
setup.py whose extensions compile nothing, and a fake nvcc). The real build needs nvcc and a GPU set-up."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SCRIPT = REPO_ROOT / "tests/gpu/build_apex_wheel.sh"
# Every extension Apex's setup.py defines with APEX_CUDA_EXT=1 that Megatron does not import stands in here.
FAKE_SETUP = """
import os
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class FakeBuild(build_ext):
    def build_extension(self, ext):
        path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()
        with open(os.environ["FAKE_LOG"], "a") as log:
            log.write(ext.name + " " + " ".join(f"{k}={os.environ.get(k)}" for k in (
                "TORCH_CUDA_ARCH_LIST", "APEX_CUDA_EXT", "APEX_CPP_EXT", "APEX_PARALLEL_BUILD")) + "\\n")


setup(name="apex", version="0.1", packages=["apex", "apex.optimizers", "apex.multi_tensor_apply"],
      ext_modules=[Extension(n, sources=["x.c"]) for n in
                   ("amp_C", "syncbn", "fused_layer_norm_cuda", "fused_weight_gradient_mlp_cuda", "mlp_cuda")],
      cmdclass={"build_ext": FakeBuild})
"""


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("APEX_")}
    base["PYTHON"] = sys.executable
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO_ROOT, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def one_error(proc: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    cause, fix = proc.stderr.strip().splitlines()
    assert cause.startswith("build_apex_wheel: ") and fix.startswith("  -> "), proc.stderr
    return cause, fix


def pin() -> str:
    (line,) = [x for x in SCRIPT.read_text().splitlines() if x.startswith("APEX_PIN=")]
    return line.removeprefix("APEX_PIN=")


def test_pin_is_a_whole_commit_and_the_header_records_the_measured_build() -> None:
    assert re.fullmatch(r"[0-9a-f]{40}", pin())
    header = SCRIPT.read_text().split("\nset -euo pipefail")[0]
    assert re.search(r"# Measured: \d+ s, a [0-9.]+ MB wheel \(\d{4}-\d\d-\d\d;", header), header
    assert "TORCH_CUDA_ARCH_LIST=9.0" in header and "APEX_CUDA_EXT=1" in header


@pytest.mark.parametrize(("args", "env", "says"), [
    (["--bogus"], {}, "unknown argument '--bogus'"),
    (["--jobs"], {}, "--jobs needs a value"),
    (["--jobs", "0"], {}, "--jobs must be a positive whole number, got '0'"),
    (["--src", "/nonexistent/apex.tar.gz"], {}, "--src /nonexistent/apex.tar.gz does not exist"),
    (["--dry-run"], {"APEX_COMMIT": "master"}, "APEX_COMMIT must be a commit's 40 lower-case hex digits"),
])
def test_bad_input_is_one_sentence(args: list[str], env: dict[str, str], says: str) -> None:
    cause, _ = one_error(run(*args, env=env))
    assert says in cause, cause


def test_dry_run_prints_the_pin_and_the_build_settings(tmp_path: Path) -> None:
    proc = run("--dry-run", "--out", str(tmp_path / "w"), env={"MAX_JOBS": "3"})
    assert proc.returncode == 0, proc.stderr
    assert f"Apex {pin()} from https://codeload.github.com/NVIDIA/apex/tar.gz/{pin()}" in proc.stdout
    for setting in ("extensions amp_C fused_weight_gradient_mlp_cuda;", "TORCH_CUDA_ARCH_LIST=9.0",
                    "APEX_CUDA_EXT=1", "APEX_PARALLEL_BUILD=2", "MAX_JOBS=3", "NVCC_APPEND_FLAGS='--threads 2'"):
        assert setting in proc.stdout, proc.stdout
    assert "dry run, nothing built" in proc.stdout and not (tmp_path / "w").exists()
    with_norm = run("--dry-run", "--layer-norm")
    assert "extensions amp_C fused_weight_gradient_mlp_cuda fused_layer_norm_cuda;" in with_norm.stdout


def tarball(path: Path, commit: str | None) -> Path:
    """A source archive as git archive writes it: the commit id in the pax global header."""
    headers = {"comment": commit} if commit else {}
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT, pax_headers=headers) as tar:
        data = b"print('apex')\n"
        info = tarfile.TarInfo("apex-x/setup.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_a_tarball_of_another_commit_is_refused(tmp_path: Path) -> None:
    ok = run("--dry-run", "--src", str(tarball(tmp_path / "ok.tar.gz", pin())))
    assert ok.returncode == 0, ok.stderr
    cause, fix = one_error(run("--dry-run", "--src", str(tarball(tmp_path / "old.tar.gz", "1" * 40))))
    assert f"is at {'1' * 40}, not at APEX_COMMIT {pin()}" in cause, cause
    assert "set APEX_COMMIT" in fix, fix
    cause, _ = one_error(run("--dry-run", "--src", str(tarball(tmp_path / "bare.tar.gz", None))))
    assert "is at unknown (no commit in its header)" in cause, cause


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_builds_only_megatrons_extensions_into_a_wheel(tmp_path: Path) -> None:
    """A stand-in Apex checkout and nvcc: the script runs Apex's setup.py with only amp_C and
    fused_weight_gradient_mlp_cuda, under its settings, and checks the wheel it made."""
    src = tmp_path / "apex"
    for rel in ("apex/__init__.py", "apex/optimizers/__init__.py", "apex/optimizers/fused_adam.py",
                "apex/multi_tensor_apply/__init__.py"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("")
    (src / "setup.py").write_text(FAKE_SETUP)
    git(src, "init", "-q")
    git(src, "add", ".")
    git(src, "commit", "-q", "-m", "stand-in apex")
    commit = git(src, "rev-parse", "HEAD")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "nvcc").chmod(0o755)
    log = tmp_path / "log.txt"
    proc = run("--src", str(src), "--out", str(tmp_path / "wheels"), "--jobs", "3",
               env={"APEX_COMMIT": commit, "FAKE_LOG": str(log), "APEX_CPP_EXT": "1",
                    "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(log.read_text().splitlines()) == [
        f"{name} TORCH_CUDA_ARCH_LIST=9.0 APEX_CUDA_EXT=1 APEX_CPP_EXT=None APEX_PARALLEL_BUILD=3"
        for name in ("amp_C", "fused_weight_gradient_mlp_cuda")]
    (whl,) = (tmp_path / "wheels").glob("apex-0.1-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert {n.split(".")[0] for n in names if n.endswith(".so")} == {"amp_C", "fused_weight_gradient_mlp_cuda"}
    assert f"built {whl}" in proc.stdout, proc.stdout
    assert not (src / "build").exists(), "the build ran in the given checkout, not in a copy"
