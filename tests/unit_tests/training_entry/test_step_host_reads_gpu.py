"""On a GPU: the step's statistics are kept without a stream sync ([Note: host reads in a step]), and
``HFSDP_HOST_READS_EVERY_STEP=1`` brings upstream's syncs back. CUDA's sync debug mode raises on a
synchronizing call, so each case runs with it set to "error"."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from megatron.core import step_host_reads as shr

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

EVERY_STEP = {shr.ENV: "1"}


@contextlib.contextmanager
def syncs_raise():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def norm_after_work() -> torch.Tensor:
    """A norm queued behind enough work that a read would wait for it."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        x = x @ x / 64
    return torch.linalg.vector_norm(x).reshape(1)


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)


def must_not_run(stat, **kwargs):
    raise AssertionError("upstream's reduction ran")


def test_kept_statistics_do_not_sync(one_rank):
    norm = norm_after_work()
    with syncs_raise():
        assert shr.norm_exceeds(norm, math.inf, {}) is False
        assert shr.all_ranks(True, must_not_run, group=object(), environ={}) is True
        assert shr.max_device_stat(norm, must_not_run, group=object(), environ={}) is norm
        assert shr.max_stat(1e-4, must_not_run, group=object(), environ={}) == pytest.approx(1e-4)
        scale = shr.loss_scale(torch.ones(1, device="cuda"), {})
        total = shr.new_sum({}) + norm
    assert shr.host_stat(total) == shr.host_stat(norm)
    assert shr.host_float(scale) == 1.0


@pytest.mark.parametrize("read", [
    lambda norm: shr.norm_exceeds(norm, math.inf, EVERY_STEP),
    lambda norm: shr.norm_exceeds(norm, 1e6, {}),  # a finite threshold compares, as upstream
    lambda norm: shr.loss_scale(torch.ones(1, device="cuda"), EVERY_STEP),
    lambda norm: shr.new_sum(EVERY_STEP),
    lambda norm: shr.host_stat(norm),  # where training_log writes the norm
], ids=["skip-check", "finite-threshold", "loss-scale", "accumulator", "log-read"])
def test_reads_that_remain_sync(one_rank, read):
    norm = norm_after_work()
    with syncs_raise(), pytest.raises(RuntimeError, match="synchroniz"):
        read(norm)


@pytest.fixture
def one_rank_nccl():
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    yield
    dist.destroy_process_group()


def test_duration_vote_is_read_one_step_late_without_a_sync(one_rank_nccl):
    vote = shr.DurationVote()
    norm_after_work()
    with syncs_raise():
        answers = [vote(over, environ={}) for over in (False, True, False, False)]
    assert answers == [False, False, True, False]
    vote(True, environ={})
    vote.reset()  # train() starts here: a new training has no answer yet
    assert vote(False, environ={}) is False
    with syncs_raise(), pytest.raises(RuntimeError, match="synchroniz"):
        vote(True, environ=EVERY_STEP)  # upstream's read, this step
