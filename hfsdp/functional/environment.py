"""The software and hardware a functional run's numbers depend on: ``python -m hfsdp.functional.environment``.

[Note: the environment of a golden]
The same recipe trains different bits in different environments, and most of the difference is
not in the case's own code: with Transformer Engine importable megatron-core takes TE's FusedAdam
and multi-tensor kernels even for local-spec models, NVIDIA Apex's where TE is absent; with
causal-conv1d importable Mamba's non-fused path calls its convolution kernel instead of
``nn.Conv1d``. So every golden records, under the one non-metric key ``environment``, what decided
its numbers, and a run is held only to a golden of an equal environment:

* ``gpu``: the GPU kind (``dgx_h200``; ``cpu`` without CUDA);
* ``torch``, ``cuda`` (torch's build), ``nccl``;
* ``base``: the megatron-core release the tree was built from;
* ``packages``: the version of each optional package Megatron can use (``transformer_engine``,
  ``causal_conv1d``, ``mamba_ssm``), None where it does not import; ``apex`` as NVIDIA Apex's
  modules (its distribution name alone does not tell NVIDIA Apex, [Note: NVIDIA Apex] in
  hfsdp/training/requirements.py);
* ``megatron_paths``: the kernels Megatron takes given those packages (optimizer, multi-tensor,
  gradient-accumulation fusion, layer norm, Mamba's convolution): what the run report records.

Every field counts: a difference in any of them is reported as one reason the golden does not
hold, and the verdict is "no golden for this environment", never a list of per-step mismatches.
Exact comparisons stay exact; an environment the goldens do not cover gets a golden of its own
(``--record``). The environment is probed in a fresh interpreter with the run's own environment
variables (``--env`` and the recipe's ``ENV_VARS`` included), so it is the one the training sees.

A golden's file name carries the environment's :meth:`Environment.label` in Megatron's
``environment`` slot (``golden_values_<label>_<platform>.json``): ``torch`` with none of the
optional packages that change a run's kernels, else their short names (``te-conv1d-apex``). The
label only names the file; the block inside decides.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hfsdp.atomic import json_text, loads_strict
from hfsdp.usererror import UserError

KEY = "environment"
# Optional packages recorded, in report order; (import name, short name for labels, label it?).
PACKAGES = ("transformer_engine", "causal_conv1d", "mamba_ssm", "apex")
LABEL_PARTS = (("transformer_engine", "te"), ("causal_conv1d", "conv1d"), ("apex", "apex"))
BASE_LABEL = "torch"
PACKAGE_NAMES = {"transformer_engine": "Transformer Engine", "causal_conv1d": "causal-conv1d",
                 "mamba_ssm": "mamba_ssm", "apex": "NVIDIA Apex"}
SCALARS = ("gpu", "base", "torch", "cuda", "nccl")
SCALAR_NAMES = {"gpu": "GPU", "base": "megatron-core base", "torch": "torch", "cuda": "CUDA", "nccl": "NCCL"}


@dataclass(frozen=True)
class Environment:
    """What decided a run's numbers (see the note); ``packages`` and ``megatron_paths`` as sorted pairs."""

    gpu: str
    base: str
    torch: str
    cuda: str | None
    nccl: str | None
    packages: tuple[tuple[str, str | None], ...]
    megatron_paths: tuple[tuple[str, str], ...]

    def package(self, name: str) -> str | None:
        return dict(self.packages).get(name)

    def label(self) -> str:
        """``torch``, or the short names of the optional packages present (``te-conv1d-apex``)."""
        parts = [short for name, short in LABEL_PARTS if self.package(name) is not None]
        return "-".join(parts) or BASE_LABEL

    def describe(self) -> str:
        """One phrase: ``torch 2.11.0+cu130, Transformer Engine 2.20.2, causal-conv1d 1.7.0, no NVIDIA Apex``."""
        present = [f"{PACKAGE_NAMES[n]} {v}" if n != "apex" else "NVIDIA Apex"
                   for n, v in self.packages if v is not None]
        absent = [PACKAGE_NAMES[n] for n, v in self.packages if v is None]
        text = ", ".join([f"{self.gpu}, megatron-core {self.base}, torch {self.torch}", *present])
        return text + (f"; without {', '.join(absent)}" if absent else "")

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "base": self.base, "torch": self.torch, "cuda": self.cuda, "nccl": self.nccl,
                "packages": dict(self.packages), "megatron_paths": dict(self.megatron_paths)}


def _text(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def problems(obj: Any) -> list[str]:
    """Why ``obj`` is not an environment block as :meth:`Environment.to_json` writes it (empty: it is)."""
    if not isinstance(obj, dict):
        return [f"'{KEY}' is a JSON {type(obj).__name__}, not an object"]
    out = []
    if unknown := sorted(set(obj) - {*SCALARS, "packages", "megatron_paths"}):
        out.append(f"'{KEY}' has unknown fields {unknown}")
    for name in SCALARS:
        value = obj.get(name)
        if not (_text(value) or (name in ("cuda", "nccl") and value is None)):
            out.append(f"'{KEY}.{name}' is {value!r}, not a version or name")
    packages = obj.get("packages")
    if not isinstance(packages, dict) or set(packages) != set(PACKAGES):
        out.append(f"'{KEY}.packages' must map exactly {list(PACKAGES)} to a version or null, got {packages!r}")
    elif bad := [n for n, v in packages.items() if not (v is None or _text(v))]:
        out.append(f"'{KEY}.packages' has {bad} that are neither a version nor null")
    paths = obj.get("megatron_paths")
    if not (isinstance(paths, dict) and paths and all(_text(k) and _text(v) for k, v in paths.items())):
        out.append(f"'{KEY}.megatron_paths' must map each path's name to a description, got {paths!r}")
    return out


def from_json(obj: Any) -> Environment:
    """An environment block back as an :class:`Environment`; ``ValueError`` names what is wrong."""
    if found := problems(obj):
        raise ValueError("; ".join(found))
    return Environment(gpu=obj["gpu"], base=obj["base"], torch=obj["torch"], cuda=obj["cuda"], nccl=obj["nccl"],
                       packages=tuple(sorted(obj["packages"].items())),
                       megatron_paths=tuple(sorted(obj["megatron_paths"].items())))


def _value(value: str | None) -> str:
    return "absent" if value is None else value


def differences(run: Environment, golden: Environment) -> list[str]:
    """Each field in which ``golden`` differs from ``run``, one short phrase each (empty: they are equal)."""
    out = []
    for name in SCALARS:
        mine, theirs = getattr(run, name), getattr(golden, name)
        if mine != theirs:
            out.append(f"{SCALAR_NAMES[name]} {_value(mine)} here, {_value(theirs)} there")
    for name in PACKAGES:
        mine, theirs = run.package(name), golden.package(name)
        if mine != theirs:
            if name == "apex" and mine is not None and theirs is not None:
                out.append(f"NVIDIA Apex's modules differ ({mine!r} here, {theirs!r} there)")
            else:
                out.append(f"{PACKAGE_NAMES[name]} {_value(mine)} here, {_value(theirs)} there")
    mine_paths, theirs_paths = dict(run.megatron_paths), dict(golden.megatron_paths)
    paths = [n for n in sorted(set(mine_paths) | set(theirs_paths)) if mine_paths.get(n) != theirs_paths.get(n)]
    if paths and any(run.package(n) != golden.package(n) for n in PACKAGES):
        out.append(f"so Megatron's {', '.join(paths)} path{'s differ' if len(paths) > 1 else ' differs'}")
    else:
        out.extend(f"Megatron's {name} path: {mine_paths.get(name, 'unrecorded')} here, "
                   f"{theirs_paths.get(name, 'unrecorded')} there" for name in paths)
    return out


DISTRIBUTIONS = {"transformer_engine": "transformer-engine", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}


def _version(module: str) -> str | None:
    """The version of an optional package Megatron can use here (its distribution's, as the run report
    records it), None where it does not import as Megatron needs it."""
    from hfsdp.training import requirements

    if module == "apex":
        report = requirements.apex_report()
        return report if report is not None and requirements.module_importable("amp_C") else None
    if module == "transformer_engine":
        if not requirements.module_importable(requirements.TE_OPTIMIZERS):
            return None
    elif not requirements.importable(module):
        return None
    try:
        return importlib.metadata.version(DISTRIBUTIONS[module])
    except importlib.metadata.PackageNotFoundError:
        found = getattr(importlib.import_module(module), "__version__", None)
        return str(found) if found else "unknown version"


def current() -> Environment:
    """This interpreter's environment (imports torch and every optional package Megatron would)."""
    import torch

    from hfsdp.functional.platform import base_version, gpu_kind
    from hfsdp.training import requirements

    nccl = None
    if torch.cuda.is_available():
        version = torch.cuda.nccl.version()
        nccl = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    return Environment(
        gpu=gpu_kind(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu",
        base=base_version(),
        torch=str(torch.__version__), cuda=torch.version.cuda, nccl=nccl,
        packages=tuple(sorted((name, _version(name)) for name in PACKAGES)),
        megatron_paths=tuple(sorted(requirements.megatron_paths().items())),
    )


PROBE_TIMEOUT_S = 300.0  # importing TE and initializing CUDA takes seconds; a hung import must not hang the driver


def probe(environ: Mapping[str, str] | None = None) -> Environment:
    """The environment a run launched with ``environ`` (default: ours) sees, from a fresh interpreter."""
    cmd = [sys.executable, "-m", "hfsdp.functional.environment"]
    try:
        done = subprocess.run(cmd, env=dict(os.environ if environ is None else environ), capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise UserError(f"probing the run's environment (`{' '.join(cmd)}`) took over {PROBE_TIMEOUT_S:.0f} s",
                        "run that command yourself to see which import hangs") from None
    last = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    try:
        return from_json(loads_strict(last[0])) if last else _probe_failed(cmd, done)
    except ValueError as exc:
        raise UserError(f"`{' '.join(cmd)}` printed no environment ({exc})",
                        "run it yourself; with HFSDP_DEBUG=1 it prints its traceback") from None


def _probe_failed(cmd: list[str], done: subprocess.CompletedProcess[str]) -> Environment:
    tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise UserError(f"probing the run's environment (`{' '.join(cmd)}`) failed with exit {done.returncode}: {tail}",
                    "run that command yourself to see the whole error (HFSDP_DEBUG=1 adds the traceback)")


if __name__ == "__main__":
    sys.stdout.write(json_text(current().to_json(), indent=None))
