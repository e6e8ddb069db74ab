"""Megatron's argument validation without a GPU: its device queries answered with an assumed GPU.

[Note: validation without a GPU] ``validate_args`` asks the GPU twice: its architecture
(``get_device_arch_version``, with Megatron-FSDP and with tensor or context parallelism) and its
compute capability (``--moe-grouped-gemm``). Without a CUDA driver both raise torch's "Found no
NVIDIA driver", so on a CPU machine no check after them ran. :func:`assumed_device` answers both
with an assumed architecture for the duration of the validation and restores them afterwards.
One helper for both of its callers:

* the training entry (``hfsdp/training/entry.py``) validates the flags with it only when CUDA is
  absent, then says in one sentence that training needs CUDA GPUs;
* the memory planner (``hfsdp/planner/setup.py``) always validates with it, at the architecture
  ``--plan-device-arch`` names, so that a plan never depends on the machine it is made on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

ASSUMED_ARCH = 9  # Hopper: what the entry assumes on a machine without CUDA (the planner's default too)


def arch_name(arch: int) -> str:
    """``9`` -> ``"a Hopper GPU (compute capability 9)"``, for messages."""
    known = {7: "Volta or Turing", 8: "Ampere or Ada", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}
    return f"a{' ' + known[arch] if arch in known else ''} GPU (compute capability {arch})"


@contextlib.contextmanager
def assumed_device(arch: int = ASSUMED_ARCH) -> Iterator[None]:
    """Answer Megatron's device queries of argument validation with GPU architecture ``arch``
    (see the note); both are restored on exit, however it is left."""
    import torch

    import megatron.training.arguments as margs

    saved_arch, saved_capability = margs.get_device_arch_version, torch.cuda.get_device_capability
    margs.get_device_arch_version = lambda: arch

    def capability(device: object = None) -> tuple[int, int]:
        return arch, 0

    torch.cuda.get_device_capability = capability
    try:
        yield
    finally:
        margs.get_device_arch_version = saved_arch
        torch.cuda.get_device_capability = saved_capability


@contextlib.contextmanager
def validation_device() -> Iterator[None]:
    """The training entry's use (see the note): the real device where torch finds one, else
    :func:`assumed_device` (no CUDA context is created either way)."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    with assumed_device(ASSUMED_ARCH):
        yield
