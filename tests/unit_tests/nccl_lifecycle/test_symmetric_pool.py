"""CPU tests of max-pool symmetric-memory staging (double_buffer/symmetric.py) and strict homes.

The 2-rank gloo job runs this file as its own worker (``python test_symmetric_pool.py
<scenario> <rank> <world> <out_dir> <init_method>``); everything else is single-process with a CPU
fake of the global memory buffer and mocked collectives.
"""

import functools
import json
import operator
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from nccl_harness import run_ranks

import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.allocator as mpa
import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.symmetric as sym
import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as pgb
from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy import policy_from_config
from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import MaxPoolAllocator, ParameterGroup

CPU = torch.device("cpu")
JOB_TIMEOUT_S = 180


class CpuGlobalMemoryBuffer:
    """Same contract as utils.GlobalMemoryBuffer (grow under a name), on CPU; logs creations."""

    def __init__(self, events: list[str] = None):
        self.buffer = {}
        self.creations = []
        self.events = events if events is not None else []

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        n = functools.reduce(operator.mul, tensor_shape, 1)
        if (name, dtype) not in self.buffer or self.buffer[(name, dtype)].numel() < n:
            self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
            self.creations.append((name, dtype, n))
            self.events.append(f"alloc:{name}")
        return self.buffer[(name, dtype)][0:n].view(*tensor_shape)


class RecordingPoolContext:
    """Stands in for nccl_mem / MultiGroupMemPoolAllocator: registration happens on exit."""

    def __init__(self, events: list[str]):
        self.events = events

    def __call__(self):
        return self

    def __enter__(self):
        self.events.append("pool:enter")

    def __exit__(self, *exc):
        self.events.append("pool:exit-register")


def group(unit, numel, dtype=torch.bfloat16):
    return ParameterGroup(
        params=[torch.nn.Parameter(torch.zeros(numel, dtype=dtype))], dtype=dtype, fsdp_unit_id=unit
    )


def hybrid_groups(attention_numel=700):
    """Embedding (non-unit), Mamba unit (bf16 + fp32 buckets), attention unit, MoE unit."""
    return [
        group(None, 5000),
        group(0, 900),
        group(0, 16, torch.float32),
        group(1, attention_numel),
        group(2, 300),
        group(2, 1100),
        group(None, 64),
    ]


def padded(g):
    return -(-sum(p.numel() for p in g.params) // 128) * 128


def make_buffer(events, groups=None, manual=False, ubr_groups=("dp", "dp_outer")):
    groups = groups or hybrid_groups()
    weights = MaxPoolAllocator("fsdp_params", groups, numel_fn=padded)
    grads = MaxPoolAllocator(
        "fsdp_grads", groups, numel_fn=padded, dtype_fn=lambda g: torch.float32
    )
    cfg = SimpleNamespace(  # the fields a DDP config builds its double-buffer policy from
        nccl_ub=True,
        megatron_fsdp_max_pool_double_buffer=True,
        megatron_fsdp_max_pool_lanes=2,
        disable_symmetric_registration=False,
        fsdp_manual_registration=manual,
        fsdp_double_buffer=True,
        fsdp_db_use_persist_buf_on_alloc_fail=False,
        data_parallel_sharding_strategy="optim_grads_params",
    )
    return SimpleNamespace(
        ddp_config=cfg,
        weight_alloc=weights,
        transpose_weight_alloc=None,
        main_grad_alloc=grads,
        ubr_groups=[SimpleNamespace(group_desc=d, size=lambda: 2) for d in ubr_groups],
        mem_alloc_context=RecordingPoolContext(events),
        device=CPU,
        parameter_groups=groups,
        already_registered=False,
        nccl_mem_pool=SimpleNamespace(name="this buffer's pool"),  # each buffer registers its own
    )


@pytest.fixture
def events(monkeypatch):
    """Mocks collectives and the global memory buffer; returns the shared event log."""
    log: list[str] = []
    gmb = CpuGlobalMemoryBuffer(log)
    monkeypatch.setattr(mpa, "get_global_memory_buffer", lambda: gmb)
    monkeypatch.setattr(pgb, "get_global_memory_buffer", lambda: gmb)

    def desc(group):
        return "world" if group is None else group.group_desc

    def all_gather(out, tensor, group=None):
        log.append(f"plan-check:{desc(group)}")
        for t in out:
            t.copy_(tensor)

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "barrier", lambda group=None, **k: log.append(f"barrier:{desc(group)}"))
    return SimpleNamespace(log=log, gmb=gmb)


# ------------------------------------- pre-sizing ([Note: double buffer], failure modes: size drift)


def iterate(alloc, groups, n_iter=3):
    units: dict[int, list[int]] = {}
    for bid, g in enumerate(groups):
        if g.fsdp_unit_id is not None:
            units.setdefault(g.fsdp_unit_id, []).append(bid)
    order = sorted(units)
    for _ in range(n_iter):
        for phase in (order, order[::-1]):
            prev = None
            for u in phase:
                for b in units[u]:
                    alloc.allocate(b, padded(groups[b]), alloc.dtype_fn(groups[b]), CPU)
                if prev is not None:
                    for b in units[prev]:
                        alloc.free(b)
                prev = u
            for b in units[prev]:
                alloc.free(b)


def test_presize_creates_each_arena_once_at_planned_size_and_never_grows(events):
    buf = make_buffer(events.log)
    record = sym.stage_symmetric_max_pool(buf, policy_from_config(buf.ddp_config))
    created = list(events.gmb.creations)
    # weights: bf16 + fp32 strata x 2 groups; grads (all fp32): 1 stratum x 2 groups.
    assert len(created) == 6 == len(record.arenas)
    assert len({(n, d) for n, d, _ in created}) == 6
    for alloc in (buf.weight_alloc, buf.main_grad_alloc):
        assert alloc.presized
        for g, dname, numel in alloc.arena_order():
            assert (alloc.arena_name(g, dname), getattr(torch, dname[6:]), numel) in created
            assert alloc.arenas[(g, dname)].numel() == alloc.plan.arena_numel[dname]
    # Group 1's fp32 weight arena would never exist lazily (only Mamba has fp32); staged, it does.
    assert (1, "torch.float32") in buf.weight_alloc.arenas
    ptrs = {k: t.data_ptr() for k, t in buf.weight_alloc.arenas.items()}
    iterate(buf.weight_alloc, buf.parameter_groups)
    iterate(buf.main_grad_alloc, buf.parameter_groups)
    assert events.gmb.creations == created  # no get_tensor creation/growth after staging
    assert {k: t.data_ptr() for k, t in buf.weight_alloc.arenas.items()} == ptrs
    assert buf.weight_alloc.stats()["allocations"] > 0
    expected_bytes = buf.weight_alloc.plan.pool_bytes() + buf.main_grad_alloc.plan.pool_bytes()
    assert record.arena_bytes == expected_bytes


def test_presize_refuses_to_grow_a_smaller_shared_arena(events):
    small = make_buffer(events.log, groups=hybrid_groups(attention_numel=700))
    sym.stage_symmetric_max_pool(small, policy_from_config(small.ddp_config))
    # A second model chunk whose largest bf16 unit is bigger shares the arena names.
    big = make_buffer(events.log, groups=hybrid_groups(attention_numel=5000))
    with pytest.raises(RuntimeError, match=r"fsdp_params_maxpool_g0_bfloat16 already exists"):
        sym.stage_symmetric_max_pool(big, policy_from_config(big.ddp_config))


def test_staging_is_a_noop_without_nccl_ub_or_max_pool(events):
    for field in ("nccl_ub", "megatron_fsdp_max_pool_double_buffer"):
        buf = make_buffer(events.log)
        setattr(buf.ddp_config, field, False)
        assert sym.stage_symmetric_max_pool(buf, policy_from_config(buf.ddp_config)) is None
    assert events.log == [] and events.gmb.creations == []


@pytest.mark.parametrize(
    ("comm_dtype", "staged"),
    [(None, False), (torch.float32, False), (torch.bfloat16, True)],
    ids=["no-comm-dtype", "comm-dtype-of-the-grads", "bf16-comm-for-fp32-grads"],
)
def test_hybrid_fsdp_grad_comm_arenas_are_staged_only_when_a_group_uses_them(events, comm_dtype, staged):
    """Hybrid FSDP's hsdp_grad_comm allocator allocates only for groups whose fp32 main grads are
    cast to another communication dtype; unused, its arenas would sit registered in the NCCL pool."""
    groups = hybrid_groups()
    buf = make_buffer(events.log, groups)
    buf.hsdp_grad_comm_alloc = MaxPoolAllocator(
        "hsdp_grad_comm", groups, numel_fn=padded, dtype_fn=lambda g: comm_dtype or torch.float32
    )
    buf.mp_policy = SimpleNamespace(grad_comm_dtype=comm_dtype)
    for g in groups:
        g.main_grad_buffer = SimpleNamespace(dtype=torch.float32)
        g.hsdp_comm_gbuf = SimpleNamespace()
    record = sym.stage_symmetric_max_pool(buf, policy_from_config(buf.ddp_config))
    staged_names = {name for name, *_ in record.arenas}
    assert staged_names == {"fsdp_params", "fsdp_grads", *(["hsdp_grad_comm"] if staged else [])}
    made = {name.split("_maxpool")[0] for name, *_ in events.gmb.creations}
    assert any("hsdp_grad_comm" in name for name, *_ in events.gmb.creations) == staged, made


# ------------------------------------------------------------------ ordering


def test_plan_check_and_rendezvous_precede_registration_and_first_use(events):
    buf = make_buffer(events.log)
    sym.stage_symmetric_max_pool(buf, policy_from_config(buf.ddp_config))
    log = events.log
    allocs = [i for i, e in enumerate(log) if e.startswith("alloc:")]
    assert log[:4] == [
        "plan-check:dp",
        "plan-check:dp_outer",
        "barrier:dp",
        "barrier:dp_outer",
    ]
    # UBR groups only: a world barrier would hang when ranks stage different buffer counts.
    assert log[4] == "pool:enter" and allocs == list(range(5, 11))
    assert log[11:] == ["pool:exit-register", "barrier:dp", "barrier:dp_outer"]
    # First use after staging touches no pool memory management and no collective.
    n = len(log)
    groups = buf.parameter_groups
    buf.weight_alloc.allocate(3, padded(groups[3]), torch.bfloat16, CPU)
    assert len(log) == n


def test_manual_registration_rendezvous_follows_registration(events, monkeypatch):
    buf = make_buffer(events.log, manual=True)
    # The record is kept as ParamAndGradBuffer keeps it.
    buf.maxpool_staging = sym.stage_symmetric_max_pool(buf, policy_from_config(buf.ddp_config))
    # Staging only allocates in manual mode: no rendezvous after the context yet.
    assert events.log[-1] == "pool:exit-register"
    del events.log[:]
    monkeypatch.setattr(
        pgb.nccl_allocator,
        "register_mem_pool",
        lambda pool, group, symmetric=True: events.log.append(f"register:{pool.name}:{group.group_desc}:{symmetric}"),
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    pgb.ParamAndGradBuffer.manual_buffer_registration(buf)  # the real method, patched hook
    assert buf.already_registered
    assert events.log == [
        "barrier:world",
        "register:this buffer's pool:dp:True",
        "register:this buffer's pool:dp_outer:True",
        "barrier:dp",
        "barrier:dp_outer",
    ]


def test_manual_registration_without_staging_adds_no_rendezvous(events, monkeypatch):
    buf = make_buffer(events.log, manual=True)
    buf.ddp_config.megatron_fsdp_max_pool_double_buffer = False  # FixedPool-style buffer
    buf.maxpool_staging = sym.stage_symmetric_max_pool(buf, policy_from_config(buf.ddp_config))
    assert buf.maxpool_staging is None
    monkeypatch.setattr(pgb.nccl_allocator, "register_mem_pool", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    pgb.ParamAndGradBuffer.manual_buffer_registration(buf)
    assert events.log == ["barrier:world"]


def test_fingerprint_is_deterministic_and_plan_sensitive():
    a = [MaxPoolAllocator("fsdp_params", hybrid_groups(), numel_fn=padded)]
    b = [MaxPoolAllocator("fsdp_params", hybrid_groups(), numel_fn=padded)]
    c = [MaxPoolAllocator("fsdp_params", hybrid_groups(attention_numel=5000), numel_fn=padded)]
    assert sym.plan_fingerprint(a) == sym.plan_fingerprint(b)
    assert len(sym.plan_fingerprint(a)) == 16
    assert sym.plan_fingerprint(a) != sym.plan_fingerprint(c)
    for fp in (sym.plan_fingerprint(a), "ffffffffffffffff", "8000000000000000", "0" * 16):
        assert sym._to_hex(sym._to_int64(fp)) == fp


# ------------------------------------------------------------------ strict homes after capture


@pytest.fixture
def capture_env(monkeypatch):
    """FullCudaGraphWrapper's CUDA pieces replaced by recorders (as test_stale_capture_stream)."""
    from megatron.core import full_cuda_graph as fcg
    from megatron.core import full_cuda_graph_homes

    class FakeGraph:
        def register_generator_state(self, state):
            pass

        def replay(self):
            pass

    class FakeCapture:
        def __init__(self, graph, **kwargs):
            pass

        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(fcg, "get_all_rng_states", lambda: {})
    monkeypatch.setattr(fcg, "get_shared_capture_stream", lambda: None)
    monkeypatch.setattr(fcg, "get_graph_pool", lambda single: None)
    monkeypatch.setattr(fcg, "enable_stale_capture_stream_override", lambda: True)
    monkeypatch.setattr(full_cuda_graph_homes, "_logged_strict_max_pool_homes", False)
    for name in ("curr_iteration", "cuda_graph", "result"):
        init = 0 if name == "curr_iteration" else None
        monkeypatch.setattr(fcg.FullCudaGraphWrapper, name, {"training": init, "validation": init})
    return fcg


def fsdp_like_chunk(buffer):
    """model chunk -> .module (MegatronFSDP-like) holding param_and_grad_buffer."""
    inner = torch.nn.Module()
    inner.param_and_grad_buffer = buffer
    chunk = torch.nn.Module()
    chunk.module = inner
    return chunk


def capture(fcg, model, forward_only, seen):
    wrapper = fcg.FullCudaGraphWrapper.__new__(fcg.FullCudaGraphWrapper)  # no CUDA stream

    def forward_backward(**kwargs):
        seen.append([a.fail_on_home_miss for a in fcg_allocs(kwargs["model"])])
        return "loss"

    wrapper.forward_backward_func = forward_backward
    wrapper.cuda_graph_warmup_steps = 0
    wrapper.use_single_mempool = False
    return wrapper(
        model=model, data_iterator=[None] * len(model), num_microbatches=1, seq_length=1,
        forward_only=forward_only,
    )


def fcg_allocs(model):
    return mpa.model_max_pool_allocators(model)


def test_capture_sets_fail_on_home_miss_and_logs_once(events, capture_env, caplog):
    fcg = capture_env
    chunks = [fsdp_like_chunk(make_buffer(events.log)), fsdp_like_chunk(make_buffer(events.log))]
    allocs = fcg_allocs(chunks)
    assert len(allocs) == 4 and not any(a.fail_on_home_miss for a in allocs)
    seen: list[list[bool]] = []
    with caplog.at_level("INFO", logger="megatron.core.full_cuda_graph_homes"):
        assert capture(fcg, chunks, False, seen) == "loss"  # training capture
        capture(fcg, chunks, True, seen)  # validation capture
    assert seen[0] == [False] * 4  # not yet strict while the capture records the graph
    assert all(a.fail_on_home_miss for a in allocs)
    strict_logs = [r.getMessage() for r in caplog.records if "fail on a home miss" in r.getMessage()]
    assert len(strict_logs) == 1 and "4 Megatron-FSDP max-pool allocator(s)" in strict_logs[0]
    # What the flag buys: a unit that cannot get its home group now raises.
    alloc, groups = allocs[0], allocs[0].fsdp_param_groups
    for unit_buckets in ([1, 2], [3]):  # unit 0 -> home group 0, unit 1 -> home group 1
        for b in unit_buckets:
            alloc.allocate(b, padded(groups[b]), alloc.dtype_fn(groups[b]), CPU)
    for b in (1, 2):
        alloc.free(b)
    alloc.allocate(5, padded(groups[5]), torch.bfloat16, CPU)  # unit 2 -> group 0 (its home)
    alloc.free(3)  # unit 1 releases group 1; unit 0's home (0) is held by unit 2
    with pytest.raises(RuntimeError, match="home miss #1: unit 0 home group 0 is owned by unit 2"):
        alloc.allocate(1, padded(groups[1]), torch.bfloat16, CPU)


def test_capture_without_max_pool_is_silent(capture_env, caplog):
    fcg = capture_env
    with caplog.at_level("INFO", logger="megatron.core.full_cuda_graph_homes"):
        capture(fcg, [torch.nn.Linear(1, 1)], False, [])
        assert fcg.make_max_pool_homes_strict([torch.nn.Linear(1, 1)]) == 0
    assert not [r for r in caplog.records if "home miss" in r.getMessage()]


# ------------------------------------------------------------------ 2-rank gloo job


def _worker(scenario: str, rank: int, world: int, out_dir: str, init_method: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init_method)
    sub = dist.new_group([0, 1])
    # Rank 1 of the "differ" job planned a bigger attention unit.
    attention = 5000 if (scenario == "differ" and rank == 1) else 700
    allocs = [MaxPoolAllocator("fsdp_params", hybrid_groups(attention), numel_fn=padded)]
    fp = sym.plan_fingerprint(allocs)
    res: dict[str, Any] = {"fingerprint": fp, "error": None}
    try:
        sym.check_plans_agree(fp, [dist.group.WORLD, sub])
    except RuntimeError as exc:
        res["error"] = str(exc)
    if scenario == "agree":  # full staging with real gloo barriers
        gmb = CpuGlobalMemoryBuffer()
        mpa.get_global_memory_buffer = lambda: gmb
        buf = make_buffer([], ubr_groups=())
        buf.ubr_groups = [sub]
        record = sym.stage_symmetric_max_pool(buf, policy_from_config(buf.ddp_config))
        res["staged_fingerprint"] = record.fingerprint
        res["arenas"] = [list(a) for a in record.arenas]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def _run_job(scenario: str, tmp_path: Path) -> list[dict[str, Any]]:
    return run_ranks(scenario, tmp_path, n_inits=1, worker=Path(__file__), timeout_s=JOB_TIMEOUT_S)


def test_two_rank_equal_plans_pass_and_stage(tmp_path):
    ranks = _run_job("agree", tmp_path)
    assert ranks[0]["error"] is None and ranks[1]["error"] is None
    assert ranks[0]["fingerprint"] == ranks[1]["fingerprint"]
    assert ranks[0]["arenas"] == ranks[1]["arenas"] and len(ranks[0]["arenas"]) == 6


def test_two_rank_different_plans_fail_naming_both_hashes(tmp_path):
    ranks = _run_job("differ", tmp_path)
    fp0, fp1 = ranks[0]["fingerprint"], ranks[1]["fingerprint"]
    assert fp0 != fp1
    for r, res in enumerate(ranks):
        msg = res["error"]
        assert msg is not None, f"rank {r} did not detect the mismatch"
        assert fp0 in msg and fp1 in msg, msg
        assert "max-pool plan mismatch on UBR group" in msg
        assert f"global rank {r} has plan hash {res['fingerprint']}" in msg


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
