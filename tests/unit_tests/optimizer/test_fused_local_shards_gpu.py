"""On a GPU with NVIDIA Apex: Apex's FusedAdam fails on DTensor parameters as Megatron-FSDP gives them, and
steps them under on_local_shards with the bits it gives their plain local tensors
([Note: Apex's fused optimizers and DTensors]). Each side runs in its own process (a CUDA fault ends it)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("amp_C") is None,
    reason="needs a GPU and NVIDIA Apex (tests/gpu/build_apex_wheel.sh)")]

SCRIPT = r'''
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from apex.optimizers import FusedAdam
from megatron.core.optimizer.fused_local_shards import on_local_shards

dist.init_process_group("nccl", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
mesh = init_device_mesh("cuda", (1,))
torch.manual_seed(0)
local = [torch.randn(n, device="cuda") for n in (1000, 37, 4096)]
grads = [[torch.randn_like(t) for t in local] for _ in range(3)]
dts = [torch.nn.Parameter(DTensor.from_local(t.clone(), mesh, [Shard(0)], run_check=False)) for t in local]
plain = [torch.nn.Parameter(t.clone()) for t in local]
cls = FusedAdam if sys.argv[1] == "raw" else on_local_shards(FusedAdam)
opt, ref = cls(dts, lr=1e-2, adam_w_mode=True), FusedAdam(plain, lr=1e-2, adam_w_mode=True)
for step_grads in grads:
    for p, q, g in zip(dts, plain, step_grads):
        p.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
        q.grad = g.clone()
    opt.step()
    ref.step()
torch.cuda.synchronize()
same = all(torch.equal(p.to_local(), q) for p, q in zip(dts, plain))
moved = all(not torch.equal(p.to_local(), t) for p, t in zip(dts, local))
state = all(isinstance(opt.state[p]["exp_avg"], DTensor) for p in dts)
print("RESULT", same, moved, state)
dist.destroy_process_group()
'''


def _run(mode: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), mode, str(tmp_path / f"store-{mode}")],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))


def test_wrapped_fused_adam_steps_dtensors_as_their_local_tensors(tmp_path: Path) -> None:
    out = _run("wrapped", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT True True True" in out.stdout, out.stdout + out.stderr[-2000:]


def test_raw_fused_adam_does_not_step_dtensors(tmp_path: Path) -> None:
    """Apex alone: a CUDA fault, an error, or parameters left unstepped; never the right update."""
    out = _run("raw", tmp_path)
    assert out.returncode != 0 or "RESULT True True" not in out.stdout, out.stdout
