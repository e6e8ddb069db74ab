# hfsdp: build the C++ dataset helpers on first use (added by the datasets-helpers-lazy-build patch).
"""Compile ``helpers.cpp`` into the ``helpers_cpp`` extension next to it, on first use.

The PyPI sdist ships ``helpers.cpp`` but not the Makefile that upstream's ``compile_helpers``
runs, and an editable install of the fork compiles nothing at install time. So the extension
is built here, with the C++ compiler and pybind11 headers (the ``pybind11`` package, else the
copy bundled with torch). Builds are atomic (compile to a temporary file, then rename) and
serialized by a file lock, so ranks that race on a shared file system never load half a file.
"""

import fcntl
import importlib.machinery
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
SOURCE = _HERE / "helpers.cpp"
MODULE = "helpers_cpp"


def extension_path() -> Path:
    """Where the built extension goes (the suffix matches this interpreter)."""
    return _HERE / (MODULE + importlib.machinery.EXTENSION_SUFFIXES[0])


def _pybind11_include() -> str | None:
    try:
        import pybind11

        return pybind11.get_include()
    except ImportError:
        pass
    try:
        import torch.utils.cpp_extension as cpp_ext

        for folder in cpp_ext.include_paths():
            if (Path(folder) / "pybind11" / "pybind11.h").is_file():
                return folder
    except ImportError:
        pass
    return None


def compiler() -> str | None:
    """The C++ compiler to use ($CXX, else c++ or g++ on PATH), or None."""
    for candidate in (os.environ.get("CXX"), "c++", "g++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def build_command(output: Path) -> list[str]:
    """The compiler command line; raises RuntimeError naming what is missing."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++) to build megatron/core/datasets/helpers.cpp")
    pybind = _pybind11_include()
    if pybind is None:
        raise RuntimeError("pybind11 headers not found (pip install pybind11) to build helpers.cpp")
    python_include = sysconfig.get_paths()["include"]
    return [
        cxx, "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC", f"-I{pybind}", f"-I{python_include}",
        str(SOURCE), "-o", str(output),
    ]


def build_helpers(force: bool = False) -> Path:
    """Build the extension unless it is already there; return its path."""
    target = extension_path()
    lock_path = _HERE / ".helpers_cpp.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others wait, then reuse it
        if target.is_file() and not force:
            return target
        fd, tmp_name = tempfile.mkstemp(prefix=".helpers_cpp.", suffix=".so", dir=_HERE)
        os.close(fd)
        try:
            proc = subprocess.run(build_command(Path(tmp_name)), capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling helpers.cpp failed:\n{proc.stderr.strip()}")
            os.replace(tmp_name, target)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
    return target
