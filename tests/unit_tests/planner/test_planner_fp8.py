"""The planner sizes FP8 parameters by their real layout ([Note: FP8 parameters in the plan] in
hfsdp/planner/fp8.py): one byte per element in the weight buffers and the pool, and TE's scales and
transposes beside them, per recipe. Every expected figure is worked out by hand in the test.

Transformer Engine is not needed: a stand-in module carries the two attributes the runtime's rule
reads of a TE module (``primary_weights_in_fp8`` and ``param_init_meta[name].fp8_meta_index``).
"""

from __future__ import annotations

import types

import pytest
import torch

from hfsdp.planner import fp8 as F
from hfsdp.planner import layout as L
from hfsdp.planner import report as R
from hfsdp.usererror import UserError


class StandInTELinear(torch.nn.Module):
    """A TE linear built under FP8 model init: its weight has an FP8 meta index, its bias none."""

    primary_weights_in_fp8 = True

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(d_out, d_in, dtype=torch.bfloat16))
        self.param_init_meta = {"weight": types.SimpleNamespace(fp8_meta_index=0)}
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(d_out, dtype=torch.bfloat16))
            self.param_init_meta["bias"] = types.SimpleNamespace(fp8_meta_index=None)


class Unit(torch.nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.empty(d, dtype=torch.bfloat16))
        self.fc1 = StandInTELinear(d, h)
        self.fc2 = StandInTELinear(h, d)


class Model(torch.nn.Module):
    """A non-unit embedding and units of hidden 512, 128, 512 around width 256."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.empty(64, 256, dtype=torch.bfloat16))
        self.layers = torch.nn.ModuleList([Unit(256, 512), Unit(256, 128), Unit(256, 512)])


def is_stand_in(module: torch.nn.Module) -> bool:
    return isinstance(module, StandInTELinear)


def layout(recipe: str | None, keep: bool = False, live_units: int = 2) -> L.Layout:
    with torch.device("meta"):
        model = Model()
    names = F.meta_fp8_params(model, is_te_module=is_stand_in) if recipe else {}
    return L.compute_layout(model, unit_classes=[Unit], strategy="optim_grads_params", dp_size=2,
                            fp8_names=names, fp8_recipe=recipe, keep_fp8_transpose=keep, live_units=live_units)


def test_the_runtime_rule_marks_te_weights_with_an_fp8_meta_index_only():
    lin = StandInTELinear(256, 128, bias=True)
    assert F.meta_fp8_params(lin, is_te_module=is_stand_in) == {"weight": (True, False)}
    lin.primary_weights_in_fp8 = False  # built outside FP8 model init: bf16 weights
    assert F.meta_fp8_params(lin, is_te_module=is_stand_in) == {}
    assert F.meta_fp8_params(Model(), is_te_module=lambda m: False) == {}


@pytest.mark.parametrize("shape, recipe, expected", [
    # Float8Tensor: M*K bytes of data, one fp32 scale, a transpose of M*K bytes.
    ((768, 256), "delayed", F.Fp8ParamBytes(data=196608, scale_inv=4, transpose=196608)),
    ((768, 256), "tensorwise", F.Fp8ParamBytes(data=196608, scale_inv=4, transpose=196608)),
    # blockwise, 128 x 128 blocks: rowwise scales ceil(768/128)=6 x roundup4(ceil(256/128)=2)=4 -> 24 fp32 = 96 B;
    # columnwise data 196608 B plus scales ceil(256/128)=2 x roundup4(6)=8 -> 16 fp32 = 64 B.
    ((768, 256), "blockwise", F.Fp8ParamBytes(data=196608, scale_inv=96, transpose=196672)),
    # 3-D: M = 4*512 = 2048, K = 256: rowwise 16 x 4 = 64 fp32 = 256 B; columnwise 2 x 16 = 32 fp32 = 128 B.
    ((4, 512, 256), "blockwise", F.Fp8ParamBytes(data=524288, scale_inv=256, transpose=524416)),
    # Ragged: M=1000, K=130: rowwise ceil(1000/128)=8 x roundup4(2)=4 -> 32 fp32 = 128 B;
    # columnwise ceil(130/128)=2 x roundup4(8)=8 -> 16 fp32 = 64 B.
    ((1000, 130), "blockwise", F.Fp8ParamBytes(data=130000, scale_inv=128, transpose=130064)),
])
def test_one_parameter_by_recipe(shape, recipe, expected):
    assert F.param_bytes(shape, recipe) == expected


def test_fp8_parameters_are_one_byte_in_the_weight_pool():
    """Weight pool at DP=2: 2 groups x (the uint8 arena of the largest unit, 2 x 512 x 256 = 262144 B,
    plus the bf16 arena of its norm, 256 x 2 B). Without FP8 parameters the unit is one bf16 bucket of
    256 + 262144 = 262400 elements, padded to a multiple of DP x its chunk factor (2 x 512): 263168."""
    fp8 = layout("delayed")
    weight = R.plan_allocator(fp8, "weight")["maxpool"]
    assert weight.arena_numel == {"torch.bfloat16": 256, "torch.uint8": 262144}
    assert weight.pool_bytes() == 2 * (262144 * 1 + 256 * 2) == 525312
    assert [b.dtype for b in fp8.buckets if b.unit_id == 0] == ["torch.bfloat16", "float8"]
    plain = R.plan_allocator(layout(None), "weight")["maxpool"]
    assert plain.pool_bytes() == 2 * 263168 * 2 == 1052672


def test_fp8_gradients_are_planned_in_the_main_grad_dtype():
    """FP8 groups' grads are bf16 unless a main-grad dtype is set: one bf16 arena of the norm (256)
    and the weights' grads at offset 256 (512 B, aligned): 262400 elements, 2 groups."""
    fp8 = layout("tensorwise")
    assert R.plan_allocator(fp8, "grad")["maxpool"].pool_bytes() == 2 * 262400 * 2 == 1049600
    fp32 = R.plan_allocator(fp8, "grad", main_grads_dtype=torch.float32)["maxpool"]
    assert fp32.pool_bytes() == 2 * 262400 * 4


def test_delayed_keeps_a_scale_per_parameter_and_transposes_per_live_unit():
    """6 FP8 weights: 6 scales of 4 B. Transposes: units of 262144, 65536 and 262144 B; 2 live units
    hold at most the two largest, 524288 B; with --keep-fp8-transpose-cache all 589824 B are held."""
    fp8 = layout("delayed").fp8
    assert fp8 is not None and len(fp8.params) == 6 and fp8.data_bytes() == 589824
    assert fp8.held_bytes() == 24
    assert fp8.unit_transpose_bytes() == {0: 262144, 1: 65536, 2: 262144}
    assert fp8.transient_bytes() == 524288
    assert layout("delayed", live_units=3).fp8.transient_bytes() == 589824
    kept = layout("delayed", keep=True).fp8
    assert kept.held_bytes() == 24 + 589824 and kept.transient_bytes() == 0


def test_blockwise_keeps_block_scales_and_a_columnwise_copy():
    """Unit of hidden 512: fc1 (512, 256): rowwise 4 x 4 = 16 fp32 = 64 B, columnwise 2 x 4 = 8 fp32 = 32 B;
    fc2 (256, 512): rowwise 2 x 4 = 32 B, columnwise 4 x 4 = 64 B. Unit of hidden 128: fc1 (128, 256):
    rowwise 1 x 4 = 16 B, columnwise 2 x 4 = 32 B; fc2 (256, 128): rowwise 2 x 4 = 32 B, columnwise 1 x 4 = 16 B.
    Held: rowwise scales 2 x (64 + 32) + (16 + 32) = 240 B. Transposes: 262144 + 96 = 262240 B per large
    unit, 65536 + 48 = 65584 B for the small one."""
    fp8 = layout("blockwise").fp8
    assert fp8.held_bytes() == 240
    assert fp8.unit_transpose_bytes() == {0: 262240, 1: 65584, 2: 262240}
    assert fp8.transient_bytes() == 2 * 262240
    assert layout("blockwise", keep=True).fp8.held_bytes() == 240 + 2 * 262240 + 65584


def test_the_report_and_the_json_say_it():
    lay = layout("blockwise")
    lines = R.format_report(lay, [R.plan_allocator(lay, "weight")])
    assert ("fp8 parameters: 6 (blockwise, TE Float8BlockwiseQTensor); their FP8 data, 589,824 B (0.56 MiB), in "
            "the weight buffers (torch.uint8, pooled with their unit's buckets)") in lines
    assert any(line.startswith("fp8 outside the FSDP buffers, on every rank: 240 B") for line in lines), lines
    out = R.report_dict(lay, [R.plan_allocator(lay, "weight")])
    assert out["fp8"] == {"recipe": "blockwise", "tensor_class": "Float8BlockwiseQTensor", "params": 6,
                          "data_bytes": 589824, "held_bytes": 240, "transpose_bytes": 2 * 262240 + 65584,
                          "transient_bytes": 524480, "keep_transpose": False, "live_units": 2}
    assert "fp8" not in R.report_dict(layout(None), [R.plan_allocator(layout(None), "weight")])


def test_rank_memory_counts_what_te_holds_outside_the_buffers(megatron_args):
    from hfsdp.planner.memory import planned_memory

    args = megatron_args(["--bf16"])
    lay = layout("blockwise")
    memory = planned_memory(args, lay, [R.plan_allocator(lay, "weight")], None)
    assert memory.fp8_scales == 240
    assert "fp8 scales" in memory.describe()
    plain = layout(None)
    assert "fp8 scales" not in planned_memory(args, plain, [R.plan_allocator(plain, "weight")], None).describe()


def run_args(**flags):
    return types.SimpleNamespace(**{"fp8": "e4m3", "fp8_param_gather": True, "fp8_recipe": "delayed", **flags})


@pytest.mark.parametrize("flags, recipe", [
    ({}, "delayed"), ({"fp8_recipe": "tensorwise"}, "tensorwise"), ({"fp8_recipe": "blockwise"}, "blockwise"),
    ({"fp8_param_gather": False}, None),  # bf16 parameters: FP8 only inside TE's autocast
    ({"fp8": None}, None),
])
def test_the_run_flags_choose_the_layout(flags, recipe):
    assert F.fp8_recipe(run_args(**flags)) == recipe


@pytest.mark.parametrize("recipe", ["mxfp8", "custom"])
def test_recipes_the_planner_cannot_size_are_refused(recipe):
    with pytest.raises(UserError, match=f"--fp8-param-gather with --fp8-recipe {recipe}: the planner sizes"):
        F.fp8_recipe(run_args(fp8_recipe=recipe))


def test_fp8_names_need_their_recipe():
    with torch.device("meta"):
        model = Model()
    with pytest.raises(ValueError, match="6 FP8 parameters given without their recipe"):
        L.compute_layout(model, unit_classes=[Unit], strategy="optim_grads_params", dp_size=2,
                         fp8_names=F.meta_fp8_params(model, is_te_module=is_stand_in))
