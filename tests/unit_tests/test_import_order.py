"""Megatron-FSDP runs with Megatron Core, whatever is imported first.

``param_and_grad_buffer``, ``megatron_fsdp`` and ``fully_shard`` each try Megatron Core's
``DistributedDataParallelConfig`` and fall back to Megatron-FSDP's own (its standalone mode) on
``ImportError``; ``param_and_grad_buffer`` then also takes its own, never seeded, CUDA RNG
tracker and sets ``HAVE_MCORE = False``. A partly initialized module raises that ImportError
too, so an import cycle through a hook can put the fork in standalone mode without a word. Each
entry below starts a fresh interpreter, imports one way in, and reads what the three modules
bound; the pinned release, unpatched, is held to the same where it has that entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp"
CORE_CONFIG = "megatron.core.distributed.distributed_data_parallel_config"
CORE_RNG = "megatron.core.tensor_parallel.random"

# What each way in runs first: a statement, with the release's modules only or the fork's too.
RELEASE_ENTRIES = {
    "megatron.core": "import megatron.core",
    "megatron.training": "import megatron.training",
    "megatron.training.arguments": "import megatron.training.arguments",
    "core config module": f"import {CORE_CONFIG}",
    "megatron_fsdp package": f"import {FSDP}",
    "fully_shard": f"from {FSDP} import fully_shard",
    "mcore_fsdp_adapter": "import megatron.core.distributed.fsdp.mcore_fsdp_adapter",
}
FORK_ENTRIES = {
    "pretrain_gpt.py": "import runpy; runpy.run_path('pretrain_gpt.py', run_name='probe')",
    "pretrain_hybrid.py": "import runpy; runpy.run_path('pretrain_hybrid.py', run_name='probe')",
    "hfsdp.training.entry": "import hfsdp.training.entry",
    "memory planner": "import runpy; runpy.run_path('scripts/fsdp_memory_planner.py', run_name='probe')",
    "double_buffer package": f"import {FSDP}.double_buffer",
}

# Run after the entry: what the three modules bound, as one JSON line.
PROBE = f"""
import importlib, json
seen = {{}}
for name in ("param_and_grad_buffer", "megatron_fsdp", "fully_shard"):
    module = importlib.import_module("{FSDP}." + name)
    seen[name] = {{"config": module.DistributedDataParallelConfig.__module__,
                  "have_mcore": getattr(module, "HAVE_MCORE", None),
                  "rng": getattr(getattr(module, "get_cuda_rng_tracker", None), "__module__", None)}}
print("PROBE " + json.dumps(seen))
"""


def start(entry: str, tree: Path) -> subprocess.Popen[str]:
    """A fresh interpreter that runs ``entry``, then PROBE, with ``tree`` first on the path (and as
    the folder, for the entry scripts)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen([sys.executable, "-W", "ignore", "-c", entry + "\n" + PROBE], cwd=tree,
                            env={**env, "PYTHONPATH": str(tree)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def bound(proc: subprocess.Popen[str]) -> dict[str, dict[str, object]]:
    """What the three modules bound, as PROBE printed it."""
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE "))


WITH_MCORE = {
    "param_and_grad_buffer": {"config": CORE_CONFIG, "have_mcore": True, "rng": CORE_RNG},
    "megatron_fsdp": {"config": CORE_CONFIG, "have_mcore": None, "rng": None},
    "fully_shard": {"config": CORE_CONFIG, "have_mcore": None, "rng": None},
}
PRISTINE_ENTRIES = ("megatron.core", "megatron.training")


@pytest.fixture(scope="module")
def probes(pristine_megatron: Path) -> Iterator[dict[tuple[str, str], subprocess.Popen[str]]]:
    """(tree, entry) -> its probe, all started at once: each spends seconds importing torch."""
    started = {("fork", name): start(entry, REPO_ROOT) for name, entry in {**RELEASE_ENTRIES, **FORK_ENTRIES}.items()}
    started.update({("release", name): start(RELEASE_ENTRIES[name], pristine_megatron) for name in PRISTINE_ENTRIES})
    yield started
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("entry", [*RELEASE_ENTRIES, *FORK_ENTRIES])
def test_the_fork_binds_megatron_core_whatever_comes_first(
        entry: str, probes: dict[tuple[str, str], subprocess.Popen[str]]) -> None:
    assert bound(probes["fork", entry]) == WITH_MCORE


@pytest.mark.parametrize("entry", PRISTINE_ENTRIES)
def test_the_release_binds_megatron_core_too(entry: str, probes: dict[tuple[str, str], subprocess.Popen[str]]) -> None:
    """The expectation above is the release's own behaviour, not a wish."""
    assert bound(probes["release", entry]) == WITH_MCORE
