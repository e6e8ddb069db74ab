"""Row-wise FP8 shard quantization (opt-in): what it takes from TE's function and what it leaves.

Transformer Engine does not run on the CPU, so TE's pieces are stand-ins that record what they are
asked for; the GPU check (goldens bit-identical with the switch on) is a separate run.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp import fp8_shard_quantize as fsq


class Quantizer:
    made: list[Quantizer] = []

    def __init__(self, scale=None, amax=None, fp8_dtype="e4m3", *, rowwise=True, columnwise=True):
        self.scale, self.amax, self.dtype = scale, amax, fp8_dtype
        self.rowwise, self.columnwise = rowwise, columnwise
        self.force_pow_2_scales, self.amax_epsilon = False, 0.0
        self.updates: list[tuple[torch.Tensor, object]] = []
        Quantizer.made.append(self)

    def create_tensor_from_data(self, data, fake_dtype):
        return ("fragment", data, fake_dtype)

    def update_quantized(self, src, dst):
        self.updates.append((src, dst))


class CurrentQuantizer(Quantizer):
    pass


class Blockwise(Quantizer):
    pass


class F8:
    """A per-tensor FP8 weight: its quantizer, scale-inverse and dtype."""

    def __init__(self, quantizer, dtype=torch.bfloat16):
        self._q, self._scale_inv, self._fp8_dtype, self.dtype = quantizer, torch.ones(1), "e4m3", dtype
        self.device = torch.device("cpu")
        self.cleared = False

    def _get_quantizer(self):
        return self._q

    def clear_high_precision_init_val(self):
        self.cleared = True


@pytest.fixture
def te(monkeypatch):
    reduces: list[torch.Tensor] = []
    validated: list[object] = []

    def compute_amax(x, out):
        out.copy_(x.float().abs().max().reshape(1))

    def compute_scale(buf, lists, max_fp8, pow2, eps):
        for amax, scale, scale_inv in zip(*lists, strict=True):
            scale.copy_(max_fp8 / amax)
            scale_inv.copy_(amax / max_fp8)

    def scale_copy(buf, lists, factor):
        for src, dst in zip(*lists, strict=True):
            dst.copy_(src * factor)

    tex = types.SimpleNamespace(compute_amax=compute_amax, multi_tensor_compute_scale_and_scale_inv=compute_scale,
                                multi_tensor_scale=scale_copy,
                                DType=types.SimpleNamespace(kFloat8E4M3="e4m3", kFloat8E5M2="e5m2"))
    monkeypatch.setattr(fsq, "HAVE_ROWWISE_PATH", True)
    monkeypatch.setattr(fsq, "tex", tex, raising=False)
    monkeypatch.setattr(fsq, "multi_tensor_applier", lambda op, buf, lists, *a: op(buf, lists, *a), raising=False)
    monkeypatch.setattr(fsq, "Float8Tensor", F8, raising=False)
    monkeypatch.setattr(fsq, "Float8Quantizer", Quantizer, raising=False)
    monkeypatch.setattr(fsq, "Float8CurrentScalingQuantizer", CurrentQuantizer, raising=False)
    monkeypatch.setattr(fsq, "te_utils", types.SimpleNamespace(
        _validate_per_tensor_fp8_fsdp_hopper_policy=lambda w, s: validated.append(w)), raising=False)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None, group=None: reduces.append(t.clone()))
    Quantizer.made.clear()
    return types.SimpleNamespace(reduces=reduces, validated=validated)


def _inputs():
    current = [F8(CurrentQuantizer(fp8_dtype="e4m3")) for _ in range(3)]
    delayed = F8(Quantizer(torch.full((1,), 2.0), torch.zeros(1)))
    blockwise = F8(Blockwise())
    weights = [current[0], blockwise, current[1], delayed, current[2], current[0]]
    mains = [torch.tensor([1.0, -4.0]), torch.ones(2), None, torch.tensor([3.0]), torch.tensor([0.5]),
             torch.tensor([2.0])]
    shards = [torch.zeros(2, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8),
              torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8),
              (torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8))]
    return weights, mains, [0, 0, None, 0, 0, 0], shards


def test_without_the_pieces_of_te_it_needs_everything_is_left_to_te(te, monkeypatch) -> None:
    weights, mains, offsets, shards = _inputs()
    made_before = len(Quantizer.made)
    monkeypatch.setattr(fsq, "HAVE_ROWWISE_PATH", False)
    assert fsq.quantize_rowwise(weights, mains, offsets, None, shards) == list(range(6))
    assert not te.reduces and not te.validated and len(Quantizer.made) == made_before


def test_per_tensor_shards_go_row_wise_and_the_rest_to_te(te) -> None:
    weights, mains, offsets, shards = _inputs()
    made_before = len(Quantizer.made)
    rest = fsq.quantize_rowwise(weights, mains, offsets, None, shards)
    # blockwise, and a shard that comes with a transpose shard, are TE's
    assert rest == [1, 5]
    new = Quantizer.made[made_before:]
    assert new and all(q.rowwise and not q.columnwise for q in new)
    # one amax reduction per kind (delayed first), every per-tensor parameter in it, the one
    # whose main weight lives on another rank included
    assert [t.numel() for t in te.reduces] == [1, 3]
    assert te.reduces[1].tolist() == [4.0, 0.0, 0.5]
    casts = [(src, dst) for q in new for src, dst in q.updates]
    assert len(casts) == 3  # not the parameter without a main-weight shard
    assert all(src.dtype == torch.bfloat16 for src, _ in casts)  # cast to the model's dtype first, as TE does
    assert casts[0][1][0] == "fragment" and casts[0][1][1].shape == (1, 1)  # delayed: TE's one-row view
    assert [w for w in te.validated] == [weights[0], weights[2], weights[3], weights[4]]
    assert all(weights[i].cleared for i in (0, 2, 3, 4)) and not weights[1].cleared
    # current scaling: scale-inverse = amax / 448 written into the weights; delayed: 1 / scale
    assert weights[0]._scale_inv.item() == pytest.approx(4.0 / 448.0)
    assert weights[3]._scale_inv.item() == pytest.approx(0.5)
