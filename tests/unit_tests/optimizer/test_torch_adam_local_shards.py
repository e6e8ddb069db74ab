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


def test_plain_tensors_are_stepped_as_they_are_beside_swapped_dtensors(mesh):
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


def _with_grad(mesh, local, placement, grad_local, grad_placement):
    p = torch.nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False))
    p.grad = DTensor.from_local(grad_local, mesh, [grad_placement], run_check=False)
    return p


@pytest.mark.parametrize("odd", ["replicate-grad", "plain-grad", "replicate-state"])
def test_a_list_with_another_layout_is_not_swapped(mesh, odd):
    """A gradient or state of another layout needs DTensor's redistribution: the whole list (foreach
    cannot mix DTensors and plain tensors) is stepped as it is."""
    good = _with_grad(mesh, torch.randn(4), Shard(0), torch.randn(4), Shard(0))
    # Shard(0) of a global (8,) parameter; a Replicate gradient holds all 8 elements on each rank.
    other = _with_grad(mesh, torch.randn(4), Shard(0), torch.randn(8), Replicate())
    opt = torch.optim.AdamW([good, other], lr=1e-3)
    if odd == "plain-grad":  # a plain tensor of the global size (autograd refuses the local size)
        other.grad = torch.randn(8)
    elif odd == "replicate-state":
        other.grad = DTensor.from_local(torch.randn(4), mesh, [Shard(0)], run_check=False)
        opt.state[other] = {"step": torch.tensor(1.0), "exp_avg": DTensor.from_local(
            torch.zeros(8), mesh, [Replicate()], run_check=False)}
    with local_shards(opt, [good, other]) as stepped:
        assert stepped[0] is good and stepped[1] is other
    assert set(map(id, opt.state)) <= {id(other)}


def test_a_mixed_list_steps_as_torch_does(mesh):
    def build():
        torch.manual_seed(3)
        params = _params(mesh, Shard(0))
        for p in params:
            p.grad = DTensor.from_local(torch.randn_like(p.to_local()), mesh, [Shard(0)], run_check=False)
        full = torch.randn(2 * 5)  # a Replicate gradient of a Shard(0) parameter of 2 x 5 elements
        odd = _with_grad(mesh, torch.randn(5), Shard(0), full, Replicate())
        return params + [odd]

    ref_params, new_params = build(), build()
    ref = torch.optim.AdamW(ref_params, lr=1e-3)
    new = with_bounded_temporaries(torch.optim.AdamW)(new_params, lr=1e-3)  # one chunk: all of them
    ref.step()
    new.step()
    for p, q in zip(ref_params, new_params, strict=True):
        assert torch.equal(p.to_local(), q.to_local())


def test_zero_dim_dtensor_parameters_get_dtensor_state(mesh):
    def build():
        torch.manual_seed(4)
        p = torch.nn.Parameter(DTensor.from_local(torch.randn(()), mesh, [Replicate()], run_check=False))
        p.grad = DTensor.from_local(torch.randn(()), mesh, [Replicate()], run_check=False)
        return p

    p, q = build(), build()
    ref = torch.optim.AdamW([p], lr=1e-3)
    new = with_bounded_temporaries(torch.optim.AdamW)([q], lr=1e-3)
    for _ in range(2):
        ref.step()
        new.step()
    assert torch.equal(p.to_local(), q.to_local())
    for key in ("exp_avg", "exp_avg_sq"):
        assert isinstance(ref.state[p][key], DTensor) and isinstance(new.state[q][key], DTensor), key
        assert torch.equal(ref.state[p][key].to_local(), new.state[q][key].to_local()), key
    assert not isinstance(new.state[q]["step"], DTensor)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_dict_matches_and_round_trips(mesh, amsgrad):
    ref_params, new_params = _params(mesh, Shard(0)), _params(mesh, Shard(0))
    ref = torch.optim.AdamW(_groups(ref_params), lr=1e-3, amsgrad=amsgrad)
    new = with_bounded_temporaries(torch.optim.AdamW, chunk_numel=400)(_groups(new_params), lr=1e-3, amsgrad=amsgrad)
    torch.manual_seed(5)
    for _ in range(2):
        for p, q in zip(ref_params, new_params, strict=True):
            g = torch.randn_like(p.to_local())
            p.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
            q.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
        ref.step()
        new.step()

    def flat(state_dict):
        return {(i, k): (type(v).__name__, v.to_local() if isinstance(v, DTensor) else v)
                for i, st in state_dict["state"].items() for k, v in st.items()}

    want, got = flat(ref.state_dict()), flat(new.state_dict())
    assert want.keys() == got.keys()
    for key, (kind, value) in want.items():
        assert got[key][0] == kind and torch.equal(got[key][1], value), key
    again = with_bounded_temporaries(torch.optim.AdamW, chunk_numel=400)(_groups(new_params), lr=1e-3, amsgrad=amsgrad)
    again.load_state_dict(new.state_dict())
    for key, (kind, value) in flat(again.state_dict()).items():
        assert got[key][0] == kind and torch.equal(got[key][1], value), key


def test_no_alias_survives_a_first_step_that_fails(mesh, monkeypatch):
    params = _params(mesh, Shard(0))
    opt = with_bounded_temporaries(torch.optim.AdamW, chunk_numel=400)(params, lr=1e-3)
    for p in params:
        p.grad = DTensor.from_local(torch.ones_like(p.to_local()), mesh, [Shard(0)], run_check=False)

    def half_step(self, closure=None):  # makes state for the shown aliases, then fails
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p)}
        raise RuntimeError("boom")

    monkeypatch.setattr(torch.optim.AdamW, "step", half_step)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert opt.param_groups[0]["params"] == params
    assert all(isinstance(k, DTensor) for k in opt.state), "an entry keyed by a local alias survived"
    assert all(isinstance(opt.state[p]["exp_avg"], DTensor) for p in opt.state)


def test_state_is_restored_when_a_step_fails(mesh, step_fails):
    params = _params(mesh, Shard(0))
    opt = with_bounded_temporaries(torch.optim.AdamW, chunk_numel=400)(params, lr=1e-3)
    for p in params:
        p.grad = DTensor.from_local(torch.ones_like(p.to_local()), mesh, [Shard(0)], run_check=False)
    opt.step()
    before = {id(p): opt.state[p]["exp_avg"] for p in params}
    step_fails(opt, params)
    assert set(map(id, opt.state)) == set(before)  # keyed by the DTensor parameters only
    assert all(opt.state[p]["exp_avg"] is before[id(p)] for p in params)
