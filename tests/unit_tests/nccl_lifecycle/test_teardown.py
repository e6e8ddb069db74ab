"""Distributed teardown at the end of pretrain() (megatron/training/teardown.py), on CPU/gloo."""

import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from nccl_harness import WORKER, child_env
from rendezvous import init_one_rank_gloo

from megatron.training import teardown

FAIL_JOB_TIMEOUT_S = 240  # whole torchrun job, imports included
EXIT_AFTER_RAISE_BOUND_S = 45  # from rank 1's raise to the job's exit


# ---------------------------------------------------------------- multi-rank lifecycle job


def test_caller_created_group_is_left_alone(lifecycle_results):
    for res in lifecycle_results:
        owned = res["caller_owned"]
        assert owned["result"] == "done"
        assert owned["initialized_after"] is True
        assert owned["mp_initialized_after"] is True
        assert owned["all_reduce_after"] == 3.0  # 1 + 2: the caller's group still works


def test_group_created_inside_is_destroyed_idempotently(lifecycle_results):
    for res in lifecycle_results:
        owned = res["owned"]
        assert owned["result"] == "done"
        assert owned["initialized_after"] is False
        assert owned["mp_initialized_after"] is False
        assert owned["group_list_after"] is None
        assert owned["second_teardown_error"] is None


def test_steps_aside_under_inprocess_restart(lifecycle_results):
    for res in lifecycle_results:
        assert res["inprocess"]["initialized_after"] is True
        assert res["inprocess"]["mp_initialized_after"] is True


def test_sys_exit_zero_is_a_success_path(lifecycle_results):
    for res in lifecycle_results:
        assert res["sys_exit"] == {"raised": True, "code": 0, "initialized_after": False}


# ---------------------------------------------------------------- single-process unit tests


@pytest.fixture
def init_single_rank():
    """Returns a function that creates a 1-rank gloo world; destroys it at the end if left."""

    yield init_one_rank_gloo
    if dist.is_initialized():
        dist.destroy_process_group()


def test_success_order_graphs_barrier_deregister_mp_then_pg(monkeypatch, init_single_rank):
    calls: list[str] = []
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(teardown, "release_cuda_graphs", lambda synchronize=True: calls.append("graphs") or 0)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(teardown, "deregister_fsdp_nccl_pool", lambda: calls.append("deregister"))
    monkeypatch.setattr(teardown, "_destroy_model_parallel", lambda: calls.append("mp"))

    def destroy(*a: Any, **k: Any) -> None:
        calls.append("pg")
        real_destroy(*a, **k)

    monkeypatch.setattr(dist, "destroy_process_group", destroy)

    @teardown.tear_down_distributed_on_exit
    def pretrain_like(inprocess_call_wrapper: Any = None) -> int:
        init_single_rank()
        return 7

    assert pretrain_like() == 7
    assert calls == ["graphs", "barrier", "deregister", "mp", "pg"]
    assert not dist.is_initialized()


def test_failure_keeps_original_error_when_every_teardown_step_breaks(
    monkeypatch, init_single_rank, capsys
):
    calls: list[str] = []

    def broken(name: str):
        def step(*a: Any, **k: Any) -> None:
            calls.append(name)
            raise RuntimeError(f"teardown step {name} broke")

        return step

    monkeypatch.setattr(dist, "barrier", broken("barrier"))
    monkeypatch.setattr(teardown, "release_cuda_graphs", broken("graphs"))
    monkeypatch.setattr(teardown, "_destroy_model_parallel", broken("mp"))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", broken("abort"))
    monkeypatch.setattr(dist, "destroy_process_group", broken("destroy"))

    @teardown.tear_down_distributed_on_exit
    def pretrain_like(inprocess_call_wrapper: Any = None) -> None:
        init_single_rank()
        raise ValueError("original-error-sentinel")

    with pytest.raises(ValueError, match="original-error-sentinel"):
        pretrain_like()
    assert "barrier" not in calls, "the failure path must not barrier"
    assert calls == ["mp", "graphs", "abort", "destroy"]
    assert "pretrain failed with ValueError: original-error-sentinel" in capsys.readouterr().err
    monkeypatch.undo()  # real destroy for the fixture's cleanup


def test_failure_teardown_is_bounded_when_abort_hangs(monkeypatch, init_single_rank):
    release = threading.Event()
    monkeypatch.setattr(
        dist.distributed_c10d, "_abort_process_group", lambda group=None: release.wait(60)
    )
    init_single_rank()
    start = time.monotonic()
    try:
        teardown.teardown_after_failure(ValueError("x"), timeout_s=1.0)
        elapsed = time.monotonic() - start
    finally:
        release.set()
    assert elapsed < 10.0, f"failure teardown took {elapsed:.1f} s with a hung abort"


def test_deregisters_each_buffers_own_pool_once_per_group(monkeypatch, init_single_rank):
    from megatron.core import nccl_allocator

    init_single_rank()
    pool_a, pool_b, pool_c = object(), object(), object()
    g1, g2, g3, g4 = (SimpleNamespace(name=f"g{i}") for i in range(1, 5))
    auto = SimpleNamespace(fsdp_manual_registration=False)
    manual = SimpleNamespace(fsdp_manual_registration=True)

    def buf(pool, groups, cfg=auto):
        return SimpleNamespace(nccl_mem_pool=pool, ubr_groups=groups, ddp_config=cfg, already_registered=False)

    first, second = buf(pool_a, [g1, g2]), buf(pool_b, [g2, g3])
    chunks = [
        SimpleNamespace(param_and_grad_buffer=first),
        SimpleNamespace(param_and_grad_buffer=second),  # another model: its own pool, a shared group
        SimpleNamespace(param_and_grad_buffer=buf(pool_c, [g4], manual)),  # manual registration never ran
        SimpleNamespace(param_and_grad_buffer=buf(None, None)),  # no nccl_ub
        SimpleNamespace(),  # not a Megatron-FSDP chunk
    ]
    undone: list[Any] = []
    monkeypatch.setattr(nccl_allocator, "deregister_mem_pool", lambda p, g: undone.append((p, g.name)))
    teardown.track_model_for_teardown(chunks)
    teardown.track_model_for_teardown([chunks[0]])  # tracked twice: still once per (pool, group)
    assert teardown.deregister_fsdp_nccl_pool() == 4
    assert undone == [(pool_a, "g1"), (pool_a, "g2"), (pool_b, "g2"), (pool_b, "g3")]
    assert teardown.deregister_fsdp_nccl_pool() == 0  # idempotent
    assert len(undone) == 4


# ---------------------------------------------------------------- a failing rank ends the job


def test_raising_rank_ends_the_whole_job_with_its_error(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "0", "--monitor-interval", "0.5", str(WORKER), "fail", str(tmp_path),
    ]
    env = child_env()
    env["TORCHELASTIC_ERROR_FILE"] = str(tmp_path / "error.json")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=FAIL_JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"job hung for {FAIL_JOB_TIMEOUT_S} s after a rank raised:\n{out[-4000:]}")
    ended = time.time()
    assert proc.returncode != 0, out[-4000:]
    # Rank 1's own traceback ends with its original error ...
    assert "[rank1]: ValueError: sentinel-rank1-exploded" in out, out[-4000:]
    assert "pretrain failed with ValueError: sentinel-rank1-exploded" in out
    # ... although its (sabotaged) abort failed: that is only logged, never raised.
    assert "abort failed (sabotaged abort)" in out, out[-4000:]
    assert "RuntimeError: sabotaged abort" not in out
    raised_at = float((tmp_path / "raise_time").read_text())
    assert ended - raised_at < EXIT_AFTER_RAISE_BOUND_S, f"{ended - raised_at:.1f} s to exit"
    print(f"job exited {ended - raised_at:.1f} s after rank 1 raised (rc={proc.returncode})")


class _Graph:
    """Stands in for torch.cuda.CUDAGraph: records reset()."""

    def __init__(self) -> None:
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1


def test_graphs_are_destroyed_and_remembered(monkeypatch):
    """[Note: graphs before communicators]: every stored graph is reset and dropped, its output
    too, and the stage is remembered for the run report written after teardown."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    training, validation = _Graph(), _Graph()
    monkeypatch.setattr(FullCudaGraphWrapper, "cuda_graph", {"training": training, "validation": validation})
    monkeypatch.setattr(FullCudaGraphWrapper, "result", {"training": object(), "validation": object()})
    monkeypatch.setattr(teardown, "destroyed_graph_stages", set())
    assert teardown.release_cuda_graphs(synchronize=False) == 2
    assert (training.resets, validation.resets) == (1, 1)
    assert FullCudaGraphWrapper.cuda_graph == {"training": None, "validation": None}
    assert FullCudaGraphWrapper.result == {"training": None, "validation": None}
    assert teardown.destroyed_graph_stages == {"training", "validation"}
    assert teardown.release_cuda_graphs(synchronize=False) == 0  # idempotent


def test_run_report_knows_a_graph_that_teardown_destroyed(monkeypatch):
    """The run report is written after pretrain()'s teardown destroyed the graph: it must still
    say that a graph was captured (the benchmark refuses a graphed run that captured none)."""
    import torch

    from hfsdp.training import run_report
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    monkeypatch.setattr(FullCudaGraphWrapper, "cuda_graph", {"training": _Graph(), "validation": None})
    monkeypatch.setattr(teardown, "destroyed_graph_stages", set())
    for name, value in (("max_memory_allocated", 1), ("max_memory_reserved", 2), ("get_device_name", "cpu")):
        monkeypatch.setattr(torch.cuda, name, lambda value=value: value)
    monkeypatch.setattr(run_report, "pool_bytes_held", lambda: 0)
    monkeypatch.setattr(run_report, "maxpool_stats", lambda model: None)
    report = run_report.collect()
    assert report["cuda_graph_captured"] is True
    # The optional packages and the optimizer / multi-tensor / gradient-accumulation paths Megatron took.
    assert set(report["optional_packages"]) == {"transformer-engine", "apex", "mamba-ssm", "causal-conv1d"}
    assert set(report["megatron_paths"]) == {"optimizer", "multi_tensor", "mamba_conv",
                                                "gradient_accumulation_fusion", "layer_norm"}
    teardown.release_cuda_graphs(synchronize=False)
    assert FullCudaGraphWrapper.cuda_graph["training"] is None
    assert run_report.collect()["cuda_graph_captured"] is True
    monkeypatch.setattr(teardown, "destroyed_graph_stages", set())
    assert run_report.collect()["cuda_graph_captured"] is False


def test_megatrons_pretrain_is_decorated_and_can_step_aside():
    """The hook in training.py: Megatron's own pretrain() runs inside the teardown wrapper, and still
    takes the in-process restart argument the wrapper reads to step aside."""
    import inspect

    from megatron.training import training

    assert training.pretrain.__code__.co_filename.endswith("megatron/training/teardown.py")
    assert inspect.unwrap(training.pretrain).__code__.co_filename.endswith("megatron/training/training.py")
    assert "inprocess_call_wrapper" in inspect.signature(training.pretrain).parameters
