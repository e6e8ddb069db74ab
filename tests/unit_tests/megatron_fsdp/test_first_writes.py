"""First writes of one-rank gradient buffers ([Note: one-rank gradient groups], invariant 4), on CPU.

The real ``ParamAndGradBuffer.zero_grad``, ``GradReducePipeline._bucket_group_gradient_reduce`` and
local-layer weight-gradient GEMMs (TE's and Apex's branches, with stand-in kernels) run here. The
reference is the fill: zeros at every ``zero_grad``, every write adds. The buffer starts each cycle
holding the previous cycle's gradients, so a write that should have overwritten shows.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb
from megatron.core.distributed.fsdp.src.megatron_fsdp.single_rank_grads import (
    FRESH,
    FirstWrites,
    first_write_refusal,
    overwrites_main_grad,
    take_first_write,
)
from tests.unit_tests.megatron_fsdp import test_one_rank_grad_groups as one_rank
from tests.unit_tests.megatron_fsdp import test_wgrad_fusion_apex as apex
from tests.unit_tests.megatron_fsdp.test_one_rank_grad_groups import OneRankBuffer, pipeline
from tests.unit_tests.megatron_fsdp.test_wgrad_fusion_apex import _linear

fake_cuda = one_rank.fake_cuda  # the fixtures, shared with those tests
apex_kernel = apex.apex_kernel


def _buffer(params, gbuf, enabled: bool, hybrid: bool = False):
    """A ParamAndGradBuffer with what zero_grad reads: one parameter group over ``gbuf``."""
    buf = object.__new__(pgb.ParamAndGradBuffer)
    buf.ddp_config = SimpleNamespace(megatron_fsdp_cuda_graph_mode=True)  # keeps grad references
    buf.parameter_groups = [SimpleNamespace(main_grad_buffer=gbuf, hfsdp_helper_gbuf=None, params=params)]
    buf.dist_index = SimpleNamespace(use_hybrid_fsdp=hybrid)
    buf.first_writes = FirstWrites()
    buf.first_writes.enabled = enabled
    return buf


def _params(gbuf, shapes):
    """Parameters whose main grads are consecutive views of ``gbuf.data`` (a pad element between)."""
    params, offset = [], 0
    for shape in shapes:
        n = shape[0] * shape[1]
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
        view = gbuf.data[offset:offset + n].view(shape)
        p.get_main_grad = (lambda v: lambda: v)(view)
        p.main_grad = view
        p._gbuf = gbuf
        p.__fsdp_param__ = True
        params.append(p)
        offset += n + 1
    return params


def test_zero_grad_fills_once_then_marks():
    gbuf = OneRankBuffer(torch.full((9,), 5.0))
    params = _params(gbuf, [(2, 2), (1, 3)])
    buf = _buffer(params, gbuf, enabled=True)
    buf.zero_grad()
    assert torch.equal(gbuf.data, torch.zeros(9)), "the first zero_grad fills"
    assert all(getattr(p, FRESH) for p in params)
    gbuf.data.fill_(3.0)  # this cycle's gradients
    for p in params:
        setattr(p, FRESH, False)
    buf.zero_grad()
    assert torch.equal(gbuf.data, torch.full((9,), 3.0)), "later cycles only mark"
    assert all(getattr(p, FRESH) for p in params)


@pytest.mark.parametrize("case", ["off", "two-rank group", "hybrid FSDP", "storage moved"])
def test_zero_grad_fills_where_first_writes_do_not_apply(case):
    gbuf = OneRankBuffer(torch.full((5,), 5.0), group_size=2 if case == "two-rank group" else 1)
    params = _params(gbuf, [(2, 2)])
    buf = _buffer(params, gbuf, enabled=case != "off", hybrid=case == "hybrid FSDP")
    buf.zero_grad()
    gbuf.data.fill_(3.0)
    if case == "storage moved":
        gbuf.data = torch.full((5,), 3.0)
    buf.zero_grad()
    assert torch.equal(gbuf.data, torch.zeros(5)), case
    assert getattr(params[0], FRESH, False) == (case == "storage moved")


def test_overwrite_main_grad_while_fresh():
    unsharded = SimpleNamespace(_gbuf=SimpleNamespace(is_data_distributed=False))
    assert not overwrites_main_grad(unsharded)
    setattr(unsharded, FRESH, True)
    assert overwrites_main_grad(unsharded)
    assert take_first_write(unsharded) and not take_first_write(unsharded)
    assert not overwrites_main_grad(unsharded)


def test_reduction_zeroes_parameters_that_got_no_gradient(fake_cuda):
    gbuf = OneRankBuffer(torch.full((9,), 5.0))
    written, unwritten = _params(gbuf, [(2, 2), (1, 3)])
    setattr(unwritten, FRESH, True)
    pipe = pipeline(gbuf, None)
    pipe.buffer.parameter_groups = [SimpleNamespace(hsdp_comm_gbuf=None, params=[written, unwritten])]
    pipe._bucket_group_gradient_reduce([0], async_op=False)
    assert torch.equal(unwritten.main_grad, torch.zeros(1, 3))
    assert torch.equal(written.main_grad, torch.full((2, 2), 5.0 / 4))  # only the pre-scale (1/DP)
    assert not getattr(unwritten, FRESH)


def _te_gemm(monkeypatch):
    from megatron.core.extensions import transformer_engine

    def gemm(total_input, grad_output, out_dtype=None, layout="TN", out=None, grad=False, accumulate=False):
        product = (grad_output.float().t() @ total_input.float()).to(out.dtype)
        out.copy_(out + product if accumulate else product)

    monkeypatch.setattr(transformer_engine, "te_general_gemm", gemm)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def _cycles(enabled: bool, micro_batches: int = 3, cycles: int = 2) -> torch.Tensor:
    """``cycles`` optimizer cycles of ``micro_batches`` backwards through a local layer; the
    second parameter never gets a gradient. Returns the buffer after the last reduction."""
    gbuf = OneRankBuffer(torch.full((13,), 9.0))
    weight, idle = _params(gbuf, [(2, 4), (1, 3)])
    buf = _buffer([weight, idle], gbuf, enabled=enabled)
    pipe = pipeline(gbuf, None)
    pipe.buffer.parameter_groups = [SimpleNamespace(hsdp_comm_gbuf=None, params=[weight, idle])]
    torch.manual_seed(1)
    for _ in range(cycles):
        buf.zero_grad()
        for _ in range(micro_batches):
            weight.grad_added_to_main_grad = False
            x = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
            out = _linear(x, weight, True)
            out.backward(torch.randn_like(out))
            take_first_write(weight)  # what _grad_acc does after the layer's backward
        pipe.bucket_status = {0: pgb.BucketStatus.EMPTY}
        pipe._bucket_group_gradient_reduce([0], async_op=False)
    return gbuf.data.clone()


def test_local_layer_cycles_equal_the_fill_bit_for_bit(monkeypatch, fake_cuda):
    _te_gemm(monkeypatch)
    fill, first = _cycles(enabled=False), _cycles(enabled=True)
    assert torch.equal(first, fill), (first, fill)
    assert torch.equal(first[9:12], torch.zeros(3))  # the idle parameter, zeroed at the reduction


def test_apex_branch_zeroes_at_the_first_write_only(apex_kernel, fake_cuda):
    fill, first = _cycles(enabled=False), _cycles(enabled=True)
    assert torch.equal(first, fill), (first, fill)
    assert apex_kernel == ["fp32"] * 12


@pytest.mark.parametrize(("pp", "delay", "overlap", "reason"), [
    (1, False, False, None),
    (2, False, False, "pipeline parallelism (2 stages)"),
    (1, True, False, "delayed weight gradients"),
    (1, False, True, "overlapped expert-parallel"),
])
def test_first_write_refusal(pp, delay, overlap, reason):
    got = first_write_refusal(pp, delay, overlap)
    assert got is None if reason is None else reason in got, got
