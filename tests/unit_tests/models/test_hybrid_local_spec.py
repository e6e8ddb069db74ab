"""CPU tests for the Transformer-Engine-free hybrid spec (overlay module hybrid_local_layer_specs.py).

They construct HybridModel from ``hybrid_local_stack_spec`` on a 1-rank gloo group and check
the layer classes Megatron-FSDP keys its units on (isinstance-based), that no TE module is
built anywhere, and the construction-time guards. Forward passes need CUDA (Mamba's scan is
Triton, attention asks for CUDA buffers) and are covered by the GPU test
tests/unit_tests/double_buffer/test_maxpool_hybrid_gpu.py.

Mamba cases need mamba_ssm importable (the mixer refuses to build without it); they are marked
``mamba`` (tests/unit_tests/conftest.py: without mamba_ssm they fail, or skip under
HFSDP_WITH_MAMBA=0). On a CUDA-less box, construction of MambaMixer is redirected to CPU by
patching ``torch.cuda.current_device`` and the mixer's CUDA RNG tracker fork, nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from rendezvous import init_one_rank_gloo

from megatron.core import parallel_state
from megatron.core.models.hybrid.hybrid_local_layer_specs import (
    LocalHybridStack,
    hybrid_local_stack_spec,
    mamba_needs_causal_conv1d,
)
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

# Exact class per pattern symbol (type(layer) is ..., not isinstance: MLPLayer and
# MoETransformerLayer are TransformerLayer subclasses, so isinstance would not catch a swap).
EXPECTED_CLASS = {"M": MambaLayer, "*": TransformerLayer, "E": MoETransformerLayer, "-": MLPLayer}


@pytest.fixture(scope="module")
def one_rank_parallel_state() -> Iterator[None]:
    """A 1-rank gloo world with Megatron parallel state (TP=PP=EP=1)."""
    created = False
    if not dist.is_initialized():
        init_one_rank_gloo()
        created = True
    assert dist.get_world_size() == 1, (
        f"an earlier test left a {dist.get_world_size()}-rank process group initialized; "
        "these construction tests need a 1-rank world"
    )
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


class _NoOpRngTracker:
    """Stands in for the CUDA RNG tracker: MambaMixer forks it around CPU-irrelevant init."""

    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


@contextlib.contextmanager
def _cpu_construction() -> Iterator[None]:
    """Let MambaMixer (which places conv1d/A_log/D on current_device) build on CPU."""
    if torch.cuda.is_available():
        yield
        return
    with (
        mock.patch("torch.cuda.current_device", return_value="cpu"),
        mock.patch(
            "megatron.core.ssm.mamba_mixer.get_cuda_rng_tracker", return_value=_NoOpRngTracker()
        ),
    ):
        yield


def _config(**overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=1,  # HybridModel takes the layer count from the pattern
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        num_moe_experts=2,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        mamba_state_dim=16,
        mamba_head_dim=16,
        mamba_num_groups=2,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        use_mamba_mem_eff_path=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _build(pattern: str, **config_overrides) -> HybridModel:
    with _cpu_construction():
        return HybridModel(
            config=_config(**config_overrides),
            hybrid_stack_spec=hybrid_local_stack_spec,
            vocab_size=128,
            max_sequence_length=32,
            hybrid_layer_pattern=pattern,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )


def _te_modules(model: torch.nn.Module) -> list[str]:
    return [
        f"{name}: {type(mod).__module__}.{type(mod).__name__}"
        for name, mod in model.named_modules()
        if "transformer_engine" in type(mod).__module__
    ]


def test_spec_shape_matches_te_roles() -> None:
    """Spec has the TE spec's roles and the classes FSDP's isinstance matching relies on."""
    sub = hybrid_local_stack_spec.submodules
    assert hybrid_local_stack_spec.module is LocalHybridStack
    assert sub.mamba_layer.module is MambaLayer
    assert sub.attention_layer.module is TransformerLayer
    assert sub.mlp_layer.module is MLPLayer
    assert sub.moe_layer.module is MoETransformerLayer
    assert sub.mtp_block_spec is not None


@pytest.mark.parametrize("pattern", ["*E-", "*-*E"])
def test_build_attention_moe_mlp_without_te(one_rank_parallel_state, pattern: str) -> None:
    model = _build(pattern)
    got = [type(layer) for layer in model.decoder.layers]
    assert got == [EXPECTED_CLASS[s] for s in pattern], (pattern, got)
    assert isinstance(model.decoder, LocalHybridStack)
    assert isinstance(model.decoder.final_norm, torch.nn.RMSNorm), type(model.decoder.final_norm)
    assert _te_modules(model) == []
    moe = model.decoder.layers[pattern.index("E")].mlp
    assert type(moe.experts).__name__ == "SequentialMLP", type(moe.experts)
    assert len(moe.experts.local_experts) == 2


@pytest.mark.mamba
@pytest.mark.parametrize("pattern", ["M*E-", "M*EM*E"])
def test_build_full_hybrid_without_te(one_rank_parallel_state, pattern: str) -> None:
    model = _build(pattern)
    classes = [type(layer) for layer in model.decoder.layers]
    print(pattern, [c.__name__ for c in classes])
    assert classes == [EXPECTED_CLASS[s] for s in pattern], (pattern, classes)
    assert _te_modules(model) == []
    for layer in model.decoder.layers:
        if isinstance(layer, MambaLayer):
            assert isinstance(layer.norm, torch.nn.RMSNorm), type(layer.norm)
            assert type(layer.mixer.in_proj).__name__ == "ColumnParallelLinear"
            assert type(layer.mixer.out_proj).__name__ == "RowParallelLinear"
            assert layer.mixer.use_mem_eff_path is False
        elif type(layer) is TransformerLayer:
            assert type(layer.self_attention.core_attention).__name__ == "DotProductAttention"
    # Default Megatron-FSDP units after the default-units patch: every decoder layer is one,
    # embedding / final norm / output layer are not.
    from megatron.core.distributed.fsdp.fsdp_units import default_unit_classes

    units = [m for m in model.modules() if isinstance(m, default_unit_classes())]
    assert units == list(model.decoder.layers)


@pytest.mark.mamba
def test_mamba_mem_eff_path_without_causal_conv1d_is_rejected(one_rank_parallel_state) -> None:
    if not mamba_needs_causal_conv1d(_config(use_mamba_mem_eff_path=True)):
        pytest.skip("causal_conv1d is installed; the fused path is usable")
    with pytest.raises(ValueError, match="use_mamba_mem_eff_path=False"):
        _build("M*", use_mamba_mem_eff_path=True)


def test_mem_eff_path_check_ignores_models_without_mamba(one_rank_parallel_state) -> None:
    model = _build("*-", use_mamba_mem_eff_path=True)
    assert [type(layer) for layer in model.decoder.layers] == [TransformerLayer, MLPLayer]


@pytest.mark.parametrize("symbol", ["G", "D"])
def test_layers_without_local_implementation_fail_loudly(one_rank_parallel_state, symbol) -> None:
    with pytest.raises(NotImplementedError, match="no local implementation"):
        _build(f"-{symbol}")


def test_post_layer_norm_false_builds_no_final_norm(one_rank_parallel_state) -> None:
    with _cpu_construction():
        stack = LocalHybridStack(
            _config(),
            hybrid_local_stack_spec.submodules,
            layer_type_list=["*"],
            post_layer_norm=False,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )
    assert not hasattr(stack, "final_norm")
    assert stack.post_layer_norm is False
