"""The multi-tensor fallback without TE or Apex (megatron/core/multi_tensor_fallback.py): the same
bits as the per-element reference, with one device-to-host copy for the norm (CPU; the copy count
on a GPU)."""

import warnings

import pytest
import torch

from megatron.core import multi_tensor_fallback as fallback
from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _tensors(sizes, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * (i + 1)).to(dtype=dtype, device=device) for i, n in enumerate(sizes)]


def _reference_total_norm(tensor_lists):
    """The fallback's reduction before this module: one item() per per-tensor norm."""
    return torch.norm(torch.tensor([[torch.norm(t) for t in tensor_list] for tensor_list in tensor_lists]))


def _same_bits(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), (a, b)


@pytest.mark.parametrize("dtypes", [(d,) for d in DTYPES] + [(torch.bfloat16, torch.float32),
                                                            (torch.float16, torch.bfloat16),
                                                            (torch.float32, torch.float64)],
                         ids=lambda ds: "+".join(str(d).removeprefix("torch.") for d in ds))
@pytest.mark.parametrize("rows", [1, 2])
def test_host_norms_match_torch_tensor(dtypes, rows):
    norms = [[torch.norm(t).to(dtypes[(r + i) % len(dtypes)]) for i, t in enumerate(_tensors((5, 40, 3, 900), seed=r))]
             for r in range(rows)]
    _same_bits(fallback._host_norms(norms), torch.tensor(norms))


@pytest.mark.parametrize("norms", [[[]], [], [[], []]], ids=["empty-row", "no-rows", "empty-rows"])
def test_host_norms_without_elements(norms):
    _same_bits(fallback._host_norms(norms), torch.tensor(norms))


def test_host_norms_ragged_rows_fail_as_torch_tensor_does():
    norms = [[torch.tensor(1.0), torch.tensor(2.0)], [torch.tensor(3.0)]]
    with pytest.raises(ValueError):
        torch.tensor(norms)
    with pytest.raises(ValueError):
        fallback._host_norms(norms)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", [(1,), (7, 300, 5, 64, 1000, 3), tuple(range(1, 600, 7))], ids=["one", "six", "many"])
def test_total_norm_same_bits(dtype, sizes):
    lists = [_tensors(sizes, dtype)]
    _same_bits(fallback.total_norm(lists), _reference_total_norm(lists))


def test_total_norm_of_two_lists_is_that_of_one_list_of_both():
    a, b = _tensors((3, 50), seed=1), _tensors((8, 2), seed=2)
    _same_bits(fallback.total_norm([a, b]), _reference_total_norm([a, b]))
    assert torch.allclose(fallback.total_norm([a, b]), fallback.total_norm([a + b]))


@pytest.mark.parametrize("dtype,dst_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("factor", [0.3141592653589793, 1.0, 2.5e-7])
def test_scale_out_of_place_same_bits(dtype, dst_dtype, factor):
    src = _tensors((7, 300, 5, 64), dtype)
    want = [torch.empty_like(s, dtype=dst_dtype) for s in src]
    got = [torch.empty_like(s, dtype=dst_dtype) for s in src]
    for s, d in zip(src, want, strict=True):
        d.copy_(s * factor)
    fallback.scale(2048 * 32, None, [src, got], factor)
    for w, g in zip(want, got, strict=True):
        _same_bits(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_scale_in_place_same_bits_as_gradient_clipping_calls_it(dtype):
    grads, want = _tensors((7, 300, 5), dtype), _tensors((7, 300, 5), dtype)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), torch.finfo(dtype).tiny / 8])
    grads[1][:4], want[1][:4] = special, special
    factor = 1.0 / (3.7 + 1.0e-6)
    for w in want:
        w.copy_(w * factor)
    local_multi_tensor_scale(2048 * 32, None, [grads, grads], factor)  # through upstream's name
    for w, g in zip(want, grads, strict=True):
        _same_bits(g, w)


def test_scale_in_place_uses_one_foreach_call_for_fp32(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_foreach_mul_", lambda ts, f: calls.append(len(ts)) or [t.mul_(f) for t in ts])
    grads = _tensors((7, 300, 5))
    fallback.scale(1, None, [grads, grads], 0.5)
    fallback.scale(1, None, [_tensors((3,), torch.bfloat16)] * 2, 0.5)  # bf16 keeps the loop
    assert calls == [3], calls


def test_scale_rejects_lists_of_different_lengths():
    a = _tensors((3, 4))
    with pytest.raises(ValueError, match="2 sources for 1 destinations"):
        fallback.scale(1, None, [a, a[:1]], 2.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_l2_norm_copies_to_the_host_once_on_a_gpu():
    lists = [_tensors(tuple(range(1, 400, 4)), device="cuda")]

    def syncs(fn):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return out, sum("synchronizing" in str(w.message) for w in caught)

    (got, _), new = syncs(lambda: local_multi_tensor_l2_norm(2048 * 32, None, lists, False))
    ref, old = syncs(lambda: _reference_total_norm(lists))
    assert float(got[0]) == float(torch.tensor([float(ref)], dtype=torch.float)), (got, ref)
    assert new <= 3 < len(lists[0]) <= old, f"synchronizing calls: {new} now, {old} per element before"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_scale_in_place_same_bits_on_a_gpu(dtype):
    grads = _tensors((7, 3000, 5, 1 << 20), dtype, device="cuda")
    grads[0][:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), torch.finfo(dtype).tiny / 8])
    want = [g * (1.0 / (3.7 + 1.0e-6)) for g in grads]
    local_multi_tensor_scale(2048 * 32, None, [grads, grads], 1.0 / (3.7 + 1.0e-6))
    for w, g in zip(want, grads, strict=True):
        _same_bits(g, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_host_norms_on_two_devices_match_torch_tensor():
    norms = [[torch.norm(t) for t in _tensors((5, 40))] + [torch.norm(t) for t in _tensors((3,), device="cuda")]]
    _same_bits(fallback._host_norms(norms), torch.tensor(norms))
