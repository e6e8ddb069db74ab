"""Build the training model on the meta device, exactly as ``get_model`` would shape it.

The planner needs parameter names, shapes, dtypes and module classes in module order; the
runtime gets them from ``megatron.training.training.get_model``: model provider, then
``Float16Module`` (which casts every floating parameter to bf16/fp16), then the FSDP wrapper.
We reproduce the first two steps on the meta device, so no memory and no GPU is touched.

Model choice mirrors pretrain_gpt.py / pretrain_hybrid.py: a hybrid layer pattern builds a
``HybridModel``, otherwise a ``GPTModel``. The model comes from the training entry's own provider
(``hfsdp.training.model_provider``), so planner and training build the same model.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import types
from collections.abc import Iterator

import torch


class _MetaRMSNormGated(torch.nn.Module):
    """Shape twin of mamba_ssm's gated RMSNorm (weight [hidden], bias None) for planning only.

    Used only when mamba_ssm is not importable (CPU boxes); the planner needs shapes, never
    kernels. mamba_ssm 2.x registers exactly one parameter, ``weight``, of size ``hidden_size``.
    """

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True,
                 device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)


@contextlib.contextmanager
def cpu_meta_build_context() -> Iterator[None]:
    """Let Megatron modules that hard-code CUDA placement build on the meta device.

    MambaMixer passes ``device=torch.cuda.current_device()`` and forks the CUDA RNG tracker; both
    are redirected (meta placement, no-op RNG fork), also on GPU machines so the planner never
    allocates device memory. Every patch is undone on exit. Shapes and dtypes are unaffected.
    """
    saved: list[tuple[object, str, object]] = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        # Always (even with a GPU): the planner must never place parameters on a device.
        patch(torch.cuda, "current_device", lambda: "meta")
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()
        patch(tracker, "fork", lambda *a, **k: contextlib.nullcontext())
        try:
            import megatron.core.ssm.mamba_mixer as mamba_mixer

            if not mamba_mixer.HAVE_MAMBA_SSM:
                patch(mamba_mixer, "HAVE_MAMBA_SSM", True)
                patch(mamba_mixer, "ExtendedRMSNorm", _MetaRMSNormGated)
                patch(mamba_mixer, "RMSNormGated", _MetaRMSNormGated)
        except ImportError:
            pass
        with torch.device("meta"):
            yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def training_model_provider(args: argparse.Namespace):
    """The training entry's provider (``hfsdp.training``), so planner and training build one model."""
    from hfsdp.training import model_provider as mp
    from hfsdp.training import specs

    family = specs.resolve_family(args)

    def provider(**kwargs):
        return mp.model_provider(family, args=args, **kwargs)

    return provider


def build_meta_model(args: argparse.Namespace) -> torch.nn.Module:
    """Build one model chunk on meta and cast it like ``get_model`` (Float16Module)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module
    from megatron.training.argument_utils import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    # Built on meta: LanguageModule skips moving the tied embedding to the GPU for the first
    # all-reduce between pipeline stages (with PP > 1), which a CPU box cannot do.
    config.init_model_with_meta_device = True
    provider = training_model_provider(args)
    with cpu_meta_build_context():
        model = provider(
            pre_process=True,
            post_process=True,
            config=config,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )
        if args.fp16 or args.bf16:
            model = Float16Module(config, model)
    return model


def ensure_selective_scan_stub() -> None:
    """mamba_ssm imports a CUDA-only extension eagerly; the Triton path never calls it."""
    if "selective_scan_cuda" not in sys.modules:
        try:
            import selective_scan_cuda  # noqa: F401
        except ImportError:
            sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
