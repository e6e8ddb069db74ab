"""Apex's fused optimizers on Megatron-FSDP's DTensors step their local shards
(optimizer-apex-fused-local-shards.patch, [Note: Apex's fused optimizers and DTensors]).

The stand-in plays Apex's contract on CPU: its step refuses any DTensor parameter, gradient or state
(Apex's kernels read raw data pointers), then updates plain tensors as torch's AdamW does. Wrapped,
it must give the bits and state torch's own DTensor path gives; unwrapped, it refuses (the GPU dies).
"""

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron.core.optimizer.fused_local_shards import on_local_shards

SIZES = (7, 300, 5, 64)


class KernelOnPlainTensors(torch.optim.AdamW):
    """Apex-like: the step's tensors must be plain (a DTensor's data pointer is not its shard's)."""

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                tensors = [p, p.grad, *[v for v in self.state.get(p, {}).values() if isinstance(v, torch.Tensor)]]
                if any(isinstance(t, DTensor) for t in tensors):
                    raise RuntimeError("CUDA error: an illegal memory access was encountered (stand-in)")
        return super().step(closure)


@pytest.fixture
def mesh(fake_dp_world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,))


def _params(mesh, placement):
    torch.manual_seed(0)
    return [torch.nn.Parameter(DTensor.from_local(torch.randn(n), mesh, [placement], run_check=False))
            for n in SIZES]


def _grads(mesh, placement, *param_lists):
    for ps in zip(*param_lists, strict=True):
        g = torch.randn_like(ps[0].to_local())
        for p in ps:
            p.grad = DTensor.from_local(g.clone(), mesh, [placement], run_check=False)


@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["shard", "replicate"])
def test_wrapped_step_matches_torchs_dtensor_step(mesh, placement):
    ref_params, new_params = _params(mesh, placement), _params(mesh, placement)
    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]
    ref = torch.optim.AdamW(groups(ref_params), lr=1e-3, foreach=False)
    new_cls = on_local_shards(KernelOnPlainTensors)
    new = new_cls(groups(new_params), lr=1e-3, foreach=False)
    assert isinstance(new, KernelOnPlainTensors) and new_cls.__name__ == "KernelOnPlainTensors"
    torch.manual_seed(1)
    for _ in range(3):
        _grads(mesh, placement, ref_params, new_params)
        ref.step()
        new.step()
        for p, q in zip(ref_params, new_params, strict=True):
            assert isinstance(q, DTensor) and torch.equal(p.to_local(), q.to_local())
    for p, q in zip(ref_params, new_params, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            r, n = ref.state[p][key], new.state[q][key]
            assert isinstance(n, DTensor) and (n.placements, n.shape) == (r.placements, r.shape)
            assert torch.equal(r.to_local(), n.to_local())
    assert len(new.state) == len(new_params)  # nothing keyed by a local alias is left
    assert all(g["params"] is not None and all(isinstance(p, DTensor) for p in g["params"])
               for g in new.param_groups)


def test_unwrapped_stand_in_refuses_dtensors(mesh):
    params = _params(mesh, Shard(0))
    opt = KernelOnPlainTensors(params, lr=1e-3)
    _grads(mesh, Shard(0), params)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        opt.step()


def test_a_gradient_of_another_layout_is_refused_not_passed_to_the_kernel(mesh):
    params = _params(mesh, Shard(0))
    opt = on_local_shards(KernelOnPlainTensors)(params, lr=1e-3)
    _grads(mesh, Shard(0), params)
    full = torch.randn(params[1].shape)  # the same global shape, replicated: another layout than the Shard(0) param
    params[1].grad = DTensor.from_local(full, mesh, [Replicate()], run_check=False)
    before = [p.to_local().clone() for p in params]
    with pytest.raises(TypeError, match=r"KernelOnPlainTensors cannot step DTensor parameters whose gradient or "
                                        r"state is laid out differently"):
        opt.step()
    assert all(torch.equal(b, p.to_local()) for b, p in zip(before, params, strict=True))
    assert all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"]) and len(opt.state) == 0


def test_a_step_that_raises_leaves_the_groups_and_state_as_they_were(mesh):
    params = _params(mesh, Shard(0))

    class Failing(KernelOnPlainTensors):
        def step(self, closure=None, **kwargs):
            super().step(closure, **kwargs)
            raise RuntimeError("after the update")

    opt = on_local_shards(Failing)(params, lr=1e-3)
    _grads(mesh, Shard(0), params)
    with pytest.raises(RuntimeError, match="after the update"):
        opt.step()
    assert opt.param_groups[0]["params"] == params
    assert set(opt.state) == set(params) and all(isinstance(opt.state[p]["exp_avg"], DTensor) for p in params)


def test_plain_parameters_pass_through():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(9)), torch.nn.Parameter(torch.randn(9))
    b.data.copy_(a.data)
    ref = torch.optim.AdamW([a], lr=1e-3)
    new = on_local_shards(KernelOnPlainTensors)([b], lr=1e-3)
    a.grad, b.grad = torch.ones(9), torch.ones(9)
    ref.step()
    new.step()
    assert torch.equal(a, b) and new.param_groups[0]["params"][0] is b


def test_megatron_takes_apexs_classes_wrapped(tmp_path):
    """With Apex (a stand-in) importable and TE absent, megatron.core.optimizer's Adam and SGD are Apex's
    classes under on_local_shards."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is importable here: Megatron takes its optimizers first")
    (tmp_path / "apex" / "optimizers").mkdir(parents=True)
    (tmp_path / "apex" / "__init__.py").write_text("")
    (tmp_path / "apex" / "optimizers" / "__init__.py").write_text(
        "import torch\nclass FusedAdam(torch.optim.AdamW): ...\nclass FusedSGD(torch.optim.SGD): ...\n")
    code = ("import apex.optimizers as a, megatron.core.optimizer as o\n"
            "print(o.USING_PYTORCH_OPTIMIZER, o.Adam is not a.FusedAdam and issubclass(o.Adam, a.FusedAdam),"
            " o.SGD is not a.FusedSGD and issubclass(o.SGD, a.FusedSGD), o.Adam.__module__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "True", "megatron.core.optimizer.fused_local_shards"], out.stdout
