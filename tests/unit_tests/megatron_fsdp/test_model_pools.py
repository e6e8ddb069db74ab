"""Two Megatron-FSDP models in one process: each its own arenas and NCCL pool, one freed alone.

Real ParamAndGradBuffers on CPU (``cpu_fsdp_buffer``, a fake DP=2 world) with the max-pool
double buffer; arenas are created as staging creates them (``presize``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp import model_pools
from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer import allocator
from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.allocator import buffer_max_pool_allocators
from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy import DoubleBufferPolicy, policy_from_config
from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import GlobalMemoryBuffer


class Unit(torch.nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, h)
        self.fc2 = torch.nn.Linear(h, d, bias=False)


class Net(torch.nn.Module):
    def __init__(self, hidden: tuple[int, ...]):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 8)
        self.layers = torch.nn.ModuleList(Unit(8, h) for h in hidden)


@pytest.fixture(autouse=True)
def gmb(monkeypatch):
    """A global memory buffer and scope registry of this test's own (other tests leave arenas behind)."""
    fresh = GlobalMemoryBuffer()
    monkeypatch.setattr(model_pools, "_owners", {})
    for module in (allocator, model_pools):
        monkeypatch.setattr(module, "get_global_memory_buffer", lambda: fresh)
    return fresh


def _model(build, hidden, scope=""):
    buf = build(Net(hidden), [Unit], pool_scope=scope, megatron_fsdp_max_pool_double_buffer=True)
    for alloc in buffer_max_pool_allocators(buf):
        alloc.presize(torch.device("cpu"))
    return SimpleNamespace(param_and_grad_buffer=buf)


def _arenas(model):
    return {a.arena_name(g, d): t for a in buffer_max_pool_allocators(model.param_and_grad_buffer)
            for (g, d), t in a.arenas.items()}


def test_two_models_in_two_scopes_get_their_own_arenas_and_plans(cpu_fsdp_buffer) -> None:
    policy_model = _model(cpu_fsdp_buffer, (24, 40, 24))
    reference = _model(cpu_fsdp_buffer, (16, 16), scope="ref")
    mine, theirs = _arenas(policy_model), _arenas(reference)
    assert mine and theirs and not set(mine) & set(theirs)
    assert all(name.startswith("ref.fsdp_") for name in theirs)
    assert {t.data_ptr() for t in mine.values()}.isdisjoint(t.data_ptr() for t in theirs.values())
    # each plan is its own model's: the larger units give the larger pool
    def pool(model):
        allocs = buffer_max_pool_allocators(model.param_and_grad_buffer)
        return sum(a.plan.pool_bytes() for a in allocs if a.plan is not None)

    assert pool(policy_model) > pool(reference) > 0
    assert model_pools.check_scopes(policy_model) == "" and model_pools.check_scopes(reference) == "ref"


def test_a_second_model_in_a_held_scope_is_refused(cpu_fsdp_buffer) -> None:
    first = _model(cpu_fsdp_buffer, (24, 24))
    model_pools.check_scopes(first)
    second = _model(cpu_fsdp_buffer, (16, 16))
    with pytest.raises(ValueError, match="pool scope '' already belongs to another .*with_pool_scope"):
        model_pools.check_scopes(second)
    model_pools.check_scopes(first)  # the owner asking again is fine


def test_freeing_one_model_leaves_the_others_arenas_in_place(cpu_fsdp_buffer, gmb) -> None:
    trained = _model(cpu_fsdp_buffer, (24, 40, 24))
    frozen = _model(cpu_fsdp_buffer, (16, 16), scope="ref")
    kept = {name: (t.data_ptr(), t.numel()) for name, t in _arenas(trained).items()}
    freed = _arenas(frozen)
    released = model_pools.release_model_pools(frozen)
    assert released.scope == "ref" and set(released.arenas) == set(freed)
    assert released.arena_bytes == sum(t.numel() * t.element_size() for t in freed.values())
    assert released.deregistered == 0  # no NCCL user buffers on CPU
    names = {k[0] for k in gmb.buffer}
    assert not names & set(freed)
    for name, (ptr, numel) in kept.items():
        now = next(t for (n, _), t in gmb.buffer.items() if n == name)
        assert (now.data_ptr(), now.numel()) == (ptr, numel)
    released_allocs = buffer_max_pool_allocators(frozen.param_and_grad_buffer)
    assert all(a.released and not a.arenas for a in released_allocs)
    with pytest.raises(RuntimeError, match="was released"):
        released_allocs[0].presize(torch.device("cpu"))
    # the scope is free again: a new reference model may take it
    model_pools.check_scopes(_model(cpu_fsdp_buffer, (16,), scope="ref"))


def test_freeing_under_a_live_graph_or_without_buffers_is_refused(cpu_fsdp_buffer) -> None:
    frozen = _model(cpu_fsdp_buffer, (16, 16), scope="ref")
    with pytest.raises(ValueError, match="full-iteration CUDA graph still lives"):
        model_pools.release_model_pools(frozen, graph_live=True)
    assert _arenas(frozen)  # nothing was freed
    with pytest.raises(ValueError, match="no Megatron-FSDP buffer"):
        model_pools.release_model_pools(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("scope", ["a b", "ref/1", "ré", 3])
def test_a_scope_that_is_not_a_name_is_refused_with_its_value(scope) -> None:
    with pytest.raises(ValueError, match="pool_scope must be letters, digits and _"):
        DoubleBufferPolicy(pool_scope=scope)


def test_the_scope_names_allocators_and_the_default_keeps_todays_names() -> None:
    assert DoubleBufferPolicy().scoped("fsdp_params") == "fsdp_params"
    assert DoubleBufferPolicy(pool_scope="ref").scoped("fsdp_params") == "ref.fsdp_params"


def test_a_bad_scope_leaves_the_config_as_it_was() -> None:
    from megatron.core.distributed import DistributedDataParallelConfig

    cfg = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                        use_distributed_optimizer=True, use_megatron_fsdp=True,
                                        megatron_fsdp_max_pool_double_buffer=True)
    before = getattr(cfg, "double_buffer_policy", None)  # 0.19.2's config builds none; its buffer builds it
    with pytest.raises(ValueError, match="pool_scope must be letters"):
        model_pools.with_pool_scope(cfg, "a b")
    assert getattr(cfg, "double_buffer_policy", None) is before and not hasattr(cfg, "megatron_fsdp_pool_scope")
    model_pools.with_pool_scope(cfg, "ref")
    assert cfg.double_buffer_policy.pool_scope == "ref" and policy_from_config(cfg).pool_scope == "ref"
