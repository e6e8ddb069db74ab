"""Install the hfsdp fork of megatron-core (``pip install -e .``).

Before setuptools runs, ``megatron/`` is materialized from the pinned sdist, the overlay
(``patches/overlay/``) and ``patches/series`` (a no-op when its stamp is current; an error, with
the way out, when it has local edits). The sdist of this project carries ``patches/`` (MANIFEST.in),
so an unpacked sdist materializes the same way. The distribution is ``megatron-core`` with a PEP 440 local version
(``0.18.2+hfsdp.N``; ``HFSDP_BASE=0.19.2`` chooses that base: ``0.19.2+hfsdp.N``), so pip replaces an upstream
wheel instead of installing a second copy.
"""

import os
import sys
from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from hfsdp.extras import EXTRAS  # noqa: E402
from hfsdp.patchset.materialize import materialize  # noqa: E402
from hfsdp.patchset.project import Project  # noqa: E402
from hfsdp.usererror import UserError  # noqa: E402

PROJECT = Project(ROOT)  # the base is chosen in the try below: HFSDP_BASE ([Note: bases] in hfsdp/patchset/project.py)


def overlay_package_data() -> dict[str, list[str]]:
    """The overlay's files that are not Python modules, as package data of their packages (setuptools takes
    a package's .py files by itself, so every overlay module is in the wheel)."""
    data: dict[str, list[str]] = {}
    for path in PROJECT.overlay_files():
        if not path.endswith(".py"):
            folder, _, name = path.rpartition("/")
            data.setdefault(folder.replace("/", "."), []).append(name)
    return data


try:
    PROJECT = PROJECT.with_base(None)
    PIN = PROJECT.pin()
    if os.environ.get("HFSDP_SKIP_MATERIALIZE") != "1":
        materialize(PROJECT, log=lambda line: print(line, file=sys.stderr))
    PACKAGE_DATA = overlay_package_data()
except UserError as exc:  # a PatchsetError, or a bad environment variable (MEGATRON_PATCHSET_OFFLINE=maybe)
    sys.exit(f"\nhfsdp: cannot materialize megatron/: {exc.cause}\n  -> {exc.fix}\n")
PACKAGE_DATA.setdefault("megatron.core.datasets", []).append("helpers.cpp")

setup(
    name=PIN.distribution,
    version=PIN.fork_version,
    description=f"megatron-core {PIN.version} + hfsdp patches: hybrid (Mamba/attention/MoE) Megatron-FSDP "
                "double buffering",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_namespace_packages(
        include=["megatron.core", "megatron.core.*", "megatron.training", "megatron.training.*", "hfsdp", "hfsdp.*"]
    ),
    include_package_data=True,
    package_data=PACKAGE_DATA,
    install_requires=["torch>=2.6.0", "numpy", "packaging>=24.2"],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6", "pyyaml", "einops", "matplotlib",
                 "ruff>=0.17,<0.18", "mypy>=2.4,<3"],
        "bench": ["matplotlib"],
        # Optional Transformer Engine / Mamba kernels, pinned ([Note: optional extras], hfsdp/extras.py).
        **EXTRAS,
    },
    scripts=["scripts/patchset"],
)
