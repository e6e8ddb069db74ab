"""One rank of a CPU (gloo) multi-process job for the NCCL-lifecycle tests.

Run as ``python _dist_worker.py <scenario> <rank> <world_size> <out_dir> <init_method>...`` by
``_harness.run_ranks`` (scenario ``lifecycle``) or under torchrun (scenario ``fail``, rank and
world size from the environment). Results go to ``<out_dir>/rank<r>.json``; the tests assert.
"""

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=60)


def _desc(group: Any) -> str:
    return (dist.group.WORLD if group is None else group).group_desc


def _init(rank: int, world: int, init_method: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init_method, timeout=TIMEOUT)


def _init_model_parallel() -> None:
    from megatron.core import parallel_state as ps

    # Two DistOpt instances so the expert inter-partial DP group exists (size 2 on 2 ranks).
    ps.initialize_model_parallel(
        1,
        1,
        num_distributed_optimizer_instances=2,
        create_gloo_process_groups=True,
        distributed_timeout_minutes=1,
    )


def _pretend_nccl(group: dist.ProcessGroup) -> bool:
    """Backend filter for CPU runs: every group is gloo, so treat Megatron's *_GLOO ones as the
    gloo groups and all others as what would be NCCL groups on GPU."""
    return "GLOO" not in group.group_desc.upper()


def scenario_lifecycle(rank: int, world: int, inits: list[str]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.training import nccl_warmup, teardown

    out: dict[str, Any] = {}

    # --- warmup on the real Megatron group list -------------------------------------------
    _init(rank, world, inits[0])
    _init_model_parallel()
    group_list = list(ps._global_process_group_list)
    out["group_list"] = [
        {"desc": _desc(g), "size": (dist.group.WORLD if g is None else g).size()}
        for g in group_list
    ]

    touched: list[str] = []

    def spy_all_reduce(tensor: torch.Tensor, group: Any = None) -> None:
        touched.append(group.group_desc)
        dist.all_reduce(tensor, group=group)

    state = torch.arange(4, dtype=torch.float32) + rank
    state_before = state.clone()
    report = nccl_warmup.warm_up_nccl_communicators(
        backend_filter=_pretend_nccl, device=torch.device("cpu"), collective=spy_all_reduce
    )
    out["warm"] = {
        "touched": touched,
        "warmed": report.warmed,
        "skipped_backend": report.skipped_backend,
        "skipped_size_one": report.skipped_size_one,
        "seconds": report.seconds,
        "state_unchanged": bool(torch.equal(state, state_before)),
    }
    # Real backend filter: on gloo-only jobs nothing is NCCL, so nothing may be touched.
    touched_default: list[str] = []
    default_report = nccl_warmup.warm_up_nccl_communicators(
        device=torch.device("cpu"),
        collective=lambda t, group=None: touched_default.append(group.group_desc),
    )
    out["warm_default_filter"] = {
        "touched": touched_default,
        "skipped_backend": default_report.skipped_backend,
    }

    # --- eager expert inter-partial DP group -------------------------------------------------
    barriers: list[str] = []
    real_barrier = dist.barrier

    def spy_barrier(group: Any = None, **kwargs: Any) -> None:
        barriers.append(_desc(group))
        real_barrier(group=group, **kwargs)

    nccl_warmup.dist.barrier = spy_barrier
    try:
        cpu = torch.device("cpu")
        inter = ps.get_inter_distributed_optimizer_instance_group(check_initialized=False)
        out["eager"] = {
            "inter_desc": None if inter is None else inter.group_desc,
            "ran_two_instances": nccl_warmup.eager_init_expert_dp_outer_group(
                2, backend_filter=lambda g: True, device=cpu
            ),
            "ran_one_instance": nccl_warmup.eager_init_expert_dp_outer_group(
                1, backend_filter=lambda g: True, device=cpu
            ),
            "ran_default_filter_on_gloo": nccl_warmup.eager_init_expert_dp_outer_group(2, device=cpu),
        }
        saved = ps._INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP
        ps._INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP = None  # what a dense model has
        out["eager"]["ran_dense"] = nccl_warmup.eager_init_expert_dp_outer_group(
            2, backend_filter=lambda g: True, device=cpu
        )
        ps._INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP = saved
        out["eager"]["barriers"] = list(barriers)
    finally:
        nccl_warmup.dist.barrier = real_barrier

    # --- teardown: a caller-created process group is left alone ---------------------------
    @teardown.tear_down_distributed_on_exit
    def pretrain_like(init_method: Any = None, inprocess_call_wrapper: Any = None) -> str:
        if init_method is not None:
            _init(rank, world, init_method)
            _init_model_parallel()
        return "done"

    out["caller_owned"] = {"result": pretrain_like()}
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)  # must still work: the group is the caller's
    out["caller_owned"].update(
        initialized_after=dist.is_initialized(),
        all_reduce_after=probe.item(),
        mp_initialized_after=ps.model_parallel_is_initialized(),
    )
    ps.destroy_model_parallel()
    dist.destroy_process_group()

    # --- teardown: the group pretrain created is destroyed, idempotently --------------------
    out["owned"] = {"result": pretrain_like(init_method=inits[1])}
    out["owned"].update(
        initialized_after=dist.is_initialized(),
        mp_initialized_after=ps.model_parallel_is_initialized(),
        group_list_after=ps._global_process_group_list,
    )
    try:
        teardown.teardown_after_success()
        teardown.teardown_after_success()
        out["owned"]["second_teardown_error"] = None
    except Exception as exc:  # the test reports it
        out["owned"]["second_teardown_error"] = repr(exc)

    # --- teardown steps aside under in-process restart --------------------------------------
    out["inprocess"] = {"result": pretrain_like(init_method=inits[2], inprocess_call_wrapper=object())}
    out["inprocess"].update(
        initialized_after=dist.is_initialized(),
        mp_initialized_after=ps.model_parallel_is_initialized(),
    )
    ps.destroy_model_parallel()
    dist.destroy_process_group()

    # --- train()'s sys.exit(0) counts as success ---------------------------------------------
    @teardown.tear_down_distributed_on_exit
    def pretrain_exiting(inprocess_call_wrapper: Any = None) -> None:
        _init(rank, world, inits[3])
        _init_model_parallel()
        sys.exit(0)

    try:
        pretrain_exiting()
        out["sys_exit"] = {"raised": False}
    except SystemExit as exc:
        out["sys_exit"] = {"raised": True, "code": exc.code}
    out["sys_exit"]["initialized_after"] = dist.is_initialized()
    return out


def scenario_fail(rank: int, world: int, out_dir: str) -> None:
    """Rank 1 raises inside a pretrain-like function while rank 0 waits in a collective.

    Rank 1's teardown is also sabotaged (the abort raises) to prove a teardown error never
    replaces the original one.
    """
    from megatron.training import teardown

    def broken_abort(group: Any = None) -> None:
        raise RuntimeError("sabotaged abort")

    dist.distributed_c10d._abort_process_group = broken_abort

    @teardown.tear_down_distributed_on_exit
    def pretrain_like(inprocess_call_wrapper: Any = None) -> None:
        dist.init_process_group("gloo", timeout=TIMEOUT)
        _init_model_parallel()
        if rank == 1:
            with open(os.path.join(out_dir, "raise_time"), "w") as f:
                f.write(repr(time.time()))
            raise ValueError("sentinel-rank1-exploded")
        dist.all_reduce(torch.ones(1))  # rank 1 never joins

    pretrain_like()


def main() -> None:
    scenario = sys.argv[1]
    if scenario == "fail":
        scenario_fail(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[2])
        return
    rank, world, out_dir = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    result = scenario_lifecycle(rank, world, sys.argv[5:])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
