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


def test_upstream_nccl_allocator_is_detected_as_unpatched():
    pytest.importorskip("megatron.core.nccl_allocator")
    import inspect

    from megatron.core import nccl_allocator

    src = inspect.getsource(nccl_allocator.init)
    if 'os.environ["NCCL_NVLS_ENABLE"] = "1"' in src:
        assert C.nccl_allocator_respects_nvls_env() is False
    else:
        assert C.nccl_allocator_respects_nvls_env() is True
