# Copyright (c) 2026, hfsdp authors. All rights reserved.

"""Distributed teardown when pretrain() returns or raises.

Megatron's pretrain() does not destroy the process group when it ends. Left alone, jobs with
many NCCL groups (MoE expert-parallel layouts) tear communicators down in uncoordinated
interpreter GC, where NCCL watchdogs time out and the process hangs after training has
finished, and a Megatron-FSDP --use-nccl-ub pool that is still registered makes
ProcessGroupNCCL's destructor fail ("Deregister: Could not find handle").

``tear_down_distributed_on_exit`` wraps pretrain():
- success (return or SystemExit(0)): world barrier, deregister each Megatron-FSDP buffer's NCCL
  memory pool from every group it was registered with, destroy_model_parallel,
  destroy_process_group;
- failure: no barrier and no deregistration (both are collective and peers may be gone); one
  line naming the error goes to stderr first, then model-parallel state is dropped and the
  process groups are aborted on a daemon thread joined with a timeout, so teardown can
  neither hang nor mask the error, which then propagates unchanged;
- steps aside when the caller created the process group before pretrain() (it keeps using
  it) or when in-process restart is active (its wrapper owns teardown);
- idempotent: every step checks the state it is about to change.
"""

import functools
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.fsdp.src.megatron_fsdp import model_pools
from megatron.core.full_cuda_graph import FullCudaGraphWrapper

logger = logging.getLogger(__name__)


# Bound on the failure-path abort; a stuck NCCL abort must not keep a failed job alive.
FAILURE_TEARDOWN_TIMEOUT_S = 30.0

# Stages ('training', 'validation') whose full-iteration CUDA graph teardown destroyed, for
# reports written after pretrain() returns (they can no longer see the graph itself).
destroyed_graph_stages: set = set()

# Megatron-FSDP ParamAndGradBuffers whose NCCL pool registrations must be undone at exit.
# Strong references, dropped when the wrapped pretrain() exits, whatever the outcome.
_tracked_fsdp_buffers: list[Any] = []


def track_model_for_teardown(model: list[torch.nn.Module]) -> None:
    """Remember the Megatron-FSDP buffers of ``model`` whose NCCL memory pool is registered.

    Only buffers built with --use-nccl-ub have ``ubr_groups``; everything else is ignored.
    """
    for chunk in model:
        buffer = getattr(chunk, "param_and_grad_buffer", None)
        if buffer is not None and getattr(buffer, "ubr_groups", None):
            _tracked_fsdp_buffers.append(buffer)


def deregister_fsdp_nccl_pool() -> int:
    """Deregister each tracked Megatron-FSDP buffer's own NCCL pool from each group it was
    registered with ([Note: one model's pools] in megatron_fsdp/model_pools.py): once per (pool,
    group); manual-registration buffers count only after their registration ran. Returns the
    number of (pool, group) registrations undone.
    """
    if not _tracked_fsdp_buffers or not dist.is_initialized():
        _tracked_fsdp_buffers.clear()
        return 0
    undone = model_pools.deregister_pools(_tracked_fsdp_buffers)
    _tracked_fsdp_buffers.clear()
    return undone


def _run_step(name: str, step: Callable[[], Any]) -> None:
    """Run one teardown step; log and swallow its error so later steps still run."""
    try:
        step()
    except Exception as exc:  # teardown is best effort by design
        logger.warning(f"[teardown] {name} failed: {type(exc).__name__}: {exc}")


def _destroy_model_parallel() -> None:
    parallel_state.destroy_model_parallel()


def release_cuda_graphs(synchronize: bool = True) -> int:
    """Destroy the full-iteration CUDA graphs; returns how many there were.

    [Note: graphs before communicators]
    NCCL counts every collective captured into a CUDA graph as a reference on its communicator,
    dropped only when the graph is destroyed, and ncclCommFinalize / ncclCommDestroy /
    ncclCommAbort wait until no such reference is left. Megatron keeps the full-iteration graphs
    in FullCudaGraphWrapper's class attributes for the life of the process, so a graphed run with
    data-parallel size >= 2 printed its last step and then hung in destroy_process_group().
    The wait does not depend on the transport (sockets, P2P, NVLink, InfiniBand), so one node or
    many hang alike; eager runs capture nothing and never waited. ``reset()`` destroys the graph
    executable even where another reference to the Python object survives. ``synchronize``:
    wait for a replay still in flight first (the failure path skips it: a stuck GPU must not
    stall teardown, and CUDA frees an executable that is still running when it completes).
    """
    graphs = getattr(FullCudaGraphWrapper, "cuda_graph", {})
    live = [stage for stage, graph in graphs.items() if graph is not None]
    if not live:
        return 0
    if synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()
    for stage in live:
        graphs[stage].reset()
        graphs[stage] = None
        destroyed_graph_stages.add(stage)
        results = getattr(FullCudaGraphWrapper, "result", None)
        if isinstance(results, dict):
            results[stage] = None  # outputs in the graph's pool
    return len(live)


def _release_cuda_graphs_logged(synchronize: bool = True) -> None:
    released = release_cuda_graphs(synchronize)
    if released:
        logger.info(f"[teardown] destroyed {released} full-iteration CUDA graph(s) before the process groups")


def _abort_or_destroy_process_groups() -> None:
    """Abort every process group without waiting on peers; fall back to a plain destroy."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort()
            return
        except Exception as exc:
            logger.warning(f"[teardown] abort failed ({exc}); falling back to destroy")
    if dist.is_initialized():
        dist.destroy_process_group()


def teardown_after_success() -> None:
    """Coordinated teardown: every rank reached the end of pretrain()."""
    _run_step("destroy CUDA graphs", _release_cuda_graphs_logged)
    if dist.is_initialized():
        _run_step("barrier", dist.barrier)
        _run_step("deregister Megatron-FSDP NCCL pool", deregister_fsdp_nccl_pool)
    _tracked_fsdp_buffers.clear()
    _run_step("destroy_model_parallel", _destroy_model_parallel)
    if dist.is_initialized():
        _run_step("destroy_process_group", dist.destroy_process_group)


def teardown_after_failure(error: BaseException, timeout_s: float = FAILURE_TEARDOWN_TIMEOUT_S) -> None:
    """Uncoordinated teardown of a failing rank: bounded, never raises, never barriers."""
    # Said first so the cause is visible even if the abort below crashes the process.
    print(
        f"[teardown] pretrain failed with {type(error).__name__}: {error}; "
        "aborting process groups (no barrier)",
        file=sys.stderr,
        flush=True,
    )
    _tracked_fsdp_buffers.clear()
    _run_step("destroy_model_parallel", _destroy_model_parallel)

    def graphs_then_groups() -> None:
        _run_step("destroy CUDA graphs", lambda: _release_cuda_graphs_logged(synchronize=False))
        _run_step("abort process groups", _abort_or_destroy_process_groups)

    worker = threading.Thread(
        target=graphs_then_groups,
        name="megatron-teardown",
        daemon=True,
    )
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        print(
            f"[teardown] process-group abort still running after {timeout_s:.0f} s; "
            "leaving it to process exit",
            file=sys.stderr,
            flush=True,
        )


def _is_success(exc: BaseException) -> bool:
    return isinstance(exc, SystemExit) and exc.code in (None, 0)


def tear_down_distributed_on_exit[F: Callable[..., Any]](fn: F) -> F:
    """Decorate pretrain() so the distributed state it created is torn down when it exits."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        # in-process restart owns teardown; a pre-existing group belongs to the caller.
        step_aside = bound.arguments.get("inprocess_call_wrapper") is not None or (
            dist.is_available() and dist.is_initialized()
        )
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            if step_aside:
                pass
            elif _is_success(exc):
                teardown_after_success()
            else:
                teardown_after_failure(exc)
            raise
        else:
            if not step_aside:
                teardown_after_success()
            return result
        finally:
            _tracked_fsdp_buffers.clear()

    return wrapper  # type: ignore[return-value]
