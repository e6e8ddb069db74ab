"""Config flags, presets and the NVLS-patch detection (CPU only)."""

from __future__ import annotations

import pytest

from hfsdp.bench import configs as C


def test_override_flags_replaces_and_appends():
    base = ["--a", "1", "--flag", "--b", "x", "y"]
    assert C.override_flags(base, ["--b", "z", "--c"]) == ["--a", "1", "--flag", "--b", "z", "--c"]
    assert C.override_flags(base, []) == base


def test_presets():
    default = C.model_flags("default")
    assert default[default.index("--hybrid-layer-pattern") + 1] == "M*E" * 4
    fill = C.model_flags("fill", ["--micro-batch-size", "2"])
    assert fill[fill.index("--hidden-size") + 1] == "4096"
    assert fill[fill.index("--micro-batch-size") + 1] == "2"
    assert fill.count("--micro-batch-size") == 1
    with pytest.raises(ValueError):
        C.model_flags("nope")


def test_configs_flags():
    assert C.CONFIGS["no_db"].flags == ()
    assert "--fsdp-double-buffer" in C.CONFIGS["fixedpool"].flags
    assert C.MAXPOOL_FLAG in C.CONFIGS["maxpool"].flags
    assert "--use-nccl-ub" in C.CONFIGS["maxpool_ub"].flags


def test_nccl_ub_needs_pinned_nvls(monkeypatch):
    pytest.importorskip("megatron.training.arguments")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    reason = C.availability("maxpool_ub")
    assert reason is not None  # either the max-pool flag, the env pin or the patch is missing
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setattr(C, "parser_has_flag", lambda flag: True)
    monkeypatch.setattr(C, "nccl_allocator_respects_nvls_env", lambda: False)
    assert "NVLS patch" in C.availability("maxpool_ub")
    monkeypatch.setattr(C, "nccl_allocator_respects_nvls_env", lambda: True)
    assert C.availability("maxpool_ub") is None
    assert C.availability("unknown").startswith("unknown")


def test_nvls_detection_runs_real_init_and_restores_env(monkeypatch):
    pytest.importorskip("megatron.core.nccl_allocator")
    import os

    from megatron.core import nccl_allocator

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "7")
    monkeypatch.delenv("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", raising=False)
    build = nccl_allocator._build_nccl_allocator
    patched = C.nccl_allocator_respects_nvls_env()
    # The environment and the builder are restored whatever init did.
    assert os.environ["NCCL_NVLS_ENABLE"] == "7"
    assert "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK" not in os.environ
    assert nccl_allocator._build_nccl_allocator is build
    stamp = os.path.join(os.path.dirname(nccl_allocator.__file__), "..", ".patchset-stamp.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            applied = "nccl-allocator-respect-nvls-env.patch" in f.read()
        assert patched is applied


def test_nvls_detection_rejects_unconditional_overwrite(monkeypatch):
    pytest.importorskip("megatron.core.nccl_allocator")
    import os

    from megatron.core import nccl_allocator

    def upstream_init():  # 0.18.2 behaviour
        os.environ["NCCL_NVLS_ENABLE"] = "1"
        nccl_allocator._build_nccl_allocator()

    monkeypatch.setattr(nccl_allocator, "init", upstream_init)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert C.nccl_allocator_respects_nvls_env() is False
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_default_configs_exclude_nccl_ub():
    assert C.DEFAULT_CONFIGS == ("no_db", "fixedpool", "maxpool")
    assert "maxpool_ub" in C.CONFIGS
