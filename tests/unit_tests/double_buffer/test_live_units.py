"""One constant, double_buffer.plan.NUM_BUFFER_GROUPS, sets every live-unit limit ([Note: double buffer],
live units).

The test changes only that constant (to 3) and then checks every place that bounds how many
FSDP units may hold double-buffer memory: the plans' byte counts, MaxPoolAllocator's and
FixedPoolAllocator's group counts, ParamAndGradBuffer.live_unit_limit (a real buffer, built
on CPU over a fake 2-rank process group), the all-gather request check, the prefetch loop and
the grad double-buffer drain. A deeper pool is therefore a change to one module.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.dtypes as bd
import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.plan as mp
import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as pgb
from hfsdp.planner import compare
from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import MaxPoolAllocator

UNITS = 5


class Layer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(8, width, bias=False)


class Stack(torch.nn.Module):
    """Five units of three shapes after a non-unit embedding."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.layers = torch.nn.ModuleList(Layer(w) for w in (16, 24, 16, 40, 16))


@pytest.fixture
def three_groups(monkeypatch):
    monkeypatch.setattr(mp, "NUM_BUFFER_GROUPS", 3)


@pytest.fixture
def real_buffer(cpu_fsdp_buffer):
    """A real ParamAndGradBuffer of Stack on CPU (tests/unit_tests/conftest.py)."""

    def build(**ddp_kwargs):
        torch.manual_seed(0)
        return cpu_fsdp_buffer(Stack(), [Layer], **ddp_kwargs)

    return build


def unit_buckets(buffer):
    out: dict[int, list[int]] = {}
    for bucket_id, group in enumerate(buffer.parameter_groups):
        if group.fsdp_unit_id is not None:
            out.setdefault(group.fsdp_unit_id, []).append(bucket_id)
    return out


def specs():
    return [mp.BucketSpec(bucket_id=u, unit_id=u, dtype="torch.bfloat16", numel=n, itemsize=2)
            for u, n in enumerate((1000, 3000, 1000, 2000))]


def test_plans_count_bytes_with_the_constant(three_groups):
    two = {"maxpool": mp.plan_max_pool(specs(), num_groups=2).pool_bytes(),
           "ranked": compare.plan_rank_matched(specs(), num_groups=2).pool_bytes(),
           "minimum": compare.analytic_minimum_bytes(specs(), num_groups=2),
           "fixed": compare.fixed_pool_outliers(specs(), num_groups=2).pool_bytes}
    plan = mp.plan_max_pool(specs())
    assert plan.num_groups == 3
    three = {"maxpool": plan.pool_bytes(),
             "ranked": compare.plan_rank_matched(specs()).pool_bytes(),
             "minimum": compare.analytic_minimum_bytes(specs()),
             "fixed": compare.fixed_pool_outliers(specs()).pool_bytes}
    assert all(three[k] * 2 == two[k] * 3 for k in two), (two, three)
    assert three["maxpool"] == 3 * 3000 * 2  # three groups of the largest unit (bf16)
    assert "(3 groups)" in mp.format_plan(plan)[0]


def test_a_pool_needs_two_groups():
    with pytest.raises(ValueError, match="buffer groups >= 2, got 1"):
        mp.plan_max_pool(specs(), num_groups=1)
    with pytest.raises(ValueError, match="got 1"):
        MaxPoolAllocator("fsdp_params", [], size=1)


@pytest.mark.parametrize("max_pool", [True, False], ids=["maxpool", "fixedpool"])
def test_buffer_limits_follow_the_constant(three_groups, real_buffer, max_pool):
    buffer = real_buffer(megatron_fsdp_max_pool_double_buffer=max_pool)
    expected = MaxPoolAllocator if max_pool else pgb.FixedPoolAllocator
    assert isinstance(buffer.weight_alloc, expected)
    assert buffer.weight_alloc.size == buffer.main_grad_alloc.size == 3
    assert buffer.live_unit_limit == 3
    assert len(unit_buckets(buffer)) == UNITS


def test_default_is_two(real_buffer):
    buffer = real_buffer(megatron_fsdp_max_pool_double_buffer=True)
    assert mp.NUM_BUFFER_GROUPS == buffer.live_unit_limit == buffer.weight_alloc.size == 2
    units = unit_buckets(buffer)
    pipe = gather_pipeline(buffer)
    pipe.all_gather_params(unit_params(buffer, 0), prefetch=True)
    assert pipe.bucket_status.looked_up == units[0] + units[1]


def test_allocator_holds_one_live_unit_per_group(three_groups, real_buffer):
    buffer = real_buffer(megatron_fsdp_max_pool_double_buffer=True)
    alloc, units = buffer.weight_alloc, unit_buckets(buffer)

    def take(unit):
        for b in units[unit]:
            group = buffer.parameter_groups[b]
            alloc.allocate(b, group.model_weight_buffer.bucket_index.size,
                           bd.planned_param_dtype(group), torch.device("cpu"))

    for unit in range(3):
        take(unit)
    assert alloc.group_owner == {0: 0, 1: 1, 2: 2}
    with pytest.raises(RuntimeError, match=r"no idle buffer group for unit 3.*More than 3 units"):
        take(3)


class RecordingStatus(dict):
    """bucket_status that records which buckets the gather looked up after prefetch."""

    def __init__(self):
        super().__init__()
        self.looked_up: list[int] = []

    def __getitem__(self, key):
        self.looked_up.append(key[0])
        return pgb.BucketStatus.READY_TO_USE  # nothing to gather: return before any collective


def gather_pipeline(buffer):
    pipe = object.__new__(pgb.AllGatherPipeline)
    pipe.buffer = buffer
    pipe.bucket_can_be_released = {}
    pipe.bucket_status = RecordingStatus()
    return pipe


def unit_params(buffer, unit):
    return [p for b in unit_buckets(buffer)[unit] for p in buffer.parameter_groups[b].params]


def test_gather_request_and_prefetch_follow_the_constant(three_groups, real_buffer):
    buffer = real_buffer(megatron_fsdp_max_pool_double_buffer=True)
    units = unit_buckets(buffer)
    pipe = gather_pipeline(buffer)
    pipe.all_gather_params(unit_params(buffer, 0), prefetch=True)
    # The request plus prefetch reach exactly three units, the third unit's buckets last.
    assert pipe.bucket_status.looked_up == units[0] + units[1] + units[2]
    pipe.all_gather_params([p for u in range(3) for p in unit_params(buffer, u)])
    with pytest.raises(ValueError, match="no more than 3 FSDP units"):
        pipe.all_gather_params([p for u in range(4) for p in unit_params(buffer, u)])


def drain_pipeline(buffer, monkeypatch, queued):
    """A GradReducePipeline whose queue holds ``queued`` units' reduce-scatters (oldest first);
    freed buckets are recorded in ``pipe.freed``. Streams are CPU stand-ins."""
    units = unit_buckets(buffer)
    streams = [SimpleNamespace(wait_event=lambda event: None)]

    @contextlib.contextmanager
    def stream(s):
        streams.append(s)
        yield
        streams.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: streams[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    pipe = object.__new__(pgb.GradReducePipeline)
    pipe.buffer = buffer
    pipe.rs_stream = SimpleNamespace(wait_event=lambda event: None)
    pipe.freed = []
    pipe.grad_reduce_queue = [
        (SimpleNamespace(wait=lambda: None), (lambda b=b: pipe.freed.append(b)), b)
        for u in queued for b in units[u]
    ]
    return pipe


def test_grad_drain_follows_the_constant(three_groups, real_buffer, monkeypatch):
    buffer = real_buffer(megatron_fsdp_max_pool_double_buffer=True)
    units = unit_buckets(buffer)
    # Backward order: units 4, 3, 2 have reduce-scatters queued, oldest first.
    pipe = drain_pipeline(buffer, monkeypatch, queued=(4, 3, 2))
    pipe._enforce_double_buffer_limit(units[1])
    # Unit 1 plus two in-flight units (3 and 2) fit three groups: only unit 4 drains.
    assert pipe.freed == units[4]
    assert [b for _, _, b in pipe.grad_reduce_queue] == units[3] + units[2]
    # A request for grads of three units at once is within the limit, four are not.
    pipe.grad_reduce_queue = []
    pipe._enforce_double_buffer_limit([b for u in range(3) for b in units[u]])
    with pytest.raises(AssertionError, match="Double buffer limit exceeded"):
        pipe._enforce_double_buffer_limit([b for u in range(4) for b in units[u]])
