# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""The gradient norm in Triton, bit for bit TE's ``multi_tensor_l2norm``, in a few launches.

[Note: Triton l2norm]
Megatron's gradient norm is TE's ``multi_tensor_l2norm(chunk_size, noop, [grads], False)``. TE's
``multi_tensor_apply`` gives each chunk of ``chunk_size`` elements to one block of 512 threads, at
most 320 blocks and 110 tensors a launch; a block sums its chunk's squares and adds the sum into
``output[blockIdx.x]``, and a last kernel reduces the 320 slots and takes the square root. A list
of billions of elements so takes one launch per 320 chunks, each only a few waves deep.

:func:`l2norm` computes every chunk's sum in one launch per kind of chunk (TE's two element orders;
the alignment of the chunk's start, which sets the width of its loads), then adds the sums into
the slots in TE's launch order and reduces them in one more launch. Which chunk TE puts in which
slot of which launch (:func:`launch_blocks`) is worked out on the host once per list of addresses
and sizes, and kept (:func:`plan`, eight lists at most: gradients that move every step would cost a
new plan every step; Megatron-FSDP's stay in their buffers).

Invariants:

* Same bits as TE: every addition in TE's order. Per thread, ``vals[ii] += x * x`` over its
  elements in TE's order (a fused multiply-add, as nvcc contracts it), then
  ``((vals[0] + vals[1]) + vals[2]) + vals[3]``; the block's halving tree over 512 lanes
  (``reduce_block_into_lanes``); the slots in launch order; the cleanup's halving tree over 320
  slots padded to 512 with zeros; ``sqrt``. TE builds ``l2norm.cu`` with ``--use_fast_math``: the
  square root is approximate, as Triton's ``tl.sqrt``, and every subnormal operand and result is
  flushed to zero (``triton_adam.ftz``).
* Only what TE's call computes: a global norm (``per_tensor`` false) of one list of non-empty,
  contiguous tensors of one dtype (fp32, bf16, fp16) on one CUDA device, with a chunk size that is a
  multiple of 2048 (Megatron's is 65536). :func:`refusal` says why another call goes to TE's op.
* The noop flag (int32, as TE's) is set where a chunk's sum is not finite, as TE sets it.
* Not under CUDA-graph capture: a captured norm would read the kept plan at every replay.
* On by default: the GPU test (``test_triton_l2norm_gpu.py``) holds it to TE's bits, Megatron's
  ``get_grad_norm_fp32`` among them. ``HFSDP_TRITON_L2NORM=0`` sends every call to TE's op, for
  comparisons; any value other than 0 or 1 is an error.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENV = "HFSDP_TRITON_L2NORM"
THREADS = 512  # TE's BLOCK_SIZE for the norm and for its cleanup
ILP = 4  # elements a TE thread reads per iteration
STEP = THREADS * ILP  # elements a block reads per iteration
MAX_TENSORS = 110  # TE's depth_to_max_tensors[0]
MAX_BLOCKS = 320  # TE's depth_to_max_blocks[0], and the cleanup's slots
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: TE's op (if any) does everything
    triton = None

if triton is not None:
    from .triton_adam import ftz

    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _halve(x, WIDTH: tl.constexpr):
        """One level of TE's halving tree: ``x[t] + x[t + WIDTH / 2]`` for the lower half."""
        return ftz(tl.sum(tl.reshape(x, (2, WIDTH // 2)), axis=0))

    @triton.jit
    def _tree(x):
        """TE's ``reduce_block_into_lanes`` over 512 lanes: the sum, as a one-element vector."""
        x = _halve(x, 512)
        x = _halve(x, 256)
        x = _halve(x, 128)
        x = _halve(x, 64)
        x = _halve(x, 32)
        x = _halve(x, 16)
        x = _halve(x, 8)
        x = _halve(x, 4)
        return _halve(x, 2)

    @triton.jit
    def _chunk_sums(addr_ptr, size_ptr, id_ptr, sums_ptr, noop_ptr, DTYPE: tl.constexpr,
                    TE_ALIGNED: tl.constexpr, ALIGN: tl.constexpr):
        """One chunk a program: the sum of its squares, as TE's block computes it."""
        pid = tl.program_id(0)
        # The host put here only chunks that start on ALIGN bytes: loads of up to 16 bytes.
        x_ptr = tl.multiple_of(tl.load(addr_ptr + pid).to(tl.pointer_type(DTYPE)), ALIGN)
        n = tl.load(size_ptr + pid)
        # acc[j] is TE's vals[ii] of thread t: j = 4 t + ii in TE's aligned order, where thread t
        # reads elements 4 t .. 4 t + 3 of each 2048; j = 512 ii + t in its unaligned order, where
        # it reads elements t, t + 512, t + 1024, t + 1536. Either way iteration s reads s * 2048 + j.
        j = tl.arange(0, 2048)
        acc = tl.zeros([2048], dtype=tl.float32)
        full = n // 2048
        for s in range(0, full):
            x = ftz(tl.load(x_ptr + s * 2048 + j).to(tl.float32))
            acc = ftz(tl.fma(x, x, acc))
        if full * 2048 < n:  # the tensor's last chunk: TE's threads past its end add nothing
            e = full * 2048 + j
            x = ftz(tl.load(x_ptr + e, mask=e < n, other=0.0).to(tl.float32))
            acc = ftz(tl.fma(x, x, acc))
        if TE_ALIGNED:
            quads = tl.reshape(acc, (512, 4))
        else:
            quads = tl.trans(tl.reshape(acc, (4, 512)))
        even, odd = tl.split(tl.reshape(quads, (512, 2, 2)))  # vals[0], vals[2] | vals[1], vals[3]
        v0, v2 = tl.split(even)
        v1, v3 = tl.split(odd)
        total = _tree(ftz(ftz(ftz(v0 + v1) + v2) + v3))
        one = tl.arange(0, 1)
        tl.store(sums_ptr + tl.load(id_ptr + pid) + one, total)
        bad = (total != total) | (tl.abs(total) == float("inf"))
        tl.store(noop_ptr + one, tl.full([1], 1, tl.int32), mask=bad)

    @triton.jit
    def _finish(sums_ptr, slots_ptr, launches, ret_ptr):
        """TE's ``output[blockIdx.x] += sum`` launch after launch, then its cleanup."""
        b = tl.arange(0, 512)
        acc = tl.zeros([512], dtype=tl.float32)
        for launch in range(0, launches):
            chunk = tl.load(slots_ptr + launch * 512 + b)
            acc = ftz(acc + tl.load(sums_ptr + chunk, mask=chunk >= 0, other=0.0))
        tl.store(ret_ptr + tl.arange(0, 1), ftz(tl.sqrt(_tree(acc))))


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    value = environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 0 (TE's multi_tensor_l2norm) or 1 (the Triton norm)")
    return value == "1" and triton is not None


def launch_blocks(numels: Sequence[int], chunk_size: int) -> list[list[int]]:
    """TE's ``multi_tensor_apply<1>``: for each launch, the chunks its blocks 0, 1, ... take.

    Chunks are numbered in list order (tensor by tensor, chunk by chunk). A launch ends after
    :data:`MAX_BLOCKS` blocks, after the last chunk of its :data:`MAX_TENSORS`-th tensor, or at the
    list's end; a tensor cut by a launch carries over as the next launch's first tensor.
    """
    launches: list[list[int]] = []
    blocks: list[int] = []
    tensors = 0
    chunk_id = 0
    for t, numel in enumerate(numels):
        if numel <= 0:
            raise ValueError(f"tensor {t} has {numel} elements: TE's multi_tensor_apply takes no empty tensor")
        tensors += 1
        chunks = -(-numel // chunk_size)
        for chunk in range(chunks):
            blocks.append(chunk_id)
            chunk_id += 1
            last_of_tensor = chunk == chunks - 1
            if ((tensors == MAX_TENSORS and last_of_tensor) or len(blocks) == MAX_BLOCKS
                    or (t == len(numels) - 1 and last_of_tensor)):
                launches.append(blocks)
                blocks = []
                tensors = 0 if last_of_tensor else 1
    return launches


@dataclass(frozen=True)
class ChunkGroup:
    """Chunks one launch of ``_chunk_sums`` takes: their start addresses, sizes and numbers."""

    te_aligned: bool
    align: int  # bytes every chunk start of the group is a multiple of (at most 16)
    addresses: torch.Tensor
    sizes: torch.Tensor
    ids: torch.Tensor


@dataclass(frozen=True)
class Plan:
    chunks: int
    groups: tuple[ChunkGroup, ...]
    slots: torch.Tensor  # [launches, 512] int32: the chunk of each block, -1 for none


@functools.lru_cache(maxsize=8)
def plan(tensors: tuple[tuple[int, int], ...], element_size: int, chunk_size: int, device: torch.device) -> Plan:
    """The chunk groups and TE's slots for tensors given as (address, numel), on ``device``."""
    kinds: dict[tuple[bool, int], tuple[list[int], list[int], list[int]]] = {}
    chunk_id = 0
    for address, numel in tensors:
        for start in range(0, numel, chunk_size):
            chunk_address = address + start * element_size
            # TE's aligned path: n % ILP == 0 && chunk_size % ILP == 0 && is_aligned(x), n counted from the chunk on
            te_aligned = (numel - start) % ILP == 0 and chunk_address % (ILP * element_size) == 0
            align = min(16, chunk_address & -chunk_address)  # the largest power of two dividing it
            group = kinds.setdefault((te_aligned, align), ([], [], []))
            group[0].append(chunk_address)
            group[1].append(min(chunk_size, numel - start))
            group[2].append(chunk_id)
            chunk_id += 1
    launches = launch_blocks([numel for _, numel in tensors], chunk_size)
    slots = [blocks + [-1] * (THREADS - len(blocks)) for blocks in launches]
    return Plan(
        chunks=chunk_id,
        groups=tuple(
            ChunkGroup(te_aligned, align, torch.tensor(addresses, dtype=torch.int64, device=device),
                       torch.tensor(sizes, dtype=torch.int32, device=device),
                       torch.tensor(ids, dtype=torch.int32, device=device))
            for (te_aligned, align), (addresses, sizes, ids) in sorted(kinds.items())),
        slots=torch.tensor(slots, dtype=torch.int32, device=device),
    )


def refusal(chunk_size: int, noop: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]],
            args: Sequence[Any]) -> str | None:
    """Why a ``multi_tensor_l2norm(chunk_size, noop, tensor_lists, *args)`` call goes to TE's op, or None."""
    if args and args[0]:
        return "per-tensor norms"
    if len(args) > 1:
        return f"{len(args)} arguments after the lists"
    if len(tensor_lists) != 1 or not tensor_lists[0]:
        return f"{len(tensor_lists)} lists, the first of {len(tensor_lists[0]) if tensor_lists else 0} tensors"
    if chunk_size <= 0 or chunk_size % STEP:
        return f"chunk size {chunk_size}, not a multiple of {STEP}"
    if noop.dtype != torch.int32:  # TE writes an int32 1 into it
        return f"a noop flag of {noop.dtype}, not int32"
    first = tensor_lists[0][0]
    if first.dtype not in _DTYPES:
        return f"dtype {first.dtype}"
    other = next((t.dtype for t in tensor_lists[0] if t.dtype != first.dtype), None)
    if other is not None:  # TE's kernel would read every tensor as the first one's dtype
        return f"dtypes {first.dtype} and {other} in one list"
    for tensor in tensor_lists[0]:
        if not tensor.is_cuda:
            return f"a tensor on {tensor.device}, not on a CUDA device"
        if tensor.device != first.device:
            return f"tensors on {first.device} and {tensor.device}"
        if not tensor.is_contiguous() or tensor.numel() == 0:
            return "a non-contiguous or empty tensor"
    if noop.device != first.device:
        return f"the noop flag on {noop.device}, the tensors on {first.device}"
    if torch.cuda.is_current_stream_capturing():
        # A captured norm would read the plan's tensors at every replay, and a plan made during capture would
        # copy from the host while capturing: TE's op keeps nothing between calls.
        return "the stream is capturing a CUDA graph"
    return None


def chunk_sums(tensors: Sequence[torch.Tensor], chunk_size: int, noop: torch.Tensor) -> tuple[Plan, torch.Tensor]:
    """Each chunk's sum of squares (fp32, chunks in list order) as TE's blocks compute it, and the plan."""
    first = tensors[0]
    work = plan(tuple((t.data_ptr(), t.numel()) for t in tensors), first.element_size(), chunk_size, first.device)
    sums = torch.empty(work.chunks, dtype=torch.float32, device=first.device)
    with _on(first.device):
        for group in work.groups:
            _chunk_sums[(group.ids.numel(),)](
                group.addresses, group.sizes, group.ids, sums, noop, DTYPE=_TL_DTYPES[first.dtype],
                TE_ALIGNED=group.te_aligned, ALIGN=group.align, num_warps=4, enable_fp_fusion=False)
    return work, sums


def norm(tensors: Sequence[torch.Tensor], chunk_size: int, noop: torch.Tensor) -> torch.Tensor:
    """The global 2-norm of ``tensors`` (one fp32 element), as TE's ``multi_tensor_l2norm`` computes it."""
    work, sums = chunk_sums(tensors, chunk_size, noop)
    ret = torch.empty(1, dtype=torch.float32, device=sums.device)
    with _on(sums.device):
        _finish[(1,)](sums, work.slots, work.slots.shape[0], ret, num_warps=4, enable_fp_fusion=False)
    return ret


def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Triton launches on the current CUDA device (Triton's interpreter runs on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def l2norm(te_op: Callable[..., Any], chunk_size: int, noop: torch.Tensor,
           tensor_lists: Sequence[Sequence[torch.Tensor]], *args: Any,
           environ: Mapping[str, str] = os.environ) -> Any:
    """TE's ``multi_tensor_l2norm(chunk_size, noop, tensor_lists, *args)``; where :func:`refusal` has
    nothing against the call and the switch is on, through :func:`norm`."""
    if not enabled(environ) or refusal(chunk_size, noop, tensor_lists, args) is not None:
        return te_op(chunk_size, noop, tensor_lists, *args)
    _log_once()
    ret = norm(tensor_lists[0], chunk_size, noop)
    return ret, torch.empty(0, dtype=torch.float32, device=ret.device)


@functools.cache
def _log_once() -> None:
    logger.info("The gradient norm: Triton, TE's bits (%s=0 keeps TE's op).", ENV)


def wrap(te_op: Callable[..., Any]) -> Callable[..., Any]:
    """A drop-in for TE's ``multi_tensor_l2norm`` that goes through :func:`l2norm`."""
    return functools.partial(l2norm, te_op)
