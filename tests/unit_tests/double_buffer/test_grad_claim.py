"""GradReducePipeline.claim_grad_bucket and the double-buffer drain behind it, on CPU.

The getter runs once per parameter per micro-batch; the limit (which may drain queued
reduce-scatters) must run exactly when a grad bucket takes a buffer, not on every read.
The drain tests run the real _enforce_double_buffer_limit with fake streams/events, so the
stream-ordering fix (the consumer waits on every drained reduce-scatter) is checked as data.
"""

from types import SimpleNamespace

import pytest

from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy import DoubleBufferPolicy
from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
    BucketStatus,
    GradReducePipeline,
)


def pipeline(double_buffer=True, buckets=(0, 1)):
    pipe = object.__new__(GradReducePipeline)
    pipe.buffer = SimpleNamespace(
        ddp_config=SimpleNamespace(fsdp_double_buffer=double_buffer),
        double_buffer_policy=DoubleBufferPolicy(double_buffer=double_buffer),
    )
    pipe.bucket_status = {b: BucketStatus.EMPTY for b in buckets}
    pipe.enforced = []
    pipe._enforce_double_buffer_limit = lambda add: pipe.enforced.append(list(add))
    return pipe


def test_limit_runs_once_per_bucket_life():
    pipe = pipeline()
    for _ in range(4):  # four parameters of bucket 0
        pipe.claim_grad_bucket(0)
    pipe.claim_grad_bucket(1)
    pipe.claim_grad_bucket(1)
    assert pipe.enforced == [[0], [1]]
    assert pipe.bucket_status == {0: BucketStatus.READY_TO_USE, 1: BucketStatus.READY_TO_USE}
    # Reduce-scatter in flight: the bucket still holds its buffer, nothing to enforce.
    pipe.bucket_status[0] = BucketStatus.COMMUNICATING
    pipe.claim_grad_bucket(0)
    assert pipe.enforced == [[0], [1]]
    # free_up_grad_bucket / reset mark it EMPTY: the next read is a new life.
    pipe.bucket_status[0] = BucketStatus.EMPTY
    pipe.claim_grad_bucket(0)
    assert pipe.enforced == [[0], [1], [0]]


@pytest.mark.parametrize("double_buffer,bucket", [(False, 0), (True, 7)])
def test_untracked_cases_keep_enforcing_every_read(double_buffer, bucket):
    """No double buffer (the limit is a no-op) or a bucket the pipeline does not track:
    behave exactly as before the fast path (call the limit, record nothing)."""
    pipe = pipeline(double_buffer=double_buffer)
    pipe.claim_grad_bucket(bucket)
    pipe.claim_grad_bucket(bucket)
    assert pipe.enforced == [[bucket], [bucket]]
    assert set(pipe.bucket_status.values()) == {BucketStatus.EMPTY}


class FakeStream:
    """Records the events it is made to wait on (CUDA stream ordering, as data)."""

    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_event(self, event):
        self.waited.append(event.name)


class FakeEvent:
    def __init__(self, name, streams):
        self.name, self.streams = name, streams

    def wait(self):  # torch.cuda.Event.wait(): the *current* stream waits
        self.streams[-1].waited.append(self.name)


@pytest.fixture
def fake_cuda(monkeypatch):
    import contextlib

    import torch

    compute = FakeStream("compute")
    current = [compute]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return compute, current


def drain_pipeline(units_in_queue, fake_cuda, bucket_units, live_unit_limit=2):
    """A pipeline whose reduce-scatter queue holds one entry per bucket, oldest first."""
    compute, current = fake_cuda
    pipe = object.__new__(GradReducePipeline)
    pipe.buffer = SimpleNamespace(
        ddp_config=SimpleNamespace(fsdp_double_buffer=True),
        double_buffer_policy=DoubleBufferPolicy(double_buffer=True),
        parameter_groups=[SimpleNamespace(fsdp_unit_id=u) for u in bucket_units],
        double_buf_units=set(bucket_units),
        num_buckets=len(bucket_units),
        live_unit_limit=live_unit_limit,
    )
    pipe.rs_stream = FakeStream("rs")
    pipe.freed = []
    pipe.grad_reduce_queue = [
        (FakeEvent(f"rs{b}", current), (lambda b=b: pipe.freed.append(b)), b)
        for b in units_in_queue
    ]
    pipe.bucket_status = {b: BucketStatus.EMPTY for b in range(len(bucket_units))}
    return pipe


def test_drain_keeps_one_in_flight_unit_and_orders_the_consumer(fake_cuda):
    """Wgrad race (fork fix): taking unit 2's grad buffer drains units 5 and 4 (keeping unit 3's
    reduce-scatter in flight), and the compute stream that will overwrite the recycled
    buffers waits on each drained event, not only the reduce-scatter stream."""
    compute, _ = fake_cuda
    bucket_units = [0, 1, 2, 3, 4, 5]  # bucket b belongs to unit b
    pipe = drain_pipeline([5, 4, 3], fake_cuda, bucket_units)
    pipe.claim_grad_bucket(2)
    assert pipe.freed == [5, 4]
    assert pipe.rs_stream.waited == ["rs5", "rs4"]
    assert compute.waited == ["rs5", "rs4"]
    assert [b for _, _, b in pipe.grad_reduce_queue] == [3]
    # Reads of the now-live bucket do not drain again (unit 3 stays in flight).
    pipe.claim_grad_bucket(2)
    assert pipe.freed == [5, 4] and compute.waited == ["rs5", "rs4"]


def test_drain_counts_a_multi_bucket_unit_once(fake_cuda):
    compute, _ = fake_cuda
    bucket_units = [0, 1, 1, 2, 2]  # units 1 and 2 have two buckets each
    pipe = drain_pipeline([3, 4, 1, 2], fake_cuda, bucket_units)  # unit 2, then unit 1
    pipe.claim_grad_bucket(0)
    assert pipe.freed == [3, 4]  # both buckets of unit 2 (the older unit)
    assert compute.waited == ["rs3", "rs4"]
    assert [b for _, _, b in pipe.grad_reduce_queue] == [1, 2]
