"""Main-to-model weight copies as multi-tensor copies (mfsdp-main-to-model-foreach-copy.patch), on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb
from megatron.core.distributed.fsdp.src.megatron_fsdp.foreach_copy import PER_PARAM_GRAD_WRITES_ENV, add_all, copy_all


def test_copy_all_equals_copy_and_groups_by_dtype(monkeypatch):
    torch.manual_seed(0)
    srcs = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]
    dsts = [torch.empty(5, 3, dtype=torch.bfloat16), torch.empty(7, dtype=torch.bfloat16), torch.empty(2, 2)]
    launches = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (launches.append(len(d)), real(d, s)))
    assert copy_all(zip(dsts, srcs, strict=True)) == 2
    assert sorted(launches) == [1, 2]
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst, src.to(dst.dtype))


def test_copy_all_refuses_a_shape_mismatch():
    with pytest.raises(ValueError, match=r"destination shape \(2,\) != source shape \(3,\)"):
        copy_all([(torch.empty(2), torch.empty(3))])


class Buf:
    """An unsharded DataParallelBuffer's item access: consecutive items of ``data``."""

    def __init__(self, params, dtype):
        sizes = [p.numel() for p in params]
        self.data = torch.zeros(sum(sizes), dtype=dtype)
        self.param_idx = {p: i for i, p in enumerate(params)}
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.is_data_distributed = False
        self.data_parallel_group = None

    def get_item(self, item_id, only_shard=False):
        return self.data[self.offsets[item_id]:self.offsets[item_id + 1]]


def test_copy_main_weights_to_model_weights_copies_every_parameter():
    params = [torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(4))]
    mbuf, wbuf = Buf(params, torch.float32), Buf(params, torch.bfloat16)
    mbuf.data.copy_(torch.randn(10))
    buf = buffer_of(params, mbuf, wbuf)
    buf.copy_main_weights_to_model_weights()
    assert torch.equal(wbuf.data, mbuf.data.to(torch.bfloat16))


def buffer_of(params, mbuf, wbuf):
    """A ParamAndGradBuffer of one parameter group, as far as the main-to-model copy reads it."""
    buf = object.__new__(pgb.ParamAndGradBuffer)
    buf._main_to_model_pairs = None
    buf.model_weight_writes = None
    buf.double_buf_units = []  # no double buffer
    buf.parameter_groups = [SimpleNamespace(main_weight_buffer=mbuf, model_weight_buffer=wbuf,
                                            transpose_weight_buffer=None, is_expert_param=False, params=params,
                                            fsdp_unit_id=0)]
    return buf


def test_main_to_model_pairs_keeps_its_views_until_storage_moves():
    params = [torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(4))]
    mbuf, wbuf = Buf(params, torch.float32), Buf(params, torch.bfloat16)
    buf = buffer_of(params, mbuf, wbuf)
    first = buf.main_to_model_pairs()
    assert [tuple(m.shape) for m, _ in first] == [(6,), (4,)]
    assert [m.data_ptr() for m, _ in first] == [wbuf.data.data_ptr(), wbuf.data[6:].data_ptr()]
    assert buf.main_to_model_pairs() is first
    wbuf.data = torch.zeros_like(wbuf.data)
    moved = buf.main_to_model_pairs()
    assert moved is not first and moved[0][0].data_ptr() == wbuf.data.data_ptr()


def test_copy_main_weights_to_model_weights_skips_what_the_step_wrote_once():
    from megatron.core.optimizer.adam_model_writes import ModelWeightWrites

    params = [torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(4))]
    mbuf, wbuf = Buf(params, torch.float32), Buf(params, torch.bfloat16)
    mbuf.data.copy_(torch.arange(1.0, 11.0))
    buf = buffer_of(params, mbuf, wbuf)
    buf.model_weight_writes = writes = ModelWeightWrites([buf])
    writes.mark([wbuf.data[:6]])  # the step wrote the first parameter's model weight (here: left at 0)
    buf.copy_main_weights_to_model_weights()
    assert wbuf.data.tolist() == [0.0] * 6 + [7.0, 8.0, 9.0, 10.0]
    buf.copy_main_weights_to_model_weights()  # no step since: every pair
    assert torch.equal(wbuf.data, mbuf.data.to(torch.bfloat16))


def test_add_all_equals_add_and_groups_by_dtype(monkeypatch):
    torch.manual_seed(1)
    srcs = [torch.randn(4, dtype=torch.bfloat16), torch.randn(3, 2, dtype=torch.bfloat16), torch.randn(6)]
    dsts = [torch.randn(4, dtype=torch.bfloat16), torch.randn(3, 2), torch.randn(6)]
    want = [d.clone().add_(s) for d, s in zip(dsts, srcs, strict=True)]
    launches = []
    real = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda d, s: (launches.append(len(d)), real(d, s)))
    assert add_all(zip(dsts, srcs, strict=True)) == 3
    assert sorted(launches) == [1, 1, 1]
    for got, exp in zip(dsts, want, strict=True):
        assert torch.equal(got, exp)


def test_add_all_widens_a_mixed_dtype_group_through_one_copy(monkeypatch):
    """fp32 += bf16: the multi-tensor add needs one dtype, so the sources are widened into one
    scratch first (one copy, one add); the values are add_'s, which widens exactly too."""
    torch.manual_seed(2)
    srcs = [torch.randn(5, dtype=torch.bfloat16), torch.randn(2, 3, dtype=torch.bfloat16)]
    dsts = [torch.randn(5), torch.randn(2, 3)]
    want = [d.clone().add_(s) for d, s in zip(dsts, srcs, strict=True)]
    calls = []
    real_copy, real_add = torch._foreach_copy_, torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (
        calls.append(("copy", [t.dtype for t in d], [t.dtype for t in s])), real_copy(d, s)))
    monkeypatch.setattr(torch, "_foreach_add_", lambda d, s: (
        calls.append(("add", [t.dtype for t in d], [t.dtype for t in s])), real_add(d, s)))
    assert add_all(zip(dsts, srcs, strict=True)) == 1
    assert calls == [("copy", [torch.float32] * 2, [torch.bfloat16] * 2),
                     ("add", [torch.float32] * 2, [torch.float32] * 2)]
    for got, exp in zip(dsts, want, strict=True):
        assert torch.equal(got, exp)


def test_add_all_adds_wider_sources_one_pair_at_a_time(monkeypatch):
    """bf16 += fp32 rounds once in add_; narrowing the sources into a scratch would round twice."""
    monkeypatch.setattr(torch, "_foreach_add_", lambda d, s: pytest.fail("a narrowing multi-tensor add"))
    src = torch.tensor([1.0 + 2.0**-8 + 2.0**-16])  # just above half a bf16 step past 1: rounds up alone
    dst = torch.tensor([-(2.0**-15)], dtype=torch.bfloat16)  # the sum falls below half: rounds down
    want = dst.clone().add_(src)
    assert want.tolist() != dst.clone().add_(src.to(torch.bfloat16)).tolist(), "the two roundings differ here"
    assert add_all([(dst, src)]) == 1
    assert torch.equal(dst, want)


def test_add_all_per_param_switch_adds_one_pair_at_a_time(monkeypatch):
    monkeypatch.setattr(torch, "_foreach_add_", lambda d, s: pytest.fail("a multi-tensor add under the switch"))
    dsts, srcs = [torch.ones(2), torch.ones(3)], [torch.ones(2), torch.ones(3)]
    assert add_all(zip(dsts, srcs, strict=True), {PER_PARAM_GRAD_WRITES_ENV: "1"}) == 2
    assert all(torch.equal(d, torch.full_like(d, 2.0)) for d in dsts)


def test_add_all_refuses_a_shape_mismatch():
    with pytest.raises(ValueError, match=r"add_all: destination shape \(2,\) != source shape \(1, 2\)"):
        add_all([(torch.empty(2), torch.empty(1, 2))])
