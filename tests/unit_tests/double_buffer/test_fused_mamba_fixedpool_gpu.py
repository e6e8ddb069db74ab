"""GPU scenario: upstream's asymmetric attention + Mamba pair on Mamba's fused path (2 ranks).

Upstream saw its CUDA illegal memory access in this configuration: the double buffer's
FixedPool sends the Mamba unit (an outlier) to its backup allocator, whose ``free()`` in 0.18.2
drops the bucket while tensors autograd saved in forward still alias it ("dropped bucket" in
[Note: double buffer], failure modes); the fused path (``mamba_split_conv1d_scan_combined`` with
causal-conv1d's kernels) keeps such aliases. The local-spec, non-fused run of test (g) in
test_maxpool_hybrid_gpu.py did not reproduce it. Each variant runs UPSTREAM_CASE (1 attention +
1 Mamba unit, DP=2, 5 steps x 4 micro-batches) with ``--fused`` in its own torchrun and writes
``$OUT/fused_mamba_<spec>_<variant>.json``:

* ``maxpool``: the fork's max-pool; must train all steps with finite losses;
* ``fixedpool-fork``: FixedPool with the fork's backup (keeps the bucket); must do the same;
* ``fixedpool-0.18.2-backup``: FixedPool with 0.18.2's backup swapped back in, the rest of the
  fork unchanged; it must hit upstream's illegal memory access (``REPRODUCES``);
* ``unpatched-0.18.2`` (TE spec only): FixedPool in an unpatched 0.18.2 tree extracted from the
  pinned sdist (PYTHONPATH puts it first); it must hit the same.

Both 0.18.2 variants crashed with "an illegal memory access was encountered" on both specs, and
the fork's two allocators trained every step (2 ranks on one H100; docs/results.md), so this is a
regression test both ways: the fork must train, and 0.18.2 must still crash, or the scenario no
longer shows what it is meant to show.

Specs: the fork's local spec and upstream's TE spec (skipped without Transformer Engine). With
DP=1 Megatron-FSDP never gathers, so nothing here can happen with one rank: the tests skip.
Run: ``. tests/gpu/setup_gpu_env.sh && bash tests/gpu/run_fused_mamba_fixedpool.sh`` (2 ranks, on 2
GPUs or sharing 1).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import maxpool_gpu_harness as base  # the model, the runs and the child runner
import pytest
from pristine_release import extract_pristine

from hfsdp.training.requirements import importable

OUT = os.environ.get("OUT") or "/tmp"
needs_conv1d = pytest.mark.skipif(not importable("causal_conv1d"),
                                  reason="causal_conv1d not importable (Mamba's fused path)")
needs_te = pytest.mark.skipif(not importable("transformer_engine"), reason="Transformer Engine not importable")
VARIANTS = {"maxpool": ["--maxpool"], "fixedpool-fork": [], "fixedpool-0.18.2-backup": ["--emulate-0182"]}
MUST_TRAIN = ("maxpool", "fixedpool-fork")  # the fork's own allocators
REPRODUCES = "an illegal memory access was encountered"  # what 0.18.2's backup allocator ends in


def check_trained(rec: dict[str, Any]) -> None:
    """Both ranks trained every step with finite losses (the fork's allocators must)."""
    tail = rec.get("output_tail", "")[-2000:]
    assert rec["returncode"] == 0 and rec["verdict"] == "ok", (
        f"{rec['variant']}: rc={rec['returncode']}, crash lines {rec['crash_lines']}:\n{tail}")
    steps = base.UPSTREAM_CASE.steps * base.UPSTREAM_CASE.num_microbatches
    for name, r in rec["ranks"].items():
        assert r.get("steps_done") == base.UPSTREAM_CASE.steps and r["finite"], (name, r.get("error"))
        assert len(r["losses"]) == steps and r["mem_eff_path"], (name, r)


def check_crashed(rec: dict[str, Any]) -> None:
    """0.18.2's allocator: every rank stopped on upstream's illegal memory access."""
    errors = {name: str(r.get("error")) for name, r in rec["ranks"].items()}
    assert rec["verdict"] == "failed" and all(REPRODUCES in e for e in errors.values()), (
        f"{rec['variant']}: expected {REPRODUCES!r} on every rank, got verdict {rec['verdict']}, errors {errors}")


def check_recorded(rec: dict[str, Any]) -> None:
    """Whatever happened was recorded: both ranks' records, and no hang."""
    tail = rec.get("output_tail", "")[-2000:]
    assert rec["returncode"] != "timeout", f"{rec['variant']} hung past {base.FIXEDPOOL_TIMEOUT_S} s:\n{tail}"
    assert sorted(rec["ranks"]) == ["rank0.json", "rank1.json"], f"rank records {sorted(rec['ranks'])}:\n{tail}"


@pytest.mark.gpu
@base.needs_gpu_ranks
@needs_conv1d
@pytest.mark.parametrize("spec", ["local", pytest.param("te", marks=needs_te)])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.usefixtures("dist_env")
def test_fused_mamba(spec: str, variant: str) -> None:
    name = f"fused_mamba_{spec}_{variant}"
    args = ["--fused", *(["--te"] if spec == "te" else []), *VARIANTS[variant]]
    rec = base.run_repro_child(name, args, os.path.join(OUT, f"{name}.json"))
    base.record_result(name, rec)
    check_recorded(rec)
    if variant in MUST_TRAIN:
        check_trained(rec)
    else:
        check_crashed(rec)


@pytest.mark.gpu
@base.needs_gpu_ranks
@needs_conv1d
@needs_te
@pytest.mark.usefixtures("dist_env")
def test_fused_mamba_on_unpatched_0182() -> None:
    name = "fused_mamba_te_unpatched-0.18.2"
    with tempfile.TemporaryDirectory(prefix="hfsdp-0182-") as tmp:
        tree = extract_pristine(Path(tmp)) if base.dist.get_rank() == 0 else Path(tmp)
        path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
        rec = base.run_repro_child(name, ["--fused", "--te"], os.path.join(OUT, f"{name}.json"),
                                   env_extra={"PYTHONPATH": path})
    base.record_result(name, rec)
    check_recorded(rec)
    for rank, r in rec["ranks"].items():
        assert r.get("maxpool") is False and r.get("allocators", {}).get("weight_alloc") == "FixedPoolAllocator", (
            rank, r)
    check_crashed(rec)

