"""Property tests for the N-lane pool plan ([Note: double buffer], lanes and homes, in
double_buffer/__init__.py). CPU only."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_maxpool_plan import bucket_sets, spec  # sibling module: the same bucket generator

from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.plan import (
    format_lane_plan,
    lane_assignment,
    lanes_units_problem,
    plan_lanes,
    plan_max_pool,
    runtime_lane_plan,
)

LANES = st.integers(2, 5)


@settings(max_examples=150, deadline=None)
@given(bucket_sets(), LANES, st.sampled_from([1, 256, 512]))
def test_shared_lanes_are_the_max_pool_plan_byte_for_byte(specs, lanes, align):
    today = plan_max_pool(specs, align_bytes=align, num_groups=lanes)
    shared = plan_lanes(specs, lanes=lanes, assignment="shared", align_bytes=align)
    assert shared.pool_bytes() == today.pool_bytes()
    assert shared.offsets == today.offsets
    for lane in range(lanes):
        assert {d: n for (lane_, d), n in shared.arena_numel.items() if lane_ == lane} == today.arena_numel
        assert {d: u for (lane_, d), u in shared.setter.items() if lane_ == lane} == today.setter


@settings(max_examples=150, deadline=None)
@given(bucket_sets(), LANES)
def test_every_unit_fits_each_of_its_lanes_and_round_robin_is_never_larger(specs, lanes):
    for assignment in ("round_robin", "shared"):
        plan = plan_lanes(specs, lanes=lanes, assignment=assignment)
        for dtype, per_unit in plan.unit_layout_numel.items():
            for unit, numel in per_unit.items():
                for lane in plan.allowed[unit]:
                    assert numel <= plan.arena_numel[(lane, dtype)], (assignment, unit, lane, dtype)
        # An arena exists only where some unit of that lane has the dtype.
        for (lane, dtype) in plan.arena_numel:
            assert any(lane in plan.allowed[u] for u in plan.unit_layout_numel[dtype])
    rr = plan_lanes(specs, lanes=lanes)
    assert rr.pool_bytes() <= plan_lanes(specs, lanes=lanes, assignment="shared").pool_bytes()


@settings(max_examples=150, deadline=None)
@given(bucket_sets(), LANES)
def test_consecutive_units_never_share_a_lane(specs, lanes):
    """Any `lanes` units in a row (forward or backward order) sit in distinct arenas, so live
    units never overlap; inside one arena a unit's buckets do not overlap (max-pool offsets)."""
    plan = plan_lanes(specs, lanes=lanes)
    order = sorted(plan.allowed)
    assert all(len(plan.allowed[u]) == 1 for u in order)
    for direction in (order, order[::-1]):
        for i in range(len(direction)):
            window = direction[i:i + lanes]
            assert len({plan.allowed[u][0] for u in window}) == len(window), (window, plan.allowed)


@settings(max_examples=50, deadline=None)
@given(bucket_sets(), LANES, st.randoms(use_true_random=False))
def test_lane_plan_is_deterministic_and_order_independent(specs, lanes, rnd):
    shuffled = list(specs)
    rnd.shuffle(shuffled)
    assert plan_lanes(shuffled, lanes=lanes) == plan_lanes(specs, lanes=lanes)


def hybrid(units=6):
    """M*E repeated: Mamba (bf16 + fp32 bucket), attention, MoE (dense + experts)."""
    sizes = {"M": [("torch.bfloat16", 900), ("torch.float32", 16)], "*": [("torch.bfloat16", 700)],
             "E": [("torch.bfloat16", 300), ("torch.bfloat16", 1100)]}
    specs, bid = [], 0
    for unit in range(units):
        for dtype, numel in sizes["M*E"[unit % 3]]:
            specs.append(spec(bid, unit, dtype, numel))
            bid += 1
    return specs


def test_hybrid_three_lanes_hold_one_layer_of_each_kind():
    plan = plan_lanes(hybrid(), lanes=3)
    # Lane j holds only kind j: Mamba (900 bf16 + 16 fp32), attention (700), MoE (the expert
    # bucket starts at the 256 B boundary after the 300-element dense one: 384 + 1100).
    assert plan.arena_numel == {(0, "torch.bfloat16"): 900, (0, "torch.float32"): 16,
                                (1, "torch.bfloat16"): 700, (2, "torch.bfloat16"): 384 + 1100}
    assert plan.pool_bytes() == (900 + 700 + 1484) * 2 + 16 * 4
    # Three live units for less than three groups of the largest unit each.
    shared = plan_lanes(hybrid(), lanes=3, assignment="shared")
    assert plan.pool_bytes() < shared.pool_bytes() == 3 * (1484 * 2 + 16 * 4)
    lines = format_lane_plan(plan)
    assert lines[0].startswith("[maxpool] 3-lane plan: pool 6232 B")
    assert "lane 2 torch.bfloat16: 1484 elems" in lines[-1] and "set by unit 2 of units [2, 5]" in lines[-1]


def test_hybrid_two_round_robin_lanes_equal_todays_plan_when_each_lane_holds_every_kind():
    """Six M*E units: lanes {0, 2, 4} and {1, 3, 5} both contain all three kinds."""
    rr = plan_lanes(hybrid(), lanes=2)
    today = plan_max_pool(hybrid())
    assert rr.pool_bytes() == today.pool_bytes()
    assert rr.offsets == today.offsets


def test_bad_lane_requests_are_clear_errors():
    with pytest.raises(ValueError, match="buffer groups >= 2, got 1"):
        plan_lanes(hybrid(), lanes=1)
    with pytest.raises(ValueError, match="assignment must be 'round_robin' or 'shared', got 'zigzag'"):
        plan_lanes(hybrid(), lanes=3, assignment="zigzag")


def test_random_unit_ids_keep_position_order():
    """Lanes follow unit order, not id values: ids 3, 10, 11 take lanes 0, 1, 2."""
    specs = [spec(i, u, "torch.bfloat16", 10 * (i + 1)) for i, u in enumerate((3, 10, 11))]
    random.Random(0).shuffle(specs)
    assert plan_lanes(specs, lanes=3).allowed == {3: (0,), 10: (1,), 11: (2,)}


@settings(max_examples=100, deadline=None)
@given(bucket_sets(), LANES)
def test_runtime_plan_is_todays_pool_at_two_lanes_and_round_robin_above(specs, lanes):
    plan = runtime_lane_plan(specs, lanes=lanes)
    if lanes == 2:
        today = plan_max_pool(specs)
        assert plan.pool_bytes() == today.pool_bytes() and plan.offsets == today.offsets
        assert all(allowed == (0, 1) for allowed in plan.allowed.values())
    else:
        assert plan == plan_lanes(specs, lanes=lanes, assignment="round_robin")
    # The allocator looks up a bucket's padded size in the plan.
    assert {b.bucket_id: b for b in specs if b.unit_id is not None} == plan.buckets
    assert plan.unit_ids == tuple(sorted({b.unit_id for b in specs if b.unit_id is not None}))


def test_lane_assignment_and_unit_count_rule():
    assert [lane_assignment(n) for n in (2, 3, 8)] == ["shared", "round_robin", "round_robin"]
    with pytest.raises(ValueError, match="got 1"):
        lane_assignment(1)
    assert lanes_units_problem(2, 1, setting="x") is None  # today's pool serves any chunk
    assert lanes_units_problem(3, 3, setting="x") is None
    assert lanes_units_problem(4, 3, setting="--lanes 4") == (
        "--lanes 4 asks for 4 lanes, more than the 3 FSDP units of this model chunk, so 1 lane(s) "
        "would hold no unit; use at most 3 lanes.")
