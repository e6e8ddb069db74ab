"""--megatron-fsdp-max-pool-lanes: CLI parse/validate, both DDP configs, fully_shard (CPU)."""

import dataclasses
import inspect

import pytest
from test_maxpool_flags import (
    BASE,
    FSDP,
    FsdpDDPConfig,
    MCoreDDPConfig,
    fs,
    kwargs_fully_shard_passes_on,
)

from megatron.training.training import get_megatron_ddp_config

MAXPOOL = ["--megatron-fsdp-max-pool-double-buffer"]


@pytest.fixture
def validated(megatron_validator):
    return megatron_validator(BASE, world_size=2)


def test_default_is_two_lanes(validated):
    args = validated(FSDP)
    assert args.megatron_fsdp_max_pool_lanes == 2
    assert validated(FSDP + MAXPOOL).megatron_fsdp_max_pool_lanes == 2


def test_three_lanes_reach_the_ddp_config(validated):
    args = validated(FSDP + MAXPOOL + ["--megatron-fsdp-max-pool-lanes", "3"])
    assert args.megatron_fsdp_max_pool_lanes == 3
    cfg = get_megatron_ddp_config(args)
    assert cfg.megatron_fsdp_max_pool_lanes == 3 and cfg.megatron_fsdp_max_pool_double_buffer


@pytest.mark.parametrize(
    "extra, match",
    [
        (MAXPOOL + ["--megatron-fsdp-max-pool-lanes", "1"],
         r"--megatron-fsdp-max-pool-lanes must be an integer >= 2, got 1: .* use 2"),
        (["--megatron-fsdp-max-pool-lanes", "0"], "must be an integer >= 2, got 0"),
        (["--megatron-fsdp-max-pool-lanes", "3"],
         "--megatron-fsdp-max-pool-lanes 3 needs --megatron-fsdp-max-pool-double-buffer: .*add "
         "--megatron-fsdp-max-pool-double-buffer, or leave --megatron-fsdp-max-pool-lanes at 2"),
        (["--fsdp-double-buffer", "--megatron-fsdp-max-pool-lanes", "4"],
         "lanes 4 needs --megatron-fsdp-max-pool-double-buffer"),
    ],
)
def test_lane_counts_that_cannot_work_are_rejected(validated, extra, match):
    with pytest.raises(ValueError, match=match):
        validated(FSDP + extra)


@pytest.mark.parametrize(("cfg_cls", "units"), [
    (MCoreDDPConfig, {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"}),
    (FsdpDDPConfig, {"data_parallel_sharding_strategy": "optim_grads_params"}),
])
def test_both_ddp_configs_carry_and_check_the_field(cfg_cls, units):
    lanes_name = "megatron_fsdp_max_pool_lanes"  # the field's name (fully_shard names its keyword first)
    fields = {f.name: f.default for f in dataclasses.fields(cfg_cls)}
    assert fields["megatron_fsdp_max_pool_lanes"] == 2
    assert cfg_cls(megatron_fsdp_max_pool_double_buffer=True, megatron_fsdp_max_pool_lanes=3,
                   **units).megatron_fsdp_max_pool_lanes == 3
    with pytest.raises(ValueError, match=lanes_name + " 3 needs megatron_fsdp_max_pool_double_buffer"):
        cfg_cls(megatron_fsdp_max_pool_lanes=3, **units)
    for bad in (1, 2.5, True):
        with pytest.raises(ValueError, match=f"must be an integer >= 2, got {bad!r}"):
            cfg_cls(megatron_fsdp_max_pool_double_buffer=True, megatron_fsdp_max_pool_lanes=bad, **units)


def test_fully_shard_plumbs_maxpool_lanes(monkeypatch):
    for fn in (fs.fully_shard, fs.fully_shard_model):
        assert inspect.signature(fn).parameters["maxpool_lanes"].default == 2
    # fully_shard_model builds the DDP config with the field set (needs GPUs to call).
    assert "megatron_fsdp_max_pool_lanes=maxpool_lanes" in inspect.getsource(fs.fully_shard_model)
    seen = kwargs_fully_shard_passes_on(monkeypatch, maxpool_double_buffer=True, maxpool_lanes=3)
    assert seen["maxpool_lanes"] == 3
