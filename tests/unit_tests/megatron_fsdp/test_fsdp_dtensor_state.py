"""CPU tests of the empty-shard optimizer state completion (optimizer-fsdp-dtensor-empty-shard-state).

The GPU symptom (2 x H200, hybrid resume recipes): both ranks stuck in all_gather_object inside
preprocess_state_dict_for_uneven_dtensor at the first fsdp_dtensor save, because params whose
local shard is empty had no Adam state on one rank. These tests build that situation with real
DTensors on a 1-rank gloo mesh (a DTensor whose local shard is empty but whose global shape is not).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rendezvous import init_one_rank_gloo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from megatron.core.optimizer.fsdp_dtensor_state import empty_shard_states


@pytest.fixture(scope="module")
def mesh():
    owns = not dist.is_initialized()
    if owns:
        init_one_rank_gloo()
    yield init_device_mesh("cpu", (1,))
    if owns:
        dist.destroy_process_group()


def dparam(mesh, global_shape, local):
    return torch.nn.Parameter(DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size(global_shape),
        stride=torch.empty(global_shape).stride()))


def adam_state(param):
    return {"step": torch.tensor(7.0), "exp_avg": torch.ones_like(param),
            "exp_avg_sq": torch.ones_like(param)}


def test_empty_shard_param_gets_the_same_keys_with_its_own_layout(mesh):
    full = dparam(mesh, (8, 4), torch.randn(8, 4))
    empty = dparam(mesh, (256,), torch.empty(0))  # e.g. a norm weight held by another rank
    state = {full: adam_state(full)}
    extra = empty_shard_states(state, [full, empty])
    assert list(extra) == [empty]
    new = extra[empty]
    assert sorted(new) == sorted(state[full])
    for key in ("exp_avg", "exp_avg_sq"):
        assert isinstance(new[key], DTensor)
        assert new[key].shape == (256,) and new[key].to_local().numel() == 0
        assert new[key].placements == empty.placements
    assert float(new["step"]) == 7.0 and new["step"] is not state[full]["step"]
    assert empty not in state  # the live optimizer state is left alone


def test_nothing_added_when_states_are_complete_or_absent(mesh):
    a = dparam(mesh, (4,), torch.randn(4))
    b = dparam(mesh, (4,), torch.randn(4))
    assert empty_shard_states({a: adam_state(a), b: adam_state(b)}, [a, b]) == {}
    # Before the first step nobody has state: every rank agrees on "no keys".
    empty = dparam(mesh, (4,), torch.empty(0))
    assert empty_shard_states({}, [a, empty]) == {}


def test_non_empty_param_without_state_is_not_invented(mesh):
    a = dparam(mesh, (4,), torch.randn(4))
    fresh = dparam(mesh, (3,), torch.randn(3))  # frozen or not stepped yet: not ours to fill
    assert empty_shard_states({a: adam_state(a)}, [a, fresh]) == {}


def test_distributed_optimizer_fsdp_dtensor_state_dict_has_every_param(mesh):
    """The hook in DistributedOptimizer.sharded_param_state_fsdp_dtensor (what the save walks)."""
    from types import SimpleNamespace

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    full = dparam(mesh, (8, 4), torch.randn(8, 4))
    empty = dparam(mesh, (256,), torch.empty(0))
    inner = SimpleNamespace(param_groups=[{"params": [full, empty]}], state={full: adam_state(full)})
    names = {full: "decoder.layers.0.mixer.in_proj.weight", empty: "decoder.final_norm.weight"}
    fake = SimpleNamespace(
        ddp_config=SimpleNamespace(use_megatron_fsdp=True), optimizer=inner, state=inner.state,
        _param_name=names.__getitem__, _param_groups_to_param2group_meta=lambda groups: {})
    sd = DistributedOptimizer.sharded_param_state_fsdp_dtensor(fake, is_loading=False)
    assert sorted(sd["state"]) == sorted(names.values())
    assert sorted(sd["state"]["decoder.final_norm.weight"]) == ["exp_avg", "exp_avg_sq", "step"]


def test_plain_tensor_state_is_refused_not_copied_under_another_name(mesh):
    full = dparam(mesh, (8, 4), torch.randn(8, 4))
    empty = dparam(mesh, (256,), torch.empty(0))
    state = {full: {"step": torch.tensor(1.0), "exp_avg": torch.ones(8, 4)}}  # not a DTensor
    with pytest.raises(TypeError, match="'exp_avg' is a plain \\(8, 4\\) tensor"):
        empty_shard_states(state, [full, empty])
