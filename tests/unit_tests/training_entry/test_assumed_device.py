"""The assumed GPU that answers validate_args' device queries without a driver (assumed_device.py)."""

from __future__ import annotations

import pytest
import torch

import megatron.training.arguments as margs
from hfsdp.training.assumed_device import arch_name, assumed_device


def test_both_queries_are_answered_and_restored_even_on_error():
    arch, capability = margs.get_device_arch_version, torch.cuda.get_device_capability
    with pytest.raises(RuntimeError, match="inside"), assumed_device(11):
        assert margs.get_device_arch_version() == 11
        assert torch.cuda.get_device_capability() == (11, 0)
        raise RuntimeError("inside")
    assert margs.get_device_arch_version is arch and torch.cuda.get_device_capability is capability


def test_the_planner_validates_with_the_same_helper(monkeypatch):
    """One helper for the entry and the planner: the planner's --plan-device-arch reaches validate_args."""
    from hfsdp.planner import setup

    seen = []
    real = margs.validate_args

    def spy(args, defaults):
        seen.append((margs.get_device_arch_version(), torch.cuda.get_device_capability()))
        return real(args, defaults)

    monkeypatch.setattr(margs, "validate_args", spy)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    setup.parse(setup.model_argv(["--plan-device-arch", "10"]))
    assert seen == [(10, (10, 0))]


def test_arch_names():
    assert arch_name(9) == "a Hopper GPU (compute capability 9)"
    assert arch_name(42) == "a GPU (compute capability 42)"
