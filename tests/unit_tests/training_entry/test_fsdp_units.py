"""The explicit FSDP-unit override (HFSDP_FSDP_UNIT_MODULES) used to emulate 0.18.2 checkpoints."""

from __future__ import annotations

import sys
import types

import pytest

from hfsdp.training import fsdp_units


def test_preset_matches_0_18_2_rule() -> None:
    assert fsdp_units.describe_units("megatron-0.18.2", "optim_grads_params") == ["TransformerLayer"]
    assert fsdp_units.describe_units("megatron-0.18.2", "optim_grads") == []
    assert fsdp_units.describe_units("none", "optim_grads_params") == []
    assert fsdp_units.unit_resolver("") is None and fsdp_units.unit_resolver(None) is None


def test_explicit_class_list_and_bad_paths() -> None:
    got = fsdp_units.describe_units("collections.OrderedDict, fractions.Fraction", "no_shard")
    assert got == ["OrderedDict", "Fraction"]
    with pytest.raises(ValueError, match="does not name a class"):
        fsdp_units.unit_resolver("os.path.join")("optim_grads_params")


def test_override_injects_units_into_the_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    class FakeAdapter:
        def __init__(self, config=None, ddp_config=None, module=None, fsdp_unit_modules=None, **kw):
            seen["units"] = fsdp_unit_modules

    fake_training = types.ModuleType("megatron.training.training")
    fake_training.megatron_FSDP = FakeAdapter
    monkeypatch.setitem(sys.modules, "megatron.training.training", fake_training)
    if "megatron.training" in sys.modules:
        monkeypatch.setattr(sys.modules["megatron.training"], "training", fake_training, raising=False)
    assert fsdp_units.install_unit_override("fractions.Fraction") == ["fractions.Fraction"]
    # Installing twice must wrap the original class, not the previous override.
    fsdp_units.install_unit_override("collections.OrderedDict")
    cls = fake_training.megatron_FSDP
    assert cls._hfsdp_base is FakeAdapter and issubclass(cls, FakeAdapter)
    cls(config=None, ddp_config=types.SimpleNamespace(data_parallel_sharding_strategy="optim_grads_params"),
        module=None, fsdp_unit_modules=["ignored"])
    import collections
    assert seen["units"] == [collections.OrderedDict]
    assert fsdp_units.install_unit_override("") is None
