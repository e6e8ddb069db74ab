"""The training entry points, and the part of their command line that Megatron reads.

Standard library only: the launchers (hfsdp/launch), the functional driver and the planner's
log check use it before anything heavy is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath

# They train on CUDA GPUs only (entry.py); paths from the repository root.
TRAINING_ENTRIES = ("pretrain_gpt.py", "pretrain_hybrid.py", "examples/reference_kl/train.py")
REFERENCE_EXAMPLE = TRAINING_ENTRIES[2]


def _is(script: str, entry: str) -> bool:
    return ("/" + PurePosixPath(script).as_posix()).endswith("/" + entry)


def training_entry(script: str) -> str | None:
    """The entry point ``script`` names (a path to it), or None."""
    return next((e for e in TRAINING_ENTRIES if _is(script, e)), None)


def megatron_flags(script: str, flags: Sequence[str]) -> list[str]:
    """``flags`` of ``script``'s command line as Megatron reads them: the reference example's own
    flags (reference_flags.py) split off."""
    if training_entry(script) == REFERENCE_EXAMPLE:
        from hfsdp.training.reference_flags import split_flags

        return split_flags(flags)[1]
    return list(flags)
