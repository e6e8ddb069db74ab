"""The planner's bucket layout and pool choices equal what ParamAndGradBuffer computes.

ParamAndGradBuffer is constructed for real on CPU by ``cpu_fsdp_buffer`` (a fake process group
of 2 ranks, tests/unit_tests/conftest.py), so DP=2. The planner runs the same
module through ``compute_layout``; every bucket's unit, dtype, chunk factor and padded size, the
FixedPool's pooled units, and the MaxPool allocator's plan must match exactly.
"""

from __future__ import annotations

import pytest
import torch

import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as pgb
from hfsdp.planner import layout as L
from hfsdp.planner import report as R

DP = 2  # the fake world of cpu_fsdp_buffer (tests/unit_tests/conftest.py)


class Unit(torch.nn.Module):
    def __init__(self, d_in: int, d_hidden: int, experts: int = 0):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_in, bias=False)
        if experts:
            self.experts = torch.nn.ModuleList(torch.nn.Linear(d_in, 5) for _ in range(experts))
        self.norm = torch.nn.LayerNorm(d_in).float()  # second dtype inside a unit


class Asymmetric(torch.nn.Module):
    """Embedding (non-unit) + units of three shapes; odd sizes exercise DP padding."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(37, 12)
        self.layers = torch.nn.ModuleList(
            [Unit(12, 33), Unit(12, 7), Unit(12, 33), Unit(12, 19, experts=2), Unit(12, 33)])
        self.head = torch.nn.Linear(12, 11)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = Asymmetric()
    for name, p in m.named_parameters():
        if not name.endswith(("norm.weight", "norm.bias")):
            p.data = p.data.to(torch.bfloat16)
    return m


def test_layout_equals_runtime_buckets(cpu_fsdp_buffer):
    planned = L.compute_layout(_model(), unit_classes=[Unit], strategy="optim_grads_params",
                               dp_size=DP, expert_dp_size=DP)
    buf = cpu_fsdp_buffer(_model(), [Unit])
    assert len(planned.buckets) == len(buf.parameter_groups)
    for row, group in zip(planned.buckets, buf.parameter_groups, strict=True):
        wbuf = group.model_weight_buffer
        assert (row.unit_id, row.dtype, row.is_expert, row.chunk_size_factor) == (
            group.fsdp_unit_id, str(group.dtype), group.is_expert_param, group.chunk_size_factor)
        assert row.numel == wbuf.bucket_index.size, (row, wbuf.bucket_index)
        assert row.numel == group.main_grad_buffer.bucket_index.size
        assert row.unpadded_numel == sum(p.numel() for p in group.params)
    # Padding is real here (odd sizes, DP=2), so the test would catch unpadded planning.
    assert any(r.numel != r.unpadded_numel for r in planned.buckets)
    assert [u.cls for u in planned.units] == ["Unit"] * 5
    assert [u.name for u in planned.units] == [f"layers.{i}" for i in range(5)]


def test_fixed_pool_choice_equals_runtime(cpu_fsdp_buffer):
    planned = L.compute_layout(_model(), unit_classes=[Unit], strategy="optim_grads_params",
                               dp_size=DP, expert_dp_size=DP)
    buf = cpu_fsdp_buffer(_model(), [Unit])
    alloc = buf.weight_alloc
    assert isinstance(alloc, pgb.FixedPoolAllocator), type(alloc)  # the default double buffer
    fixed = R.plan_allocator(planned, "weight")["fixed_pool"]
    assert sorted(alloc.fsdp_double_buffer_units) == list(fixed.pooled_unit_ids) == [0, 2, 4]
    assert fixed.outlier_unit_ids == (1, 3)


def test_maxpool_plan_equals_runtime_allocator(cpu_fsdp_buffer):
    planned = L.compute_layout(_model(), unit_classes=[Unit], strategy="optim_grads_params",
                               dp_size=DP, expert_dp_size=DP)
    buf = cpu_fsdp_buffer(_model(), [Unit], megatron_fsdp_max_pool_double_buffer=True)
    for alloc_name, kind in (("weight_alloc", "weight"), ("main_grad_alloc", "grad")):
        alloc = getattr(buf, alloc_name)
        runtime_plan = alloc.plan
        assert runtime_plan is not None, f"{alloc_name} ({type(alloc).__name__}) planned nothing"
        mine = R.plan_allocator(planned, kind, align_bytes=runtime_plan.align_bytes,
                                main_grads_dtype=buf.mp_policy.main_grads_dtype,
                                grad_comm_dtype=buf.mp_policy.grad_comm_dtype)["maxpool"]
        assert mine.arena_numel == runtime_plan.arena_numel, alloc_name
        assert mine.offsets == runtime_plan.offsets, alloc_name
        assert mine.unit_ids == runtime_plan.unit_ids, alloc_name
        assert mine.pool_bytes() == runtime_plan.pool_bytes(), alloc_name


def test_lane_plans_equal_runtime_allocators(cpu_fsdp_buffer):
    """The planner's N-lane plan is the plan the allocators hold with
    megatron_fsdp_max_pool_lanes=N: the same function (runtime_lane_plan) on the same buckets."""
    planned = L.compute_layout(_model(), unit_classes=[Unit], strategy="optim_grads_params",
                               dp_size=DP, expert_dp_size=DP)
    for lanes in (2, 3, 5):
        buf = cpu_fsdp_buffer(_model(), [Unit], megatron_fsdp_max_pool_double_buffer=True,
                              megatron_fsdp_max_pool_lanes=lanes)
        for alloc_name, kind in (("weight_alloc", "weight"), ("main_grad_alloc", "grad")):
            alloc = getattr(buf, alloc_name)
            mine = R.plan_allocator(planned, kind, align_bytes=alloc.plan.align_bytes, lanes=(lanes,),
                                    main_grads_dtype=buf.mp_policy.main_grads_dtype,
                                    grad_comm_dtype=buf.mp_policy.grad_comm_dtype)["lanes"][lanes]
            assert alloc.size == buf.live_unit_limit == lanes
            if lanes == 2:  # today's allocator and plan, which the shared lanes equal byte for byte
                assert type(alloc) is pgb.MaxPoolAllocator
                assert {d: n for (_, d), n in mine.arena_numel.items()} == alloc.plan.arena_numel
                assert mine.offsets == alloc.plan.offsets
            else:
                assert mine == alloc.plan, (alloc_name, lanes)
            assert mine.pool_bytes() == alloc.plan.pool_bytes() == alloc.stats()["pool_bytes_planned"]


def test_too_many_lanes_is_refused_in_the_runtimes_words(cpu_fsdp_buffer):
    """--megatron-fsdp-max-pool-lanes above the unit count: the planner refuses it with the sentence
    the allocators raise when training builds the buffer."""
    from hfsdp.planner import cli
    from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.lanes import MaxPoolLanesError

    planned = L.compute_layout(_model(), unit_classes=[Unit], strategy="optim_grads_params",
                               dp_size=DP, expert_dp_size=DP)
    with pytest.raises(MaxPoolLanesError) as raised:
        cpu_fsdp_buffer(_model(), [Unit], megatron_fsdp_max_pool_double_buffer=True, megatron_fsdp_max_pool_lanes=7)
    mine = R.lanes_units_problem(planned, 7, cli.training_lanes_setting())
    assert mine is not None and "7 lanes, more than the 5 FSDP units" in mine
    assert str(raised.value).endswith(f"] {mine}"), (str(raised.value), mine)
