"""The buffer rules double_buffer.plan exposes, and that ParamAndGradBuffer obeys them. CPU only.

The offline planner calls the same functions (hfsdp/planner/layout.py), so these rules are
the single source for what each allocator is asked for.
"""

import pytest
import torch

import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.dtypes as bd
import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.plan as mp
import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as pgb
from megatron.training.ddp_bucket_size import default_bucket_size


@pytest.mark.parametrize(
    "group_dtype, main, comm, weight, grad, alloc",
    [
        (torch.bfloat16, None, None, "torch.bfloat16", "torch.bfloat16", "torch.bfloat16"),
        (torch.bfloat16, torch.float32, None, "torch.bfloat16", "torch.float32", "torch.float32"),
        (torch.bfloat16, torch.float32, torch.bfloat16,
         "torch.bfloat16", "torch.float32", "torch.bfloat16"),
        ("float8", None, None, "torch.uint8", "torch.bfloat16", "torch.bfloat16"),
        ("float8", torch.float32, None, "torch.uint8", "torch.float32", "torch.float32"),
        (torch.float32, None, torch.bfloat16, "torch.float32", "torch.float32", "torch.bfloat16"),
    ],
)
def test_dtype_rules_and_the_runtime_agree(group_dtype, main, comm, weight, grad, alloc):
    assert mp.planned_dtype_name(group_dtype) == weight
    assert mp.grad_dtype_name(group_dtype, main) == grad
    assert mp.grad_alloc_dtype_name(grad, comm) == alloc
    # The torch-level helpers ParamAndGradBuffer calls are these rules, names turned into dtypes.
    param_dtype = torch.uint8 if group_dtype == "float8" else group_dtype
    group = pgb.ParameterGroup(params=[torch.nn.Parameter(torch.zeros(4, dtype=param_dtype),
                                                          requires_grad=False)],
                               dtype=group_dtype)
    assert str(bd.planned_param_dtype(group)) == weight
    group.grad_dtype = bd.resolve_grad_dtype(group, main)
    assert str(group.grad_dtype) == grad
    assert str(bd.grad_alloc_dtype(group, comm)) == alloc


def test_dtype_from_name_rejects_unknown_names():
    assert bd.dtype_from_name("torch.float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype name 'torch.float77'"):
        bd.dtype_from_name("torch.float77")


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(bucket_size=None, num_buckets=None, dp_size=8), 40_000_000),
        (dict(bucket_size=None, num_buckets=None, dp_size=64), 64_000_000),
        (dict(bucket_size=123, num_buckets=None, dp_size=64), 123),
        (dict(bucket_size=123, num_buckets=4, dp_size=64), 250),  # num_buckets wins
    ],
)
def test_default_bucket_size(kwargs, expected):
    size = default_bucket_size(num_parameters=1000, overlap_grad_reduce=True, **kwargs)
    assert size == expected
    assert default_bucket_size(num_parameters=1000, overlap_grad_reduce=False, **kwargs) is None


@pytest.mark.parametrize(
    "numel, align, itemsize, expected",
    [(1, 256, 2, 128), (128, 256, 2, 128), (129, 256, 2, 256), (5, 256, 4, 64), (7, 1, 4, 7),
     (3, 3, 2, 4)],
)
def test_alignment(numel, align, itemsize, expected):
    assert mp.aligned_numel(numel, align, itemsize) == expected
