"""The explicit FSDP-unit override (HFSDP_FSDP_UNIT_MODULES) used to emulate 0.18.2 checkpoints."""

from __future__ import annotations

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


def test_override_is_the_trees_unit_rule_and_the_adapter_asks_it() -> None:
    """The override sets the tree's rule (no class swap); the adapter takes its units from that
    rule when its caller names none, and the tree holds the one default list."""
    import collections
    import fractions

    from megatron.core.distributed.fsdp import fsdp_units as tree

    try:
        assert fsdp_units.install_unit_override("fractions.Fraction") == ["fractions.Fraction"]
        assert tree.unit_modules("optim_grads_params") == [fractions.Fraction]
        fsdp_units.install_unit_override("collections.OrderedDict")  # replaces, not stacks
        assert tree.unit_modules("no_shard") == [collections.OrderedDict]
        assert fsdp_units.install_unit_override("") is None
        assert tree.unit_modules("optim_grads_params") == [collections.OrderedDict]
    finally:
        tree.set_unit_modules_override(None)
    names = [c.__name__ for c in tree.unit_modules("optim_grads_params")]
    assert names == ["TransformerLayer", "MoETransformerLayer", "MambaLayer"]
    assert tree.unit_modules("optim_grads") == []
    assert fsdp_units.default_unit_paths() == tree.DEFAULT_UNIT_MODULES
    import inspect

    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    source = inspect.getsource(mcore_fsdp_adapter.FullyShardedDataParallel.__init__)
    assert "fsdp_units.unit_modules(" in source and "MambaLayer" not in source
    assert "megatron_FSDP" not in inspect.getsource(fsdp_units)  # no module-global swap any more
