"""Gradients of one-rank data-parallel groups ([Note: one-rank gradient groups]), on CPU.

The real ``GradReducePipeline._bucket_group_gradient_reduce`` runs here with fake CUDA streams and
a recording stand-in for the collectives. Upstream, an unsharded one-rank buffer with fp32 main
grads and a bf16 communication dtype came out (1 + 1/DP) times itself (the reduced copy was added
back); with the buffer's own dtype every micro-batch re-scaled the earlier ones. The references
are what a sharded buffer gives: the sum over micro-batches of each micro-batch's gradient
times the pre-scale.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb
from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP
from megatron.core.distributed.fsdp.src.megatron_fsdp.single_rank_grads import (
    HeldGrads,
    overwrites_main_grad,
    reduces_alone,
    scale_alone,
)

DP = 4  # the data-parallel size the pre-scale divides by (expert DP = 1 at EP = DP = 4)


class FakeGroup:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


class FakeStream:
    def wait_stream(self, other):
        pass

    def record_event(self):
        return SimpleNamespace(wait=lambda: None)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA streams as no-ops and every collective recorded; the one-rank reduce-scatter of a
    recorded call behaves as NCCL's (the op applied to the input, written to the output)."""
    calls = []

    def reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
        calls.append(("reduce_scatter", group.size()))
        scale = getattr(op, "premul", 1.0)
        output.copy_(input[: output.numel()] * scale)

    def all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append(("all_reduce", group.size()))

    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(pgb, "_coalescing_manager", lambda group: contextlib.nullcontext())
    monkeypatch.setattr(torch.distributed, "reduce_scatter_tensor", reduce_scatter_tensor)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "_make_nccl_premul_sum",
                        lambda f: SimpleNamespace(premul=f), raising=False)
    return calls


class OneRankBuffer:
    """The parts of an unsharded DataParallelBuffer the reduction reads: one bucket that is the
    whole buffer, reduced over a group of ``group_size`` ranks."""

    def __init__(self, data, group_size=1):
        self.data = data
        self.is_data_distributed = False
        self.data_parallel_group = FakeGroup(group_size)
        self.gradient_scaling_factor = 1.0 / DP
        self.shard_bucket_index = SimpleNamespace(bucket_data_index=0, local_data_index=0,
                                                  size=data.numel())

    def fetch_bucket(self, dtype=None):
        if dtype is None or dtype == self.data.dtype:
            return pgb.Bucket(data=self.data)
        return pgb.Bucket(data=self.data.to(dtype))

    def allocate_bucket_storage(self, dtype, device, init_values):
        return pgb.Bucket(data=init_values.detach().to(dtype).flatten().clone())

    def get_shard_from_bucket(self, bucket):
        return bucket.data

    def get_shard_from_local_buffer(self):
        return self.data

    def free_bucket_storage(self):
        pass

    def reset_param_main_grad(self):
        pass


def pipeline(gbuf, comm_dtype, strategy="optim_grads_params"):
    pipe = object.__new__(pgb.GradReducePipeline)
    pipe.buffer = SimpleNamespace(
        ddp_config=SimpleNamespace(fsdp_double_buffer=False, data_parallel_sharding_strategy=strategy,
                                   average_in_collective=False, gradient_reduce_div_fusion=True),
        mp_policy=SimpleNamespace(grad_comm_dtype=comm_dtype),
        dist_index=SimpleNamespace(use_hybrid_fsdp=False),
        parameter_groups=[SimpleNamespace(hsdp_comm_gbuf=None, params=[])],
    )
    pipe.rs_stream = None
    pipe.bucket_status = {0: pgb.BucketStatus.EMPTY}
    pipe.bucket_grad_ready_params = [set()]
    pipe.grad_reduce_queue = []
    pipe.get_fsdp_buffer = lambda bucket_id: gbuf
    return pipe


@pytest.mark.parametrize("comm_dtype", [None, torch.float32, torch.bfloat16])
def test_one_rank_reduction_is_the_prescale_once(fake_cuda, comm_dtype):
    """fp32 main grads, any communication dtype: the buffer becomes grads / DP, exactly, and no
    collective runs (upstream: (1 + 1/DP) x grads with bf16 communication)."""
    grads = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float32)
    gbuf = OneRankBuffer(grads.clone())
    pipeline(gbuf, comm_dtype)._bucket_group_gradient_reduce([0], async_op=False)
    assert torch.equal(gbuf.data, grads / DP), gbuf.data
    assert fake_cuda == []


def test_micro_batches_accumulate_then_scale_once(fake_cuda):
    """Three micro-batches held, then one reduction: the sharded reference, sum of g_k / DP
    (upstream's per-micro-batch reduction gave g1/DP^3 + g2/DP^2 + g3/DP)."""
    micro = [torch.tensor([4.0, 8.0]), torch.tensor([-4.0, 16.0]), torch.tensor([12.0, 0.0])]
    gbuf = OneRankBuffer(torch.zeros(2))
    param = object()
    held = HeldGrads(lambda p: reduces_alone(gbuf, use_hybrid_fsdp=False))
    pipe = pipeline(gbuf, None)
    for g in micro:
        gbuf.data += g  # the backward accumulates into the unsharded buffer
        assert held.select([param]) == [], "a one-rank parameter is held"
    assert held.release() == [param]  # the last backward's end
    pipe._bucket_group_gradient_reduce([0], async_op=False)
    assert torch.equal(gbuf.data, sum(g / DP for g in micro))
    assert len(held) == 0 and fake_cuda == []


def test_multi_rank_buffers_keep_the_collective(fake_cuda):
    """An unsharded buffer of a two-rank group is not one-rank: its reduction is upstream's."""
    gbuf = OneRankBuffer(torch.ones(4), group_size=2)
    pipeline(gbuf, None)._bucket_group_gradient_reduce([0], async_op=False)
    assert fake_cuda == [("reduce_scatter", 2)]


def test_hybrid_fsdp_and_sharded_buffers_are_not_alone():
    gbuf = OneRankBuffer(torch.ones(2))
    assert reduces_alone(gbuf, use_hybrid_fsdp=False)
    assert not reduces_alone(gbuf, use_hybrid_fsdp=True)
    gbuf.is_data_distributed = True
    assert not reduces_alone(gbuf, use_hybrid_fsdp=False)
    assert not reduces_alone(None, use_hybrid_fsdp=False)


@pytest.mark.parametrize("factor,avg,expected", [(0.25, False, 0.25), (None, False, 1.0),
                                                 (0.25, True, 1.0), (1.0, False, 1.0)])
def test_scale_alone_follows_the_reduce_op(factor, avg, expected):
    """SUM (no factor) and AVG over one rank are the identity; a factor scales."""
    data = torch.tensor([2.0, -6.0])
    scale_alone(data, factor, avg)
    assert torch.equal(data, torch.tensor([2.0, -6.0]) * expected)


def test_held_grads_select_and_release():
    alone, shared = "expert", "dense"
    held = HeldGrads(lambda p: p == alone)
    assert held.select([alone, shared]) == [shared]
    assert held.select([alone, shared]) == [shared]
    assert len(held) == 1  # held once, however many micro-batches
    assert held.release() == [alone] and held.release() == []  # once


def test_overwrite_main_grad_only_for_sharded_buckets():
    sharded = SimpleNamespace(_gbuf=SimpleNamespace(is_data_distributed=True))
    unsharded = SimpleNamespace(_gbuf=SimpleNamespace(is_data_distributed=False))
    assert overwrites_main_grad(sharded)
    assert not overwrites_main_grad(unsharded)
    assert overwrites_main_grad(SimpleNamespace())  # no buffer yet: upstream's default


def test_finish_grad_sync_reduces_what_was_held():
    """finish_grad_sync writes the queued gradients, then reduces held one-rank parameters, then
    waits on the reductions."""
    order = []
    fsdp = object.__new__(MegatronFSDP)
    object.__setattr__(fsdp, "_held_grads", HeldGrads(lambda p: True))
    object.__setattr__(fsdp, "_grad_writes", SimpleNamespace(flush=lambda: order.append(("flush",))))
    object.__setattr__(fsdp, "grad_reduce_pipeline", SimpleNamespace(
        reduce_gradients=lambda params, **kw: order.append(("reduce", list(params)))))
    object.__setattr__(fsdp, "ddp_config", SimpleNamespace(overlap_param_gather=False))
    object.__setattr__(fsdp, "synchronize_gradient_reduce", lambda: order.append(("wait",)))
    object.__setattr__(fsdp, "attach_grad_to_optimizer_state", lambda: None)
    object.__setattr__(fsdp, "_replace_param_with_distributed_if_needed", lambda: None)
    fsdp._held_grads.select(["w"])
    fsdp.finish_grad_sync()
    assert order == [("flush",), ("reduce", ["w"]), ("wait",)]
    order.clear()
    fsdp.finish_grad_sync()  # nothing held: nothing extra
    assert order == [("flush",), ("wait",)]


@pytest.mark.parametrize("distributed,accumulate", [(True, False), (False, True)])
def test_local_layer_te_gemm_adds_into_an_unsharded_buffer(monkeypatch, distributed, accumulate):
    """The TE branch of a local layer's fused wgrad: overwrite a sharded bucket, add into an unsharded
    buffer that holds the earlier micro-batches (invariant 3)."""
    from megatron.core.extensions import transformer_engine
    from tests.unit_tests.megatron_fsdp.test_wgrad_fusion_apex import _fsdp_weight, _linear

    seen = []

    def gemm(total_input, grad_output, out_dtype=None, layout="TN", out=None, grad=False, accumulate=False):
        seen.append(accumulate)
        product = (grad_output.float().t() @ total_input.float()).to(out.dtype)
        out.copy_(out + product if accumulate else product)

    monkeypatch.setattr(transformer_engine, "te_general_gemm", gemm)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    weight, bucket = _fsdp_weight(torch.float32)
    weight._gbuf = SimpleNamespace(is_data_distributed=distributed)
    earlier = bucket.clone()  # an earlier micro-batch's gradient (or a recycled bucket's bytes)
    x = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    out = _linear(x, weight, True)
    grad_output = torch.randn_like(out)
    out.backward(grad_output)
    product = grad_output.float().t() @ x.detach().float()
    assert seen == [accumulate]
    assert torch.equal(bucket, earlier + product if accumulate else product)


def test_zero_grad_buffer_discards_queued_writes_before_zeroing():
    """A backward interrupted before its end leaves writes queued: the next cycle must not get them."""
    order = []
    fsdp = object.__new__(MegatronFSDP)
    object.__setattr__(fsdp, "module", torch.nn.Linear(2, 2))
    object.__setattr__(fsdp, "_grad_writes", SimpleNamespace(discard=lambda: order.append("discard")))
    object.__setattr__(fsdp, "param_and_grad_buffer", SimpleNamespace(zero_grad=lambda: order.append("zero")))
    fsdp.zero_grad_buffer()
    assert order == ["discard", "zero"]


def test_megatron_fsdp_queues_the_writes_of_held_parameters_only():
    """A buffer that is not held is reduced right after its hook: its writes must not wait in the
    queue (GradWrites asks the held-gradient set, test_grad_writes.py holds GradWrites to it)."""
    import inspect

    source = inspect.getsource(MegatronFSDP)
    assert "self._grad_writes = GradWrites(self._held_grads.holds)" in source
    assert source.index("self._held_grads = HeldGrads(") < source.index("self._grad_writes = GradWrites(")
