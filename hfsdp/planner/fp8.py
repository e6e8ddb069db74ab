"""FP8 parameters in the plan: which parameters Megatron-FSDP keeps in FP8, and the bytes each takes.

[Note: FP8 parameters in the plan]
With ``--fp8-param-gather`` (Megatron's ``fp8_param``) Transformer Engine builds the weights of its
GEMM modules as quantized tensors. Megatron-FSDP puts such a parameter in a ``"float8"`` parameter
group (``_get_parameter_groups``): a TE quantized tensor, or, for a model built on the meta device as
the planner builds it, a parameter of a TE module with ``primary_weights_in_fp8`` whose init meta has
an ``fp8_meta_index`` (``ParamAndGradBuffer.__init__``; :func:`meta_fp8_params` applies the same
rule). Its weight buffer holds the raw FP8 bytes as ``torch.uint8``, one byte per element, so the
pool's uint8 arena is what the runtime allocates (``double_buffer.plan.planned_dtype_name``); its
gradients take the groups' main-grad dtype. What TE keeps beside the raw bytes lives outside the
FSDP buffers, in TE's own tensors, whole on every rank. Per parameter of shape (..., K), M the
product of the other dimensions, by recipe (TE's ``Float8Tensor`` and ``Float8BlockwiseQTensor``):

* ``delayed`` and ``tensorwise`` (``Float8Tensor``): ``_scale_inv``, one fp32; on Hopper the
  backward GEMMs need the transpose, M*K bytes;
* ``blockwise`` (``Float8BlockwiseQTensor``, weights in 2-D blocks of 128 x 128): the rowwise
  ``scale_inv``, ceil(M/128) x ceil(K/128) fp32 with the inner dimension rounded up to a multiple
  of 4 (``Float8BlockQuantizer.get_scale_shape``); the columnwise data, K*M bytes, and its
  ``scale_inv``, ceil(K/128) x ceil(M/128) fp32, rounded up likewise.

The transpose (columnwise data and scales) is made after a unit's all-gather for its backward
(``fp8_create_transpose_cache``) and dropped after it unless ``--keep-fp8-transpose-cache``: the
plan counts the scales of every FP8 parameter as held for the run, the transposes as held for the
run with that flag, else as at most the live units' worth at once. MXFP8 (Blackwell) keeps its
columnwise data in FSDP buffers of their own, a second pool the planner does not plan: refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hfsdp.usererror import UserError

# Recipes whose FP8 parameters the planner sizes, and the TE tensor class each one builds.
TENSOR_CLASS = {"delayed": "Float8Tensor", "tensorwise": "Float8Tensor", "blockwise": "Float8BlockwiseQTensor"}
BLOCK = 128  # Float8BlockQuantizer.block_len
SCALE_INNER_MULTIPLE = 4  # the inner dimension of a blockwise scale_inv is padded to a multiple of 4
FP32 = 4
FP8 = 1


@dataclass(frozen=True)
class Fp8ParamBytes:
    """Bytes of one FP8 parameter: ``data`` in the FSDP weight buffer, the rest TE's own."""

    data: int
    scale_inv: int
    transpose: int  # columnwise data plus its scales (blockwise), or the transpose

    @property
    def outside_buffer(self) -> int:
        return self.scale_inv + self.transpose


@dataclass(frozen=True)
class Fp8Param:
    """One parameter Megatron-FSDP keeps in FP8: its name, shape and FSDP unit (None: not in a unit)."""

    name: str
    shape: tuple[int, ...]
    unit_id: int | None


@dataclass(frozen=True)
class Fp8Layout:
    """The FP8 parameters of a layout and what their recipe keeps of each."""

    recipe: str
    keep_transpose: bool
    params: tuple[Fp8Param, ...]
    live_units: int = 2  # units whose transposes may exist at once ([Note: double buffer], live units)

    def sizes(self) -> list[Fp8ParamBytes]:
        return [param_bytes(p.shape, self.recipe) for p in self.params]

    def held_bytes(self) -> int:
        """Held for the whole run outside the FSDP buffers: every scale, and with
        ``--keep-fp8-transpose-cache`` every transpose."""
        return sum(s.scale_inv + (s.transpose if self.keep_transpose else 0) for s in self.sizes())

    def unit_transpose_bytes(self) -> dict[int | None, int]:
        """Transpose bytes per FSDP unit (None: parameters outside units)."""
        out: dict[int | None, int] = {}
        for p, s in zip(self.params, self.sizes(), strict=True):
            out[p.unit_id] = out.get(p.unit_id, 0) + s.transpose
        return out

    def transient_bytes(self) -> int:
        """At most this many transpose bytes at once when they are dropped after each unit's
        backward: the :attr:`live_units` largest units' worth, plus those of the parameters outside
        units (0 with ``--keep-fp8-transpose-cache``: counted in :meth:`held_bytes`)."""
        if self.keep_transpose:
            return 0
        per_unit = self.unit_transpose_bytes()
        largest = sorted((b for u, b in per_unit.items() if u is not None), reverse=True)
        return sum(largest[:self.live_units]) + per_unit.get(None, 0)

    def data_bytes(self) -> int:
        """The raw FP8 bytes of every FP8 parameter, unsharded (what the weight buffers hold)."""
        return sum(s.data for s in self.sizes())


def _m_k(shape: Iterable[int]) -> tuple[int, int]:
    dims = [int(d) for d in shape]
    if not dims or any(d < 0 for d in dims):
        raise ValueError(f"an FP8 parameter needs a non-empty shape of sizes >= 0, got {tuple(dims)}")
    return math.prod(dims[:-1]), dims[-1]


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def param_bytes(shape: Iterable[int], recipe: str) -> Fp8ParamBytes:
    """What an FP8 parameter of ``shape`` takes under ``recipe`` (see the note)."""
    m, k = _m_k(shape)
    data = m * k * FP8
    if recipe in ("delayed", "tensorwise"):
        return Fp8ParamBytes(data=data, scale_inv=FP32, transpose=data)
    if recipe == "blockwise":
        rowwise_scales = math.ceil(m / BLOCK) * _round_up(math.ceil(k / BLOCK), SCALE_INNER_MULTIPLE)
        columnwise_scales = math.ceil(k / BLOCK) * _round_up(math.ceil(m / BLOCK), SCALE_INNER_MULTIPLE)
        return Fp8ParamBytes(data=data, scale_inv=rowwise_scales * FP32,
                             transpose=data + columnwise_scales * FP32)
    raise ValueError(f"no FP8 parameter layout for recipe {recipe!r}; known: {sorted(TENSOR_CLASS)}")


def fp8_recipe(args: Any) -> str | None:
    """The recipe whose FP8 parameters the run keeps (None: no FP8 parameters); refuses what the
    planner cannot plan."""
    if not (getattr(args, "fp8", None) and getattr(args, "fp8_param_gather", False)):
        return None
    recipe = str(args.fp8_recipe)
    if recipe not in TENSOR_CLASS:
        raise UserError(
            f"--fp8-param-gather with --fp8-recipe {recipe}: the planner sizes FP8 parameters of the "
            f"recipes {', '.join(sorted(TENSOR_CLASS))} only (MXFP8 keeps its columnwise data in a second "
            "pool of FSDP buffers the planner does not plan; a custom recipe's layout is its own)",
            "plan with --fp8-recipe delayed, tensorwise or blockwise, or without --fp8-param-gather")
    return recipe


def _is_te_module(module: Any) -> bool:
    try:
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    except ImportError:
        return False
    return isinstance(module, TransformerEngineBaseModule)


def meta_fp8_params(model: Any, is_te_module: Any = _is_te_module) -> dict[str, tuple[bool, bool]]:
    """``meta_device_init_fp8_params`` as ``ParamAndGradBuffer`` builds it for a meta-device model:
    name -> (is FP8, needs transpose data), for each parameter of a TE module that keeps its weights
    in FP8 and gave the parameter an ``fp8_meta_index``. The transpose flag is MXFP8's, never set
    here (the planner refuses MXFP8). ``is_te_module``: the class test (TE's base module)."""
    names = {id(p): n for n, p in model.named_parameters()}
    found: dict[str, tuple[bool, bool]] = {}
    for module in model.modules():
        if not is_te_module(module) or not getattr(module, "primary_weights_in_fp8", False):
            continue
        for name, param in module.named_parameters(recurse=False):
            if module.param_init_meta[name].fp8_meta_index is not None:
                found[names[id(param)]] = (True, False)
    return found


def fp8_layout(model: Any, fp8_names: Mapping[str, tuple[bool, bool]], unit_of: Mapping[str, int | None],
               recipe: str, keep_transpose: bool, live_units: int = 2) -> Fp8Layout | None:
    """The FP8 parameters of ``model`` (those ``fp8_names`` marks), with their units; None if none."""
    params = tuple(Fp8Param(name, tuple(int(d) for d in p.shape), unit_of.get(name))
                   for name, p in model.named_parameters() if fp8_names.get(name, (False, False))[0])
    if not params:
        return None
    return Fp8Layout(recipe=recipe, keep_transpose=keep_transpose, params=params, live_units=live_units)


def _size(n: int) -> str:
    return f"{n:,} B ({n / 2**20:,.2f} MiB)"


def report_lines(fp8: Fp8Layout) -> list[str]:
    """The planner report's lines on FP8 parameters (see the note)."""
    transposes = sum(s.transpose for s in fp8.sizes())
    kept = ("held for the run (--keep-fp8-transpose-cache)" if fp8.keep_transpose else
            f"each made for its unit's backward and dropped after it: up to {_size(fp8.transient_bytes())} at "
            f"once ({fp8.live_units} live units)")
    return [
        f"fp8 parameters: {len(fp8.params)} ({fp8.recipe}, TE {TENSOR_CLASS[fp8.recipe]}); their FP8 data, "
        f"{_size(fp8.data_bytes())}, in the weight buffers (torch.uint8, pooled with their unit's buckets)",
        f"fp8 outside the FSDP buffers, on every rank: {_size(fp8.held_bytes())} held for the run (scales"
        f"{', transposes' if fp8.keep_transpose else ''}); transposes {_size(transposes)}, {kept}",
    ]


def report_dict(fp8: Fp8Layout) -> dict[str, Any]:
    """The JSON plan's ``fp8`` entry (bytes as ints)."""
    return {"recipe": fp8.recipe, "tensor_class": TENSOR_CLASS[fp8.recipe], "params": len(fp8.params),
            "data_bytes": fp8.data_bytes(), "held_bytes": fp8.held_bytes(),
            "transpose_bytes": sum(s.transpose for s in fp8.sizes()), "transient_bytes": fp8.transient_bytes(),
            "keep_transpose": fp8.keep_transpose, "live_units": fp8.live_units}
