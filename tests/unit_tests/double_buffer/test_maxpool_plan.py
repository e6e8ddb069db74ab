"""Property tests for the pure max-pool planner (megatron_fsdp/double_buffer/plan.py). CPU only."""

import itertools
import random
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hfsdp.planner.compare import analytic_minimum_bytes, fixed_pool_outliers, plan_rank_matched
from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.plan import (
    BucketSpec,
    format_plan,
    plan_max_pool,
)

ITEMSIZE = {"torch.bfloat16": 2, "torch.float32": 4, "torch.uint8": 1, "float8": 1}


def spec(bid, unit, dtype, numel, unpadded=None):
    return BucketSpec(bid, unit, dtype, numel, ITEMSIZE[dtype], unpadded)


@st.composite
def bucket_sets(draw):
    """Units with unequal bucket counts, mixed dtypes (incl. float8), plus non-units."""
    n_units = draw(st.integers(1, 6))
    dtypes = st.sampled_from(["torch.bfloat16", "torch.float32", "float8"])
    rows = []
    for unit in range(n_units):
        for _ in range(draw(st.integers(1, 4))):
            rows.append((unit, draw(dtypes), draw(st.integers(1, 5000))))
    for _ in range(draw(st.integers(0, 3))):
        rows.append((None, draw(dtypes), draw(st.integers(1, 5000))))
    order = draw(st.permutations(range(len(rows))))
    specs = []
    for bid, i in enumerate(order):
        unit, dtype, numel = rows[i]
        pad = draw(st.integers(0, 64))
        specs.append(spec(bid, unit, dtype, numel + pad, unpadded=numel))
    return specs


def unit_bytes(specs):
    need = defaultdict(lambda: defaultdict(int))
    for b in specs:
        if b.unit_id is not None:
            need[b.dtype][b.unit_id] += b.numel * b.itemsize
    return need


@settings(max_examples=150, deadline=None)
@given(bucket_sets(), st.sampled_from([1, 2, 64, 256]))
def test_arena_covers_every_unit_and_beats_rank_matched(specs, align):
    plan = plan_max_pool(specs, align_bytes=align)
    for dtype, per_unit in unit_bytes(specs).items():
        assert plan.arena_bytes(dtype) >= max(per_unit.values())
    # Same per-slot alignment on both sides: the arena never needs more memory.
    assert plan.pool_bytes() <= plan_rank_matched(specs, align_bytes=align).pool_bytes()
    # Within alignment padding of the analytic minimum (exact when unaligned).
    slack = 0
    for dtype, per_unit in unit_bytes(specs).items():
        nmax = max(sum(1 for b in specs if b.unit_id == u and b.dtype == dtype) for u in per_unit)
        slack += (nmax - 1) * max(align, plan.itemsize[dtype])
    assert analytic_minimum_bytes(specs) <= plan.pool_bytes()
    assert plan.pool_bytes() <= analytic_minimum_bytes(specs) + 2 * slack
    if align == 1:
        assert plan.pool_bytes() == analytic_minimum_bytes(specs)


@settings(max_examples=150, deadline=None)
@given(bucket_sets(), st.randoms(use_true_random=False))
def test_plan_independent_of_insertion_order(specs, rnd):
    shuffled = list(specs)
    rnd.shuffle(shuffled)
    assert plan_max_pool(shuffled) == plan_max_pool(specs)
    assert plan_rank_matched(shuffled) == plan_rank_matched(specs)
    assert fixed_pool_outliers(shuffled) == fixed_pool_outliers(specs)


@settings(max_examples=150, deadline=None)
@given(bucket_sets())
def test_offsets_do_not_overlap_within_a_unit(specs):
    plan = plan_max_pool(specs)
    by_unit = defaultdict(list)
    for b in specs:
        if b.unit_id is None:
            assert b.bucket_id not in plan.offsets  # non-units are never pooled
            continue
        dtype, off = plan.offsets[b.bucket_id]
        assert dtype == b.dtype
        assert (off * b.itemsize) % 256 == 0
        assert off + b.numel <= plan.arena_numel[dtype]
        by_unit[(b.unit_id, dtype)].append((off, off + b.numel))
    for ranges in by_unit.values():
        ranges.sort()
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start


def test_float8_planned_as_uint8_and_grad_dtype_distinct():
    # Weight pool: FP8 layer has a float8 bucket plus a bf16 norm bucket.
    weights = [spec(0, 0, "float8", 1000), spec(1, 0, "torch.bfloat16", 10)]
    wplan = plan_max_pool(weights)
    assert set(wplan.arena_numel) == {"torch.uint8", "torch.bfloat16"}
    assert wplan.offsets[0] == ("torch.uint8", 0)
    # Grad pool of the same groups: planned in the grad dtype (fp32), not the param dtype.
    grads = [spec(0, 0, "torch.float32", 1000), spec(1, 0, "torch.float32", 10)]
    gplan = plan_max_pool(grads)
    assert set(gplan.arena_numel) == {"torch.float32"}
    assert gplan.offsets[1] == ("torch.float32", 1024)  # 4000 B rounded up to 4096 B
    assert gplan.pool_bytes() == 2 * (1024 + 10) * 4


def test_hybrid_example_matches_hand_computation():
    # Mamba unit (two buckets), attention unit, MoE unit (dense + expert) in bf16.
    specs = [
        spec(0, 0, "torch.bfloat16", 4096),  # mamba in_proj
        spec(1, 0, "torch.bfloat16", 512),  # mamba rest
        spec(2, 1, "torch.bfloat16", 3072),  # attention
        spec(3, 2, "torch.bfloat16", 1024),  # moe dense
        spec(4, 2, "torch.bfloat16", 8192),  # moe experts
        spec(5, None, "torch.bfloat16", 100000),  # embedding: never pooled
    ]
    plan = plan_max_pool(specs)
    assert plan.setter == {"torch.bfloat16": 2}
    assert plan.arena_numel == {"torch.bfloat16": 1024 + 8192}
    assert plan.unit_ids == (0, 1, 2)
    rank = plan_rank_matched(specs)
    assert rank.slots == {"torch.bfloat16": (8192, 1024)}  # slot r = max of r-th largest
    assert rank.slot_setter["torch.bfloat16"][0] == (2, 4)
    fp = fixed_pool_outliers(specs)
    assert fp.mode_class == (0,) and fp.outlier_unit_ids == (1, 2)
    assert fp.pool_bytes == 2 * (4096 + 512) * 2
    lines = format_plan(plan, name="fsdp_params")
    assert any("set by unit 2" in line and "torch.bfloat16" in line for line in lines)
    assert not any("rank-matched" in line or "minimum" in line for line in lines)  # the planner's comparison


def test_fixed_pool_compares_unpadded_numel_and_ties_to_first_unit():
    specs = [
        spec(0, 0, "torch.bfloat16", 128, unpadded=100),
        spec(1, 1, "torch.bfloat16", 128, unpadded=101),  # same padded, different unpadded
        spec(2, 2, "torch.bfloat16", 128, unpadded=100),
        spec(3, 3, "torch.bfloat16", 128, unpadded=101),
    ]
    fp = fixed_pool_outliers(specs)
    assert fp.classes == ((0, 2), (1, 3))
    assert fp.mode_class == (0, 2)
    assert fp.outlier_unit_ids == (1, 3)
    assert fp.outlier_bytes == 2 * 128 * 2


@pytest.mark.parametrize(
    "specs, match",
    [
        ([], "no FSDP unit"),
        ([spec(0, None, "torch.bfloat16", 10)], "no FSDP unit"),
        ([spec(0, 0, "torch.bfloat16", 10), spec(0, 1, "torch.bfloat16", 10)], "duplicate"),
        ([spec(0, 0, "torch.bfloat16", 0)], "numel 0"),
        ([spec(0, 0, "torch.bfloat16", -5)], "numel -5"),
        ([spec(0, 0, "torch.bfloat16", 10, unpadded=11)], "unpadded_numel"),
        ([spec(0, -1, "torch.bfloat16", 10)], "unit id"),
        ([BucketSpec(0, 0, "x", 4, 2), BucketSpec(1, 1, "x", 4, 4)], "inconsistent itemsize"),
    ],
)
def test_bad_input_raises_clear_errors(specs, match):
    with pytest.raises(ValueError, match=match):
        plan_max_pool(specs)
    with pytest.raises(ValueError, match=match):
        plan_rank_matched(specs)


def test_bad_alignment_rejected():
    with pytest.raises(ValueError, match="align_bytes"):
        plan_max_pool([spec(0, 0, "torch.bfloat16", 10)], align_bytes=0)


def test_plan_is_deterministic_across_runs():
    rnd = random.Random(7)
    specs = [spec(i, i % 5, "torch.bfloat16", rnd.randint(1, 10**6)) for i in range(40)]
    plans = {repr(plan_max_pool(rnd.sample(specs, len(specs)))) for _ in range(5)}
    assert len(plans) == 1
