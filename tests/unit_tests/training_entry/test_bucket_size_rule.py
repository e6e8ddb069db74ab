"""get_model buckets as the offline planner does (ddp_bucket_size.default_bucket_size), on either base.

On 0.18.2 get_model calls the planner's function (the training-bucket-size-rule patch). 0.19.2 has
the rule as its own ``training.resolve_ddp_bucket_size``, which is why that patch is not carried
there; so there the two must agree case by case.
"""

from types import SimpleNamespace

import pytest

from megatron.training.ddp_bucket_size import default_bucket_size

CASES = [
    dict(bucket_size=None, num_buckets=None, dp_size=8),
    dict(bucket_size=None, num_buckets=None, dp_size=64),
    dict(bucket_size=123, num_buckets=None, dp_size=64),
    dict(bucket_size=123, num_buckets=4, dp_size=64),
    dict(bucket_size=None, num_buckets=3, dp_size=2),
]


@pytest.mark.parametrize("overlap_grad_reduce", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_get_model_buckets_as_the_planner_does(monkeypatch, case, overlap_grad_reduce):
    from megatron.training import training

    planned = default_bucket_size(num_parameters=1000, overlap_grad_reduce=overlap_grad_reduce, **case)
    resolve = getattr(training, "resolve_ddp_bucket_size", None)
    if resolve is None:  # get_model calls the planner's function itself
        assert training.default_bucket_size is default_bucket_size
        return
    monkeypatch.setattr(training, "get_pg_size", lambda group: case["dp_size"])
    ddp_config = SimpleNamespace(bucket_size=case["bucket_size"], num_buckets=case["num_buckets"])
    assert resolve(ddp_config, None, overlap_grad_reduce, 1000) == planned
