"""LaneMaxPoolAllocator on CPU: plan-fixed homes, N live units, prefetch gate and grad drain at
N, fatal home misses after capture, and 2 lanes left exactly as the shared pool.

[Note: double buffer], lanes and homes, in megatron_fsdp/double_buffer/__init__.py. The fake global
memory buffer comes from test_maxpool_allocator, the CPU ParamAndGradBuffer from tests/unit_tests/conftest.py.
"""

from __future__ import annotations

import pytest
import torch
from test_live_units import (  # sibling modules: same fakes as the shared-pool tests
    Layer,
    Stack,
    drain_pipeline,
    gather_pipeline,
    unit_buckets,
    unit_params,
)
from test_maxpool_allocator import (
    CPU,
    alloc_unit,
    free_unit,
    group,
    install_cpu_memory_buffer,
    padded,
    units_of,
)

import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.allocator as mpa
import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.plan as mp
from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.lanes import MaxPoolLanesError
from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
    LaneMaxPoolAllocator,
    MaxPoolAllocator,
)


@pytest.fixture
def gmb(monkeypatch):
    return install_cpu_memory_buffer(monkeypatch)


def hybrid_groups(layers=2):
    """An embedding, then ``layers`` x (Mamba: bf16 + fp32 buckets, attention, MoE: 2 buckets)."""
    groups = [group(None, 5000)]
    for layer in range(layers):
        m, a, e = 3 * layer, 3 * layer + 1, 3 * layer + 2
        groups += [group(m, 900), group(m, 16, torch.float32), group(a, 700), group(e, 300),
                   group(e, 1100)]
    return groups + [group(None, 64)]


def make(groups, lanes=3, **kw):
    return LaneMaxPoolAllocator("fsdp_params", groups, size=lanes, numel_fn=padded, **kw)


def sliding_iteration(alloc, groups, live):
    """Forward then backward, keeping ``live`` consecutive units allocated, like the hooks with
    prefetch N-1 ahead. Returns every bucket's data pointer per phase."""
    units = units_of(groups)
    order = sorted(units)
    ptrs = {}
    for phase in (order, order[::-1]):
        window: list[int] = []
        for u in phase:
            views = alloc_unit(alloc, groups, units[u])
            ptrs.update({(phase[0], b): t.data_ptr() for b, t in views.items()})
            window.append(u)
            if len(window) == live:
                free_unit(alloc, units[window.pop(0)])
        for u in window:
            free_unit(alloc, units[u])
    return ptrs


def test_homes_are_the_plans_lanes_and_stay_put(gmb):
    groups = hybrid_groups()
    alloc = make(groups)
    plan = alloc.plan
    assert alloc.home == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2}  # fixed before any allocation
    # Init-time fetches (strict_assignments=False) land in the home lane too.
    for buckets in units_of(groups).values():
        alloc_unit(alloc, groups, buckets, strict=False)
        free_unit(alloc, buckets)
    first = sliding_iteration(alloc, groups, live=3)
    for _ in range(2):
        assert sliding_iteration(alloc, groups, live=3) == first
    stats = alloc.stats()
    assert stats["home_misses"] == 0
    # Each unit's buckets sit at the planned offsets of its own lane's arena.
    for unit, buckets in units_of(groups).items():
        lane = unit % 3
        for b in buckets:
            dtype, offset = plan.offsets[b]
            arena = alloc.arenas[(lane, dtype)]
            assert first[(0, b)] == arena.data_ptr() + offset * arena.element_size(), (unit, b)
    # Lane j holds one layer kind: Mamba 1024 bf16 + 128 fp32, attention 768, MoE 384 + 1152.
    assert plan.arena_numel == {(0, "torch.bfloat16"): 1024, (0, "torch.float32"): 128,
                                (1, "torch.bfloat16"): 768, (2, "torch.bfloat16"): 1536}
    assert stats["pool_bytes_planned"] == plan.pool_bytes() == (1024 + 768 + 1536) * 2 + 128 * 4
    assert stats["pool_bytes_allocated"] == stats["pool_bytes_planned"]
    # The shared pool of 3 groups would hold three MoE units: lanes are smaller.
    shared = mp.plan_max_pool(alloc.bucket_specs(), num_groups=3)
    assert plan.pool_bytes() < shared.pool_bytes() == 3 * (1536 * 2 + 128 * 4)
    assert plan == mp.runtime_lane_plan(alloc.bucket_specs(), lanes=3)


def test_n_units_live_then_one_more_is_the_limit_error(gmb):
    groups = hybrid_groups()
    units = units_of(groups)
    alloc = make(groups)
    for u in range(3):
        alloc_unit(alloc, groups, units[u])
    assert alloc.group_owner == {0: 0, 1: 1, 2: 2}
    with pytest.raises(RuntimeError, match=r"no idle buffer group for unit 3.*More than 3 units"):
        alloc_unit(alloc, groups, units[3])


def bf16_units(*sizes):
    return [group(u, n) for u, n in enumerate(sizes)]


def test_home_miss_falls_back_before_capture_and_is_fatal_after(gmb):
    # Lanes at N=3: {0, 3} -> 128 elems, {1, 4} -> 1024, {2} -> 384.
    groups = bf16_units(100, 1000, 300, 50, 900)
    units = units_of(groups)
    for fail in (False, True):
        alloc = make(groups, fail_on_home_miss=fail)
        alloc_unit(alloc, groups, units[0])  # lane 0
        if fail:
            with pytest.raises(RuntimeError, match="home miss #1: unit 3 home group 0 is owned by unit 0"):
                alloc_unit(alloc, groups, units[3])
            continue
        views = alloc_unit(alloc, groups, units[3])  # home lane 0 busy: first idle lane that fits
        assert alloc.unit_group[3] == 1 and alloc.stats()["home_misses"] == 1
        assert views[3].data_ptr() == alloc.arenas[(1, "torch.bfloat16")].data_ptr()
        # The home stays the plan's lane: next life, lane 0 is idle again.
        free_unit(alloc, units[0])
        free_unit(alloc, units[3])
        alloc_unit(alloc, groups, units[3])
        assert alloc.unit_group[3] == 0 and alloc.home[3] == 0


def test_init_fetch_falls_back_without_counting_and_too_small_lanes_are_named(gmb):
    groups = bf16_units(100, 1000, 300, 50, 900)
    units = units_of(groups)
    alloc = make(groups)
    alloc_unit(alloc, groups, units[0])
    alloc_unit(alloc, groups, units[3], strict=False)
    assert alloc.unit_group[3] == 1 and alloc.home_misses == 0
    free_unit(alloc, units[3])
    # Unit 4 (900 elems) cannot use lane 2 (384): its home lane 1 busy, nothing fits.
    alloc_unit(alloc, groups, units[1])
    with pytest.raises(RuntimeError, match=r"unit 4: home lane 1 is owned by unit 1 and no idle "
                                           r"lane of \[2\] is large enough"):
        alloc_unit(alloc, groups, units[4])
    assert alloc.home_misses == 0 and 4 not in alloc.unit_group


def test_more_lanes_than_units_are_refused_in_every_spelling():
    """The allocator counts the units it serves (the one count); it cannot tell how the lane count
    was given, so the message names every spelling of it (double_buffer.policy: FIELDS, FLAGS, KEYWORDS)."""
    with pytest.raises(MaxPoolLanesError, match=r"megatron_fsdp_max_pool_lanes \(--megatron-fsdp-max-pool-lanes, "
                                         r"fully_shard: maxpool_lanes\) asks for 4 lanes, more than the 3 FSDP "
                                         r"units of this model chunk, so 1 lane\(s\) would hold no unit; use at "
                                         r"most 3 lanes"):
        make(bf16_units(10, 20, 30), lanes=4)
    assert make(bf16_units(10, 20, 30), lanes=3).size == 3


def test_presize_creates_every_lane_arena_once_at_planned_size(gmb):
    groups = hybrid_groups()
    alloc = make(groups)
    order = alloc.presize(CPU)
    assert order == [(0, "torch.bfloat16", 1024), (0, "torch.float32", 128),
                     (1, "torch.bfloat16", 768), (2, "torch.bfloat16", 1536)]
    assert [(n.rsplit("_maxpool_", 1)[1], k) for n, _, k in gmb.creations] == [
        ("g0_bfloat16", 1024), ("g0_float32", 128), ("g1_bfloat16", 768), ("g2_bfloat16", 1536)]
    sliding_iteration(alloc, groups, live=3)
    assert len(gmb.creations) == 4 and alloc.stats()["home_misses"] == 0


def test_symmetric_registration_fingerprint_covers_the_lanes(gmb):
    """NCCL symmetric staging hashes every allocator's plan and arena order: ranks with
    different lane counts (or a shared pool) must not agree."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.symmetric import plan_fingerprint

    groups = hybrid_groups()
    prints = {plan_fingerprint([make(groups, lanes=n)]) for n in (3, 4, 6)}
    prints.add(plan_fingerprint([MaxPoolAllocator("fsdp_params", groups, numel_fn=padded)]))
    assert len(prints) == 4
    assert plan_fingerprint([make(groups)]) == plan_fingerprint([make(hybrid_groups())])


def test_fail_on_home_miss_reaches_lane_allocators(gmb):
    class Holder(torch.nn.Module):
        def __init__(self, buffer):
            super().__init__()
            self.param_and_grad_buffer = buffer

    buffer = type("B", (), {})()
    buffer.weight_alloc = make(hybrid_groups())
    assert mpa.set_fail_on_home_miss(Holder(buffer)) == [buffer.weight_alloc]
    assert buffer.weight_alloc.fail_on_home_miss


# ------------------------------------------------------ a real ParamAndGradBuffer on CPU
@pytest.fixture
def stack_buffer(cpu_fsdp_buffer):
    def build(**ddp_kwargs):
        torch.manual_seed(0)
        return cpu_fsdp_buffer(Stack(), [Layer], megatron_fsdp_max_pool_double_buffer=True,
                               **ddp_kwargs)

    return build


def test_two_lanes_is_todays_shared_pool_byte_for_byte(stack_buffer):
    default, explicit = stack_buffer(), stack_buffer(megatron_fsdp_max_pool_lanes=2)
    for buf in (default, explicit):
        for attr in ("weight_alloc", "main_grad_alloc"):
            assert type(getattr(buf, attr)) is MaxPoolAllocator, attr
        assert buf.live_unit_limit == buf.weight_alloc.size == 2
    for attr in ("weight_alloc", "main_grad_alloc"):
        a, b = getattr(default, attr), getattr(explicit, attr)
        assert a.plan == b.plan == mp.plan_max_pool(a.bucket_specs())
        shared = mp.runtime_lane_plan(a.bucket_specs(), lanes=2)
        assert shared.pool_bytes() == a.plan.pool_bytes() and shared.offsets == a.plan.offsets
    assert default.weight_alloc.home == {}  # homes recorded at first strict use, as before


@pytest.mark.parametrize("lanes", [3, 4])
def test_buffer_limits_and_prefetch_gate_are_n(stack_buffer, lanes):
    buffer = stack_buffer(megatron_fsdp_max_pool_lanes=lanes)
    for attr in ("weight_alloc", "main_grad_alloc", "transpose_weight_alloc"):
        assert isinstance(getattr(buffer, attr), LaneMaxPoolAllocator), attr
        assert getattr(buffer, attr).size == lanes
    assert buffer.live_unit_limit == lanes
    units = unit_buckets(buffer)
    pipe = gather_pipeline(buffer)
    pipe.all_gather_params(unit_params(buffer, 0), prefetch=True)
    # The request plus prefetch reach exactly N units (prefetch N-1 ahead).
    assert pipe.bucket_status.looked_up == [b for u in range(lanes) for b in units[u]]
    with pytest.raises(ValueError, match=f"no more than {lanes} FSDP units"):
        pipe.all_gather_params([p for u in range(lanes + 1) for p in unit_params(buffer, u)])


@pytest.mark.parametrize("lanes, drained", [(2, (4, 3)), (3, (4,)), (4, ())])
def test_grad_drain_keeps_n_units(stack_buffer, monkeypatch, lanes, drained):
    buffer = stack_buffer(megatron_fsdp_max_pool_lanes=lanes)
    units = unit_buckets(buffer)
    pipe = drain_pipeline(buffer, monkeypatch, queued=(4, 3, 2))
    pipe._enforce_double_buffer_limit(units[1])
    # Unit 1 plus N-1 in-flight units stay; older reduce-scatters drain.
    assert pipe.freed == [b for u in drained for b in units[u]]


def test_more_lanes_than_the_chunks_units_fail_at_build(stack_buffer):
    # Its own type: the training entry points report it as a flag error (one sentence).
    with pytest.raises(MaxPoolLanesError, match="asks for 6 lanes, more than the 5 FSDP units"):
        stack_buffer(megatron_fsdp_max_pool_lanes=6)
