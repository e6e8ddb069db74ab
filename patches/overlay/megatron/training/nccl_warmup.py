# Copyright (c) 2026, hfsdp authors. All rights reserved.

"""Opt-in eager creation of NCCL communicators before the training loop (--nccl-comm-warmup).

torch creates an NCCL communicator lazily, on the first collective of its group. Megatron
passes no ``device_id`` to ``init_process_group``, so every communicator of every
model-parallel group is born inside the first training step, at the iteration-1 memory peak,
where NCCL's internal cudaMalloc can fail ("Failed to CUDA calloc async") or a rank can stall
in bootstrap while its peers wait forever. Warming each group with one inert collective while
memory is still free moves that cost to a safe point.

Groups are visited in global group-creation order (``parallel_state._global_process_group_list``,
identical on every rank), which is what keeps the lazy communicator bootstrap deadlock-free:
two ranks can never wait on each other's communicators in opposite orders.
"""

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core import parallel_state

GroupFilter = Callable[[dist.ProcessGroup], bool]
Collective = Callable[..., object]


@dataclass(frozen=True)
class WarmupReport:
    """What a warmup pass did; logged on rank 0 and returned for tests and callers."""

    warmed: int
    skipped_backend: int
    skipped_size_one: int
    seconds: float
    device_free_bytes_before: int | None = None
    device_free_bytes_after: int | None = None


def uses_nccl(group: dist.ProcessGroup) -> bool:
    """True when the group's backend string names NCCL (plain 'nccl' or 'cpu:gloo,cuda:nccl')."""
    return "nccl" in str(dist.get_backend(group)).lower()


def select_groups(
    group_list: Sequence[dist.ProcessGroup | None] | None,
    backend_filter: GroupFilter = uses_nccl,
) -> tuple[list[dist.ProcessGroup], int, int]:
    """Return (groups to warm in list order, #skipped for backend, #skipped for size 1).

    ``None`` entries stand for the default (world) group, as in parallel_state. A group object
    listed twice is warmed once, at its first position.
    """
    selected: list[dist.ProcessGroup] = []
    seen: set[int] = set()
    skipped_backend = skipped_size_one = 0
    for entry in group_list or [None]:
        group = dist.group.WORLD if entry is None else entry
        if group is None:
            raise RuntimeError("nccl warmup: torch.distributed is not initialized")
        if id(group) in seen:
            continue
        seen.add(id(group))
        if not backend_filter(group):
            skipped_backend += 1
        elif group.size() <= 1:
            skipped_size_one += 1
        else:
            selected.append(group)
    return selected, skipped_backend, skipped_size_one


def warm_up_groups(
    groups: Iterable[dist.ProcessGroup],
    device: torch.device,
    collective: Collective = dist.all_reduce,
) -> int:
    """Run one numerically inert collective (SUM of a zero) on each group, in order.

    Returns how many groups were touched. The scratch tensor is private, so no model or
    optimizer state is read or written; its value is checked afterwards so a communicator
    that produced garbage is reported here rather than in step 1.
    """
    scratch = torch.zeros(1, dtype=torch.float32, device=device)
    count = 0
    for group in groups:
        collective(scratch, group=group)
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if scratch.item() != 0.0:
        raise RuntimeError(f"NCCL warmup all-reduce of zeros returned {scratch.item()}")
    return count


def warm_up_nccl_communicators(
    group_list: Sequence[dist.ProcessGroup | None] | None = None,
    backend_filter: GroupFilter = uses_nccl,
    device: torch.device | None = None,
    collective: Collective = dist.all_reduce,
) -> WarmupReport:
    """Create the NCCL communicator of every group this rank belongs to, then log the cost.

    Defaults: the groups are ``parallel_state._global_process_group_list``, the device is the
    current CUDA device and the collective is all_reduce. Call after every process group
    exists and before the first step, CUDA-graph capture and manual NCCL buffer registration.
    """
    if group_list is None:
        group_list = parallel_state._global_process_group_list
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    on_cuda = device.type == "cuda"

    groups, skipped_backend, skipped_size_one = select_groups(group_list, backend_filter)
    free_before = torch.cuda.mem_get_info(device)[0] if on_cuda else None
    start = time.perf_counter()
    warmed = warm_up_groups(groups, device, collective)
    seconds = time.perf_counter() - start
    free_after = torch.cuda.mem_get_info(device)[0] if on_cuda else None

    report = WarmupReport(
        warmed, skipped_backend, skipped_size_one, seconds, free_before, free_after
    )
    if dist.get_rank() == 0:
        memory = ""
        if free_before is not None and free_after is not None:
            memory = f", device free memory {free_before / 2**20:.0f} -> {free_after / 2**20:.0f} MiB"
        # print like Megatron's print_rank_0: the root logger is at WARNING unless
        # --logging-level is given, and this line is what users look for.
        print(
            f"[nccl-comm-warmup] rank 0 warmed {warmed} NCCL communicator(s) in "
            f"{seconds:.3f} s (skipped {skipped_backend} non-NCCL, {skipped_size_one} size-1)"
            f"{memory}",
            flush=True,
        )
    return report


def eager_init_expert_dp_outer_group(
    num_distributed_optimizer_instances: int,
    backend_filter: GroupFilter = uses_nccl,
    device: torch.device | None = None,
) -> bool:
    """Barrier once on the expert inter-partial DP group so its communicator exists now.

    That group (parallel_state's inter-distributed-optimizer-instance group) is both the
    HSDP/HFSDP DP-outer group and the DistOpt inter-instance group. Its first collective
    otherwise comes late (last-microbatch outer reduce, UB registration, or inside a CUDA-graph
    capture), when memory is near its peak and a stalled bootstrap hangs every peer.
    Returns True when the barrier ran; dense models, a single DistOpt instance and
    non-NCCL groups are no-ops.
    """
    if num_distributed_optimizer_instances <= 1:
        return False
    group = parallel_state.get_inter_distributed_optimizer_instance_group(check_initialized=False)
    if group is None or not backend_filter(group):
        return False
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
        torch.cuda.synchronize(device)
    else:
        dist.barrier(group=group)
    return True
