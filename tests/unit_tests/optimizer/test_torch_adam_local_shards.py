"""The fallback Adam on DTensor parameters steps their local shards: same bits and state as
torch's DTensor path, no DTensor dispatch in the step (CPU, fake 2-rank process group)."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.core.optimizer.torch_adam_chunks import with_bounded_temporaries
from megatron.core.optimizer.torch_adam_local_shards import local_shards

SIZES = (7, 300, 5, 64, 1000, 3)


class DTensorOps(TorchDispatchMode):
    """Counts aten calls that reach the dispatcher with a DTensor among their arguments."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs or {}))[0]):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def mesh(fake_dp_world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,))


def _params(mesh, placement, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(DTensor.from_local(torch.randn(n), mesh, [placement], run_check=False))
            for n in SIZES]


def _groups(params):  # two groups with different hyperparameters, as Megatron builds them
    return [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0, "lr": 3e-4}]


@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["shard", "replicate"])
@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_local_shard_step_matches_the_dtensor_step(mesh, placement, foreach, cls):
    ref_params, new_params = _params(mesh, placement), _params(mesh, placement)
    ref = cls(_groups(ref_params), lr=1e-3, foreach=foreach)
    new = with_bounded_temporaries(cls, chunk_numel=400)(_groups(new_params), lr=1e-3, foreach=foreach)
    torch.manual_seed(1)
    for step in range(4):
        for p, q in zip(ref_params, new_params, strict=True):
            g = torch.randn_like(p.to_local())
            p.grad = DTensor.from_local(g.clone(), mesh, [placement], run_check=False)
            q.grad = DTensor.from_local(g.clone(), mesh, [placement], run_check=False)
        with DTensorOps() as ref_ops:
            ref.step()
        assert ref_ops.calls > 0  # the counter sees torch's own DTensor path
        with DTensorOps() as ops:
            new.step()
        if step > 0:  # the first step wraps the state it created; later ones touch no DTensor op
            assert ops.calls == 0, f"step {step}: {ops.calls} aten calls went through DTensor"
        for p, q in zip(ref_params, new_params, strict=True):
            assert isinstance(q, DTensor) and torch.equal(p.to_local(), q.to_local())
    for p, q in zip(ref_params, new_params, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            r, n = ref.state[p][key], new.state[q][key]
            assert isinstance(n, DTensor), f"{key} is {type(n).__name__}, torch's path makes a DTensor"
            assert (n.placements, n.shape, n.stride()) == (r.placements, r.shape, r.stride())
            assert torch.equal(r.to_local(), n.to_local())
        assert not isinstance(new.state[q]["step"], DTensor) and float(new.state[q]["step"]) == 4.0
        assert q._local_tensor.grad is None  # no gradient is left on the shard
    assert len(new.state) == len(new_params)  # no entry keyed by a local alias survives
    assert new.state_dict()["param_groups"] == ref.state_dict()["param_groups"]


def test_plain_tensors_and_non_dtensor_grads_are_stepped_as_they_are(mesh):
    plain = torch.nn.Parameter(torch.randn(5))
    dt = torch.nn.Parameter(DTensor.from_local(torch.randn(5), mesh, [Shard(0)], run_check=False))
    dt.grad = DTensor.from_local(torch.randn(5), mesh, [Shard(0)], run_check=False)
    opt = torch.optim.AdamW([plain, dt], lr=1e-3)
    with local_shards(opt, [plain, dt]) as stepped:
        assert stepped[0] is plain and not isinstance(stepped[1], DTensor)
        assert torch.equal(stepped[1].grad, dt.grad.to_local())
    no_grad = torch.nn.Parameter(DTensor.from_local(torch.randn(5), mesh, [Shard(0)], run_check=False))
    with local_shards(opt, [no_grad]) as stepped:
        assert not isinstance(stepped[0], DTensor) and stepped[0].grad is None
    assert len(opt.state) == 0


def test_state_is_restored_when_a_step_fails(mesh, monkeypatch):
    params = _params(mesh, Shard(0))
    opt = with_bounded_temporaries(torch.optim.AdamW, chunk_numel=400)(params, lr=1e-3)
    for p in params:
        p.grad = DTensor.from_local(torch.ones_like(p.to_local()), mesh, [Shard(0)], run_check=False)
    opt.step()
    before = {id(p): opt.state[p]["exp_avg"] for p in params}

    def boom(self, closure=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(torch.optim.AdamW, "step", boom)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert opt.param_groups[0]["params"] == params
    assert set(map(id, opt.state)) == set(before)  # keyed by the DTensor parameters only
    assert all(opt.state[p]["exp_avg"] is before[id(p)] for p in params)
