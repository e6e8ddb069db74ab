"""CPU tests of MaxPoolAllocator (and FixedPool homes) with a CPU global memory buffer."""

import functools
import operator

import pytest
import torch

import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.allocator as mpa
import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as pgb
from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
    FixedPoolAllocator,
    MaxPoolAllocator,
    ParameterGroup,
    StorageResizeBasedBucketAllocator,
)

CPU = torch.device("cpu")


class CpuGlobalMemoryBuffer:
    """Same contract as utils.GlobalMemoryBuffer (grow under a name), on CPU."""

    def __init__(self):
        self.buffer = {}
        self.creations = []

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        n = functools.reduce(operator.mul, tensor_shape, 1)
        if (name, dtype) not in self.buffer or self.buffer[(name, dtype)].numel() < n:
            self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
            self.creations.append((name, dtype, n))
        return self.buffer[(name, dtype)][0:n].view(*tensor_shape)


def install_cpu_memory_buffer(monkeypatch):
    """Point the allocators' global memory buffer at a fresh CpuGlobalMemoryBuffer."""
    buf = CpuGlobalMemoryBuffer()
    monkeypatch.setattr(mpa, "get_global_memory_buffer", lambda: buf)
    monkeypatch.setattr(pgb, "get_global_memory_buffer", lambda: buf)
    return buf


@pytest.fixture
def gmb(monkeypatch):
    return install_cpu_memory_buffer(monkeypatch)


def group(unit, numel, dtype=torch.bfloat16):
    return ParameterGroup(
        params=[torch.nn.Parameter(torch.zeros(numel, dtype=dtype))],
        dtype=dtype,
        fsdp_unit_id=unit,
    )


def hybrid_groups():
    """Embedding (non-unit), Mamba unit (2 buckets, one fp32), attention unit, MoE unit."""
    return [
        group(None, 5000),  # 0 embedding
        group(0, 900),  # 1 mamba in_proj
        group(0, 16, torch.float32),  # 2 mamba A_log / D kept fp32
        group(1, 700),  # 3 attention
        group(2, 300),  # 4 moe dense
        group(2, 1100),  # 5 moe experts
        group(None, 64),  # 6 final norm
    ]


def padded(g):
    return -(-sum(p.numel() for p in g.params) // 128) * 128  # like DP x chunk padding


def make(groups, **kw):
    return MaxPoolAllocator("fsdp_params", groups, numel_fn=padded, **kw)


def units_of(groups):
    out = {}
    for bid, g in enumerate(groups):
        if g.fsdp_unit_id is not None:
            out.setdefault(g.fsdp_unit_id, []).append(bid)
    return out


def alloc_unit(alloc, groups, buckets, strict=True):
    return {
        b: alloc.allocate(
            b, padded(groups[b]), groups[b].params[0].dtype, CPU, strict_assignments=strict
        ).data
        for b in buckets
    }


def free_unit(alloc, buckets):
    for b in buckets:
        alloc.free(b)


def one_iteration(alloc, groups):
    """Forward then backward with at most two live units, like the FSDP hooks."""
    units = units_of(groups)
    order = sorted(units)
    ptrs = {}
    for phase in (order, list(reversed(order))):
        prev = None
        for u in phase:
            views = alloc_unit(alloc, groups, units[u])
            ptrs.update({(tuple(phase), b): t.data_ptr() for b, t in views.items()})
            if prev is not None:
                free_unit(alloc, units[prev])
            prev = u
        free_unit(alloc, units[prev])
    return ptrs


def test_homes_stable_over_three_iterations_with_zero_misses(gmb):
    groups = hybrid_groups()
    alloc = make(groups)
    assert alloc.fsdp_double_buffer_units == [0, 1, 2]
    # Init-time fetches (strict_assignments=False) must not record homes.
    for buckets in units_of(groups).values():
        alloc_unit(alloc, groups, buckets, strict=False)
        free_unit(alloc, buckets)
    assert alloc.home == {}
    first = one_iteration(alloc, groups)
    bytes_after_1 = alloc.stats()["pool_bytes_allocated"]
    homes = dict(alloc.home)
    for _ in range(2):
        assert one_iteration(alloc, groups) == first
    stats = alloc.stats()
    assert stats["home_misses"] == 0
    assert alloc.home == homes == {0: 0, 1: 1, 2: 0}
    assert stats["pool_bytes_allocated"] == bytes_after_1
    # Memory is lazy per (group, dtype): only the Mamba unit has fp32 buckets and its home
    # is always group 0, so group 1's fp32 arena (128 elems) is never created.
    assert stats["pool_bytes_planned"] == 2 * (1536 * 2 + 128 * 4)
    assert stats["pool_bytes_allocated"] == stats["pool_bytes_planned"] - 128 * 4
    assert stats["allocations"] == 3 * 2 * 5 + 5  # 5 unit buckets, fwd+bwd, plus init
    # Every arena was created once, at its full planned size (never grown).
    arena_keys = [c for c in gmb.creations if "_maxpool_g" in c[0]]
    assert len(arena_keys) == len({(n, d) for n, d, _ in arena_keys}) == 3


def test_views_sit_at_planned_offsets_and_units_share_an_arena(gmb):
    groups = hybrid_groups()
    alloc = make(groups)
    plan = alloc.plan
    views = alloc_unit(alloc, groups, [1, 2])
    arena = alloc.arenas[(0, "torch.bfloat16")]
    dtype, off = plan.offsets[1]
    assert views[1].data_ptr() == arena.data_ptr() + off * 2
    assert plan.arena_numel["torch.bfloat16"] == max(
        plan.unit_layout_numel["torch.bfloat16"].values()
    )
    assert plan.setter["torch.bfloat16"] == 2  # MoE unit: 384 (aligned) + 1152 elements


def test_miss_counted_when_home_busy_and_hard_fail_mode(gmb):
    groups = hybrid_groups()
    units = units_of(groups)
    for fail in (False, True):
        alloc = make(groups, fail_on_home_miss=fail)
        alloc_unit(alloc, groups, units[0])  # home g0
        alloc_unit(alloc, groups, units[1])  # home g1
        free_unit(alloc, units[0])
        free_unit(alloc, units[1])
        alloc_unit(alloc, groups, units[2])  # first use: takes g0 as its home
        assert alloc.home[2] == 0
        if fail:
            with pytest.raises(RuntimeError, match="home miss #1: unit 0 home group 0"):
                alloc_unit(alloc, groups, units[0])
        else:
            views = alloc_unit(alloc, groups, units[0])  # home g0 busy -> g1
            assert alloc.stats()["home_misses"] == 1
            assert alloc.unit_group[0] == 1
            assert views[1].data_ptr() == alloc.arenas[(1, "torch.bfloat16")].data_ptr()


def test_third_live_unit_is_a_clear_error(gmb):
    groups = hybrid_groups()
    units = units_of(groups)
    alloc = make(groups)
    alloc_unit(alloc, groups, units[0])
    alloc_unit(alloc, groups, units[1])
    with pytest.raises(RuntimeError, match="no idle buffer group for unit 2"):
        alloc_unit(alloc, groups, units[2])


def test_impossible_requests_raise(gmb):
    groups = hybrid_groups()
    alloc = make(groups)
    with pytest.raises(ValueError, match="requested 1025 x torch.bfloat16, but the plan has 1024"):
        alloc.allocate(1, 1025, torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="torch.float32, but the plan has 1024 x torch.bfloat16"):
        alloc.allocate(1, 1024, torch.float32, CPU)
    # Smaller requests (HSDP shard-sized comm buffers) are fine.
    assert alloc.allocate(1, 10, torch.bfloat16, CPU).data.numel() == 10


def test_unplanned_bucket_raises(gmb):
    groups = hybrid_groups()
    alloc = MaxPoolAllocator(
        "fsdp_grads", groups, numel_fn=lambda g: None if g is groups[3] else padded(g)
    )
    with pytest.raises(RuntimeError, match="bucket 3 .unit 1. was not planned"):
        alloc.allocate(3, 768, torch.bfloat16, CPU)


def test_non_unit_buckets_are_never_pooled(gmb):
    groups = hybrid_groups()
    alloc = make(groups)
    b = alloc.allocate(0, 5120, torch.bfloat16, CPU)
    assert isinstance(alloc.backup_allocator, StorageResizeBasedBucketAllocator)
    assert alloc.backup_allocator.buckets[0] is b
    alloc.free(0)
    assert b.data.untyped_storage().size() == 0  # storage resized, Bucket kept
    again = alloc.allocate(0, 5120, torch.bfloat16, CPU)
    assert again is b and b.data.untyped_storage().size() == 5120 * 2
    assert alloc.arenas == {} and 0 not in alloc.plan.offsets

    persist = make(groups, fallback_to_persistent_buffer=True)
    t = persist.allocate(6, 128, torch.bfloat16, CPU).data
    persist.free(6)
    assert persist.allocate(6, 128, torch.bfloat16, CPU).data.data_ptr() == t.data_ptr()
    assert any("not_in_max_pool_6" in name for name, _ in gmb.buffer)
    assert persist.backup_allocator.buckets == {} and persist.arenas == {}
    assert persist.stats()["persistent_fallback_bytes"] == 256


def test_arena_growth_by_someone_else_is_detected(gmb):
    groups = hybrid_groups()
    units = units_of(groups)
    alloc = make(groups)
    alloc_unit(alloc, groups, units[0])
    free_unit(alloc, units[0])
    key = next(k for k in gmb.buffer if k[0].startswith("fsdp_params_maxpool_g0_bfloat16"))
    gmb.get_tensor([gmb.buffer[key].numel() + 1], key[1], key[0])  # grows under our name
    with pytest.raises(RuntimeError, match="changed after first use"):
        alloc_unit(alloc, groups, units[0])


def test_no_units_rejected_and_empty_pool_plans_nothing(gmb):
    with pytest.raises(ValueError, match="found no FSDP units"):
        MaxPoolAllocator("fsdp_params", [group(None, 10)])
    alloc = MaxPoolAllocator("fsdp_fp8_transpose_params", hybrid_groups(), numel_fn=lambda g: None)
    assert alloc.plan is None
    assert alloc.stats()["pool_bytes_planned"] == 0


def test_fixed_pool_homes_and_storage_resize_backup(gmb):
    # Two equal units (pooled) + one outlier: FixedPool gets homes (P5) and a
    # StorageResize backup that keeps the Bucket (P1).
    groups = [group(0, 256), group(1, 256), group(2, 999), group(3, 256)]
    fp = FixedPoolAllocator("fsdp_params", groups)
    assert fp.fsdp_double_buffer_units == [0, 1, 3]
    assert isinstance(fp.backup_allocator, StorageResizeBasedBucketAllocator)
    fp.allocate(0, 256, torch.bfloat16, CPU, strict_assignments=False)
    fp.free(0)
    assert fp.bucket_home == {}
    fp.allocate(0, 256, torch.bfloat16, CPU)
    fp.allocate(1, 256, torch.bfloat16, CPU)
    assert fp.bucket_home == {0: 0, 1: 1}
    fp.free(1)
    fp.allocate(3, 256, torch.bfloat16, CPU)  # takes g1 as home
    fp.free(0)
    fp.allocate(1, 256, torch.bfloat16, CPU)  # home g1 busy -> miss
    assert fp.home_misses == 1
    out = fp.allocate(2, 999, torch.bfloat16, CPU)
    fp.free(2)
    assert fp.backup_allocator.buckets[2] is out


def test_each_pool_plans_the_padded_size_of_its_buffer(gmb):
    """ParamAndGradBuffer builds its pools by name alone (as FixedPoolAllocator); each max-pool
    plans the padded size of the DP buffer it serves (double_buffer.allocator.PADDED_NUMEL)."""
    from types import SimpleNamespace as NS

    groups = hybrid_groups()
    for i, g in enumerate(groups):
        g.grad_dtype = torch.float32
        g.model_weight_buffer = NS(bucket_index=NS(size=padded(g)))
        g.main_grad_buffer = NS(bucket_index=NS(size=padded(g) + 128))  # other DP group padding
        g.hfsdp_helper_gbuf = None
        g.transpose_weight_buffer = None
        g.hsdp_comm_gbuf = NS(bucket_index=NS(size=padded(g))) if i == 3 else None
    weights = MaxPoolAllocator("fsdp_params", groups)
    grads = MaxPoolAllocator("fsdp_grads", groups, dtype_fn=lambda g: g.grad_dtype)
    transpose = MaxPoolAllocator("fsdp_fp8_transpose_params", groups)
    hsdp = MaxPoolAllocator("hsdp_grad_comm", groups, dtype_fn=lambda g: g.grad_dtype)
    assert weights.fsdp_double_buffer_units == [0, 1, 2]
    assert weights.plan.offsets[5] == ("torch.bfloat16", 384)
    assert weights.plan.buckets[5].numel == 1152
    assert grads.plan.buckets[5].numel == 1280
    assert set(grads.plan.arena_numel) == {"torch.float32"}
    assert transpose.plan is None
    assert set(hsdp.plan.offsets) == {3}
    groups[5].hfsdp_helper_gbuf = NS(bucket_index=NS(size=2048))  # grads go to the HFSDP helper
    assert MaxPoolAllocator("fsdp_grads", groups, dtype_fn=lambda g: g.grad_dtype).plan.buckets[5].numel == 2048


def test_reads_of_a_live_bucket_reuse_one_view(gmb, monkeypatch):
    """The main_grad getter asks once per parameter: no new view, no arena checks."""
    groups = hybrid_groups()
    units = units_of(groups)
    alloc = make(groups)
    first = alloc.allocate(1, padded(groups[1]), torch.bfloat16, CPU)
    arena_calls = []
    real_arena = alloc._arena
    monkeypatch.setattr(alloc, "_arena", lambda *a: arena_calls.append(a) or real_arena(*a))
    for _ in range(5):
        assert alloc.allocate(1, padded(groups[1]), torch.bfloat16, CPU) is first
    assert arena_calls == [] and alloc.stats()["allocations"] == 1
    # A smaller request (HSDP shard-sized) is its own validated view, still at the offset.
    small = alloc.allocate(1, 10, torch.bfloat16, CPU)
    assert small is not first and small.data.data_ptr() == first.data.data_ptr()
    assert len(arena_calls) == 1
    # A new life in the same home group reuses the view (arenas never move) ...
    free_unit(alloc, units[0])
    assert alloc.allocate(1, padded(groups[1]), torch.bfloat16, CPU) is first
    # ... but is a fresh acquisition: the arena invariant is checked again.
    assert len(arena_calls) == 2 and alloc.stats()["allocations"] == 2
    # A life in the other group gets that group's view.
    free_unit(alloc, units[0])
    alloc_unit(alloc, groups, units[1])  # unit 1 takes g0 (unit 0's home is free)
    other = alloc.allocate(1, padded(groups[1]), torch.bfloat16, CPU)
    assert alloc.unit_group[0] == 1
    assert other.data.data_ptr() == alloc.arenas[(1, "torch.bfloat16")].data_ptr()
    # Bad requests still fail on a live bucket (they miss the cache and are validated).
    with pytest.raises(ValueError, match="requested 1025 x torch.bfloat16"):
        alloc.allocate(1, 1025, torch.bfloat16, CPU)


def test_poison_fills_a_slot_each_time_a_bucket_takes_it(gmb, monkeypatch):
    """HFSDP_MAXPOOL_POISON=1: a read of pool memory not written in this life shows as NaN."""
    groups = hybrid_groups()
    units = units_of(groups)
    monkeypatch.setenv(mpa.POISON_ENV, "1")
    alloc = make(groups)
    n1 = padded(groups[1])
    first = alloc.allocate(1, n1, torch.bfloat16, CPU).data
    assert torch.isnan(first).all()
    fp32 = alloc.allocate(2, padded(groups[2]), torch.float32, CPU).data
    assert torch.isnan(fp32).all()
    first.fill_(3.0)
    # Further reads of the live bucket (the grad getter) must not re-poison written data.
    assert (alloc.allocate(1, n1, torch.bfloat16, CPU).data == 3.0).all()
    # Another unit in the other group is poisoned; the live unit's slot is untouched.
    other = alloc_unit(alloc, groups, units[1])
    assert all(torch.isnan(t).all() for t in other.values())
    assert (first == 3.0).all()
    # A new life of the same bucket (same home group, same memory) is poisoned again.
    free_unit(alloc, units[0])
    again = alloc.allocate(1, n1, torch.bfloat16, CPU).data
    assert again.data_ptr() == first.data_ptr() and torch.isnan(again).all()
    # Integer slots (float8 is planned as uint8) get the all-ones byte.
    u8 = [ParameterGroup(params=[torch.nn.Parameter(torch.zeros(200, dtype=torch.uint8),
                                                    requires_grad=False)],
                         dtype=torch.uint8, fsdp_unit_id=0)]
    fp8_alloc = MaxPoolAllocator("fsdp_params", u8, numel_fn=padded,
                                 dtype_fn=lambda g: torch.uint8)
    assert fp8_alloc.allocate(0, 256, torch.uint8, CPU).data.tolist() == [255] * 256


def test_no_poison_by_default(gmb, monkeypatch):
    monkeypatch.delenv(mpa.POISON_ENV, raising=False)
    groups = hybrid_groups()
    units = units_of(groups)
    alloc = make(groups)
    assert not alloc.poison
    view = alloc.allocate(1, padded(groups[1]), torch.bfloat16, CPU).data
    view.fill_(7.0)
    free_unit(alloc, units[0])
    assert (alloc.allocate(1, padded(groups[1]), torch.bfloat16, CPU).data == 7.0).all()
