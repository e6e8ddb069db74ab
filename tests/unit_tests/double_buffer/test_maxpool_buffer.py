"""The max-pool double buffer inside a real ParamAndGradBuffer (built on CPU over a fake 2-rank
group), on every base: ``--megatron-fsdp-max-pool-double-buffer`` gives the fork's MaxPool for all
four pools (on 0.19.2 it replaces that release's MaxPoolAllocator: mfsdp-max-pool-fork-allocator.patch),
planned at the analytic minimum, and a forward and a backward over every unit keep their homes."""

from __future__ import annotations

import torch
from test_maxpool_allocator import install_cpu_memory_buffer

import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.allocator as mpa
import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.dtypes as bd
from hfsdp.planner import compare


class Layer(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.fc = torch.nn.ModuleList(torch.nn.Linear(8, width, bias=False) for _ in range(depth))


class Stack(torch.nn.Module):
    """A non-unit embedding, then units of unequal size and bucket count (as Mamba, attention
    and MoE layers are)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.layers = torch.nn.ModuleList(Layer(w, d) for w, d in ((16, 1), (24, 2), (16, 1), (40, 3), (8, 2)))


def test_max_pool_is_the_forks_at_the_analytic_minimum(cpu_fsdp_buffer, monkeypatch):
    install_cpu_memory_buffer(monkeypatch)
    torch.manual_seed(0)
    buffer = cpu_fsdp_buffer(Stack(), [Layer], megatron_fsdp_max_pool_double_buffer=True)
    pools = [buffer.weight_alloc, buffer.transpose_weight_alloc, buffer.main_grad_alloc]
    assert all(isinstance(a, mpa.MaxPool) for a in pools), [type(a).__mro__ for a in pools]
    alloc = buffer.weight_alloc
    specs = alloc.bucket_specs()
    assert len({s.unit_id for s in specs if s.unit_id is not None}) == 5
    assert alloc.plan.pool_bytes() == compare.analytic_minimum_bytes(specs, num_groups=2) > 0

    units: dict[int, list[int]] = {}
    for bucket_id, group in enumerate(buffer.parameter_groups):
        if group.fsdp_unit_id is not None:
            units.setdefault(group.fsdp_unit_id, []).append(bucket_id)
    order = sorted(units)
    for unit in [*order, *reversed(order)]:  # forward, then backward; one unit freed per new one
        for b in units[unit]:
            group = buffer.parameter_groups[b]
            alloc.allocate(b, group.model_weight_buffer.bucket_index.size, bd.planned_param_dtype(group),
                           torch.device("cpu"))
        if len(alloc.unit_group) > 1:
            oldest = next(u for u in alloc.unit_group if u != unit)
            for b in units[oldest]:
                alloc.free(b)
    stats = alloc.stats()
    assert stats["pool_bytes_allocated"] == stats["pool_bytes_planned"] == alloc.plan.pool_bytes()
    assert alloc.home_misses == 0
