"""GradReducePipeline.claim_grad_bucket: the main_grad getter's double-buffer gate.

The getter runs once per parameter per micro-batch; the limit (which may drain queued
reduce-scatters) must run exactly when a grad bucket takes a buffer, not on every read.
"""

from types import SimpleNamespace

import pytest

from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
    BucketStatus,
    GradReducePipeline,
)


def pipeline(double_buffer=True, buckets=(0, 1)):
    pipe = object.__new__(GradReducePipeline)
    pipe.buffer = SimpleNamespace(ddp_config=SimpleNamespace(fsdp_double_buffer=double_buffer))
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
