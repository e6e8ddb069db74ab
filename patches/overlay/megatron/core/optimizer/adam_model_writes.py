# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Transformer Engine's FusedAdam writes Megatron-FSDP's model weights in its update.

[Note: Adam writes the model weights]
Megatron-FSDP's optimizer steps the fp32 main weights; ``copy_main_weights_to_model_weights``
then casts each into its model weight (bf16): one more pass over memory after the update,
reading 4 bytes and writing 2 a parameter. TE's ``multi_tensor_adam`` also takes a fifth list,
fp32 master weights: it then updates the master weights in place and writes each updated value,
cast to the second list's dtype, in the same pass (TE's ``AdamFunctorMaster``). Given
``[g, model, m, v, main]`` it moves 28 bytes a parameter where update and copy moved 32.

:func:`install` hands a FusedAdam that holds no master weights (Megatron-FSDP's, with or without
the precision-aware optimizer) a kernel that does so, and hands each buffer the
:class:`ModelWeightWrites` record:

* each ``multi_tensor_adam`` call's tensors whose main weight has a model weight
  (``ParamAndGradBuffer.main_to_model_pairs``) go to the 5-list kernel, one call per model dtype;
  the others to the 4-list call, as before;
* the record keeps the model weights written; ``copy_main_weights_to_model_weights`` copies only
  the other pairs and forgets the marks it skipped. A copy that follows no step (a checkpoint
  load) copies every pair. Marks never outlive the views they name: when a buffer's storage moves,
  the record drops them (the copy then copies those pairs too).

Invariants:

* Same bits. Both functors compute the update with the same fp32 code (TE's ``adam_update``); the
  model weight is the updated fp32 value cast to its dtype, as ``copy_`` casts it (round to
  nearest even). Bias corrections are computed on the host the same way for both.
* Only TE's FusedAdam, with ``master_weights`` off and ``capturable`` off: its kernel is
  ``multi_tensor_adam``, called through ``multi_tensor_applier`` with local tensors
  (``(chunk_size, noop, [g, p, m, v], lr, beta1, beta2, eps, step, mode, bias_correction,
  weight_decay)``). Anything else keeps the separate copy.
* FP8 model weights keep their quantization path: ``main_to_model_pairs`` leaves them out. Main weights
  that are not fp32 (``--megatron-fsdp-main-params-dtype``) keep the 4-list call and the copy: the
  kernel's fifth list must be fp32.
* The newest optimizer decides: an optimizer built again for the same model replaces the buffers'
  record (an older optimizer's writes are then copied again, same values), or removes it when
  that optimizer is refused.
* The first copy after the first step logs, once, how many of its model weights the step wrote and
  how many it copies; a warning when the step wrote none of them.
* ``HFSDP_SEPARATE_MODEL_COPIES=1`` keeps the separate copy, for comparisons.

The gradient clip: Megatron scales every gradient by the clip coefficient before the step (TE's
``multi_tensor_scale_tensor``, a pass that reads and writes them all). Its two clip sites
(``MegatronOptimizer.clip_grad_norm``, ``ChainedOptimizer.step``) first offer the coefficient to
:func:`defer_clip`; an installed optimizer takes it and applies it in its update, same bits
([Note: Triton Adam]), and drops it when its step ends. Its large tensors' gradient buffers then
keep the unclipped gradients: what reads them between the clip and the step (``count_zeros``, a
step digest) sees those; a count of zeros can differ where the separate scale would have flushed a
product to zero. A step Megatron skips (a norm above ``grad_norm_skip_threshold``) keeps the
coefficient until the next clip replaces it; no step runs in between in Megatron's loop.
``HFSDP_SEPARATE_CLIP_SCALE=1`` keeps the separate pass. ``HFSDP_SEPARATE_MODEL_COPIES=1`` turns
off the model-weight writes only: the Triton kernel and the clip stay.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from . import triton_adam

logger = logging.getLogger(__name__)

SEPARATE_COPIES_ENV = "HFSDP_SEPARATE_MODEL_COPIES"
SEPARATE_CLIP_ENV = "HFSDP_SEPARATE_CLIP_SCALE"
DEFERRED_CLIP_ATTR = "hfsdp_deferred_clip"

Pair = tuple[torch.Tensor, torch.Tensor]  # (model weight, main weight)
_Key = tuple[int, int]


class PairSource(Protocol):
    """What a Megatron-FSDP ParamAndGradBuffer gives and takes here."""

    model_weight_writes: ModelWeightWrites | None

    def main_to_model_pairs(self) -> list[Pair]: ...


def _key(tensor: torch.Tensor) -> _Key:
    return (tensor.data_ptr(), tensor.numel())


class ModelWeightWrites:
    """The model weights an optimizer step wrote, until the main-to-model copy reads them."""

    def __init__(self, buffers: Sequence[PairSource]) -> None:
        self._buffers = tuple(buffers)
        self._pairs: tuple[list[Pair], ...] = ()
        self._model_of: dict[_Key, torch.Tensor] = {}
        self._written: set[_Key] = set()
        self._stepped = False  # a step ran since the last copy (for the one log line)
        self.grad_scale: torch.Tensor | None = None  # the clip coefficient the next step applies (defer_clip)
        self._reported = False

    def models_of(self, mains: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Each main weight's model weight, flat, or None where it has none."""
        self._stepped = True
        pairs = tuple(buffer.main_to_model_pairs() for buffer in self._buffers)
        if len(pairs) != len(self._pairs) or any(a is not b for a, b in zip(pairs, self._pairs, strict=True)):
            self._pairs = pairs
            self._model_of = {_key(main): model.view(-1) for group in pairs for model, main in group}
            self._written.clear()  # marks of views that moved
        return [self._model_of.get(_key(main)) for main in mains]

    def mark(self, models: Iterable[torch.Tensor]) -> None:
        self._written.update(_key(model) for model in models)

    def unwritten(self, pairs: Iterable[Pair]) -> list[Pair]:
        """The pairs whose model weight no step wrote since the last copy; forgets the others."""
        left, skipped = [], 0
        for model, main in pairs:
            key = _key(model)
            if key in self._written:
                self._written.discard(key)
                skipped += 1
            else:
                left.append((model, main))
        if self._stepped and not self._reported:
            self._reported = True
            log = logger.warning if skipped == 0 and left else logger.info
            log("The optimizer step wrote %d model weights of a buffer; its main-to-model copy writes %d.",
                skipped, len(left))
        self._stepped = False
        return left


Kernel = Callable[..., Any]


def megatron_scale_kernel() -> Kernel | None:
    """The kernel Megatron's clip scales gradients with by a device coefficient (TE's), or None."""
    from .clip_grads import multi_tensor_scale_tensor_impl

    return multi_tensor_scale_tensor_impl


def with_model_writes(kernel: Kernel, writes: ModelWeightWrites, environ: Mapping[str, str] = os.environ,
                      scale_kernel: Kernel | None = None) -> Kernel:
    """``kernel`` (TE's ``multi_tensor_adam``) that also writes each main weight's model weight, runs
    large tensors through Triton ([Note: Triton Adam]) and applies a deferred clip coefficient with
    ``scale_kernel`` where Triton does not."""

    def run(chunk_size: int, noop: torch.Tensor, lists: list[list[torch.Tensor]], *args: Any) -> None:
        triton_adam.apply(kernel, chunk_size, noop, lists, *args, scale=writes.grad_scale,
                          scale_kernel=scale_kernel, environ=environ)

    def adam(chunk_size: int, noop: torch.Tensor, lists: list[list[torch.Tensor]], *args: Any) -> Any:
        if len(lists) != 4:  # already the master-weights form
            return run(chunk_size, noop, lists, *args)
        models = writes.models_of(lists[1])
        by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        rest = []
        for j, model in enumerate(models):
            if model is None or lists[1][j].dtype != torch.float32:  # the kernel's master list is fp32
                rest.append(j)
            else:
                by_dtype.setdefault(model.dtype, []).append((j, model))
        if rest:
            run(chunk_size, noop, [[tensors[j] for j in rest] for tensors in lists], *args)
        g, p, m, v = lists
        for group in by_dtype.values():
            idx, written = [j for j, _ in group], [model for _, model in group]
            run(chunk_size, noop, [[g[j] for j in idx], written, [m[j] for j in idx], [v[j] for j in idx],
                                   [p[j] for j in idx]], *args)
            writes.mark(written)
        return None

    return adam


def _is_te_fused_adam(optimizer: torch.optim.Optimizer) -> bool:
    return any(cls.__module__.startswith("transformer_engine.") and cls.__name__ == "FusedAdam"
               for cls in type(optimizer).__mro__)


def kernel_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s step is not ``multi_tensor_adam`` on local tensors, or None when it is."""
    if not _is_te_fused_adam(optimizer):
        return f"{type(optimizer).__name__} is not Transformer Engine's FusedAdam"
    if getattr(optimizer, "capturable", False):
        return "capturable FusedAdam calls another kernel"
    if getattr(optimizer, "master_weights", False):
        return "FusedAdam holds its own master weights"
    return None


def refusal(optimizer: torch.optim.Optimizer, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why ``optimizer``'s step cannot write the model weights, or None when it can."""
    if environ.get(SEPARATE_COPIES_ENV) == "1":
        return f"{SEPARATE_COPIES_ENV}=1"
    return kernel_refusal(optimizer)


def defer_clip(optimizer: Any, max_norm: float, total_norm: Any) -> bool:
    """Megatron's clip of the gradients by ``max_norm / (total_norm + 1e-6)``, at most 1, handed to
    ``optimizer``'s next step, which applies it in its update ([Note: Triton Adam]). False, and nothing
    done, when ``optimizer`` does not take it or the norm is not a device tensor: the caller scales."""
    writes = getattr(optimizer, DEFERRED_CLIP_ATTR, None)
    if not isinstance(writes, ModelWeightWrites) or not isinstance(total_norm, torch.Tensor):
        return False
    coeff = max_norm / (total_norm + 1.0e-6)  # as clip_grad_by_total_norm_fp32 computes it
    writes.grad_scale = coeff.clamp_max_(1.0)
    return True


def _drop_scale_after(step: Callable[..., Any], writes: ModelWeightWrites) -> Callable[..., Any]:
    def step_once(*args: Any, **kwargs: Any) -> Any:
        try:
            return step(*args, **kwargs)
        finally:
            writes.grad_scale = None

    return step_once


def install(optimizer: torch.optim.Optimizer, buffers: Sequence[PairSource],
            environ: Mapping[str, str] = os.environ,
            scale_kernel: Kernel | None = None) -> ModelWeightWrites | None:
    """Make ``optimizer``'s step write the model weights of ``buffers``' main weights, and their
    main-to-model copies skip those; returns the record, or None (and logs why) when it cannot.
    Its step also runs large tensors through Triton ([Note: Triton Adam]) and, unless
    ``HFSDP_SEPARATE_CLIP_SCALE=1`` or without ``scale_kernel`` (default: Megatron's, see
    :func:`megatron_scale_kernel`), takes the clip coefficient (:func:`defer_clip`); with
    ``HFSDP_SEPARATE_MODEL_COPIES=1`` too, which turns off the model-weight writes alone."""
    if not buffers:
        return None
    why = refusal(optimizer, environ)
    if why is not None:
        for buffer in buffers:  # an earlier optimizer's record no longer describes the steps
            buffer.model_weight_writes = None
        logger.info("Main-to-model copies stay separate from the optimizer step: %s.", why)
    if kernel_refusal(optimizer) is not None or getattr(optimizer, DEFERRED_CLIP_ATTR, None) is not None:
        return None  # another kernel; or installed already (a second wrapper would add nothing)
    scale_kernel = scale_kernel or megatron_scale_kernel()
    writes = ModelWeightWrites(buffers if why is None else ())
    optimizer.multi_tensor_adam = with_model_writes(  # type: ignore[attr-defined]
        optimizer.multi_tensor_adam, writes, environ, scale_kernel)  # type: ignore[attr-defined]
    clip = environ.get(SEPARATE_CLIP_ENV) != "1" and scale_kernel is not None
    setattr(optimizer, DEFERRED_CLIP_ATTR, writes if clip else False)
    if clip:
        optimizer.step = _drop_scale_after(optimizer.step, writes)  # type: ignore[method-assign]
    logger.info("FusedAdam: model weights %s; large tensors: %s; the gradient clip: %s.",
                "written in its update ([Note: Adam writes the model weights])" if why is None else "copied after it",
                "Triton" if triton_adam.enabled(environ) else "TE's kernel",
                "in the update" if clip else "a separate pass")
    if why is not None:
        return None
    for buffer in buffers:
        buffer.model_weight_writes = writes
    return writes
