"""``pip install -e .`` into a Python that already has torch, Transformer Engine and NVIDIA Apex (the
NVIDIA PyTorch containers) leaves all three as they were: no reinstall, no upgrade, no downgrade.

A fresh venv (no system site-packages) plays the container: stand-in distributions with the
versions such containers carry (a pre-release torch with a local version, as NGC's builds have) are
installed first; newer stand-ins of the same names wait in the only package folder pip may use, so
that any upgrade would show. Then the documented command runs, ``pip install -e <checkout>``,
offline (``--no-index --find-links``). Its isolated build environment takes setuptools from a wheel
repacked from this interpreter's own setuptools, so the test needs no network.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import subprocess
import venv
import zipfile
from pathlib import Path

import pytest

from hfsdp.patchset.project import Project

PROJECT = Project.default()
# What the container has (name, version, one module of it): NGC-style versions.
CONTAINER = (("torch", "2.8.0a0+5228986c39.nv25.6", "torch"),
             ("transformer-engine", "2.5.0+f05f12c9", "transformer_engine"),
             ("apex", "0.1", "amp_C"),
             ("numpy", "1.26.4", "numpy"))
# Newer releases pip could take instead, were it to upgrade or reinstall.
BAIT = (("torch", "2.13.0", "torch"), ("transformer-engine", "2.20.2", "transformer_engine"),
        ("apex", "0.2", "amp_C"), ("numpy", "2.3.0", "numpy"), ("packaging", "26.0", "packaging"))
PROBE = """
import importlib.metadata as md, json, os
out = {}
for name in ("torch", "transformer-engine", "apex", "numpy", "packaging", "megatron-core"):
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        out[name] = None
        continue
    files = {}
    for f in dist.files or ():
        path = dist.locate_file(f)
        if path.is_file() and "__pycache__" not in str(f):
            st = os.stat(path)
            files[str(f)] = [st.st_ino, st.st_mtime_ns, st.st_size]
    out[name] = {"version": dist.version, "files": files}
print(json.dumps(out))
"""


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def write_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A pure-Python wheel of ``files`` (path in the wheel -> bytes) with its metadata and RECORD."""
    stem = f"{name.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    files = {**files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hfsdp-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [_record_line(arc, data) for arc, data in files.items()] + [f"{info}/RECORD,,"]
    path = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for arc, data in files.items():
            whl.writestr(arc, data)
        whl.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def stand_in(folder: Path, name: str, version: str, module: str) -> Path:
    return write_wheel(folder, name, version, {f"{module}/__init__.py": f"__version__ = {version!r}\n".encode()})


def repack_setuptools(folder: Path) -> Path:
    """This interpreter's setuptools as a wheel, for pip's isolated build environment (offline)."""
    dist = importlib.metadata.distribution("setuptools")
    files: dict[str, bytes] = {}
    for f in dist.files or ():
        path = Path(str(dist.locate_file(f)))
        arc = str(f)
        if arc.startswith("..") or "__pycache__" in arc or f.name in ("RECORD", "INSTALLER", "REQUESTED",
                                                                       "direct_url.json"):
            continue
        if path.is_file():
            files[arc] = path.read_bytes()
    return write_wheel(folder, "setuptools", dist.version, files)  # its METADATA and WHEEL written anew


def pip(py: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # pip's own settings only: no config file, no PIP_* of this machine (an extra index or find-links).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.run([str(py), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def probe(py: Path, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, cwd=cwd, env=env, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("packaging", ["24.2", "23.2"])
def test_pip_install_e_keeps_the_containers_torch_te_and_apex(tmp_path: Path, packaging: str) -> None:
    """Nothing of the container changes; only a ``packaging`` older than megatron-core 0.18.2's own
    requirement (>=24.2, which the fork keeps) is upgraded."""
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(tmp_path / "venv")
    py = tmp_path / "venv" / "bin" / "python"
    container, index = tmp_path / "container", tmp_path / "index"
    container.mkdir()
    index.mkdir()
    wheels = [stand_in(container, *dist) for dist in (*CONTAINER, ("packaging", packaging, "packaging"))]
    proc = pip(py, "install", "-q", "--no-index", "--no-deps", *map(str, wheels))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for dist in BAIT:
        stand_in(index, *dist)
    repack_setuptools(index)
    before = probe(py, tmp_path)
    assert {n: d["version"] for n, d in before.items() if d} == {**{n: v for n, v, _ in CONTAINER},
                                                                  "packaging": packaging}

    proc = pip(py, "install", "--no-index", "--find-links", str(index), "-e", str(PROJECT.root))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = probe(py, tmp_path)
    for name, version, _ in CONTAINER:
        assert after[name]["version"] == version, (name, after[name]["version"], proc.stdout[-2000:])
        assert after[name]["files"] == before[name]["files"], f"{name}'s files were rewritten: {proc.stdout[-2000:]}"
    assert after["megatron-core"]["version"] == PROJECT.pin().fork_version
    upgraded = after["packaging"]["version"] != packaging
    assert upgraded == (packaging == "23.2"), (packaging, after["packaging"]["version"])
    assert ("Uninstalling" in proc.stdout) == upgraded, proc.stdout
