"""The name a machine's goldens go by: ``python -m hfsdp.functional.platform [KIND]``.

[Note: golden names per base]
A golden is ``golden_values_<label>_<platform>.json`` (golden.py, selection.py). ``<platform>`` is the GPU kind
(``dgx_h100``, ``dgx_h200``, ...; ``KIND`` forces one), and, when ``megatron/`` was built from a
base other than the project's default, ``_mcore<version>`` after it (``dgx_h200_mcore0.19.2``):
each base trains with its own release's code, so it is held to goldens it recorded, never to the
default base's. The base is read from the tree's stamp; an unstamped tree counts as the default.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hfsdp.patchset.project import Project
from hfsdp.patchset.stamp import read_stamp

GPU_KINDS = ("H100", "H200", "B200", "A100")


def gpu_kind(device_name: str) -> str:
    """``dgx_<kind>`` of a CUDA device name (``NVIDIA H200`` -> ``dgx_h200``)."""
    return next((f"dgx_{k.lower()}" for k in GPU_KINDS if k in device_name), "dgx_" + device_name.split()[-1].lower())


def base_version(root: Path | None = None) -> str:
    """The megatron-core release ``root``'s ``megatron/`` was built from (an unstamped tree: the default base)."""
    root = root or Project.default().root
    stamp = read_stamp(root)
    return stamp.base_version if stamp is not None else Project(root).pin().version


def base_suffix(root: Path) -> str:
    """``_mcore<version>`` when ``root``'s ``megatron/`` was built from a base other than the default, else ''."""
    version = base_version(root)
    return "" if version == Project(root).pin().version else f"_mcore{version}"


def platform(kind: str | None = None, root: Path | None = None) -> str:
    """The golden name of this machine (``kind`` forces the GPU kind) and of ``root``'s tree."""
    if kind is None:
        import torch

        kind = gpu_kind(torch.cuda.get_device_name())
    return kind + base_suffix(root or Project.default().root)


if __name__ == "__main__":
    print(platform(sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else None))
