"""The double-buffer policy ([Note: double buffer], policy, in megatron_fsdp/double_buffer/__init__.py):
frozen, built once per entry route and handed down, the same from every route, errors in the route's
spelling with the offending value, no module-level state (CPU)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from test_maxpool_flags import BASE, FSDP, FsdpDDPConfig, MCoreDDPConfig, fs

import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy as dbp
from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy import (
    FIELDS,
    FLAGS,
    KEYWORDS,
    DoubleBufferPolicy,
    policy_from_args,
    policy_from_keywords,
)
from megatron.training.training import get_megatron_ddp_config

STRATEGY = {"data_parallel_sharding_strategy": "optim_grads_params"}
MAXPOOL_3 = {"megatron_fsdp_max_pool_double_buffer": True, "megatron_fsdp_max_pool_lanes": 3,
             "fsdp_db_use_persist_buf_on_alloc_fail": True}
FLAGS_3 = ["--megatron-fsdp-max-pool-double-buffer", "--megatron-fsdp-max-pool-lanes", "3",
           "--fsdp-db-use-persist-buf-on-alloc-fail"]
KEYWORDS_3 = {"zero_dp_strategy": "optim_grads_params", "maxpool_double_buffer": True, "maxpool_lanes": 3,
              "fsdp_db_use_persist_buf_on_alloc_fail": True}
EXPECTED_3 = DoubleBufferPolicy(double_buffer=True, max_pool=True, lanes=3, persistent_fallback=True)


@pytest.fixture
def validated(megatron_validator):
    return megatron_validator(BASE, world_size=2)


def fully_shard_keywords_checked(**keywords):
    """Call fully_shard_model up to its policy check (a stub stops it at the config it builds)."""

    class Stop(Exception):
        pass

    def stop(**_):
        raise Stop

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fs, "DistributedDataParallelConfig", stop)
        with pytest.raises(Stop):
            fs.fully_shard_model(module=None, device_mesh=object(), **keywords)


def test_the_policy_is_frozen_and_says_what_runs():
    policy = policy_from_keywords(**KEYWORDS_3)
    assert policy == EXPECTED_3 and policy.round_robin and policy.live_units == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.lanes = 4  # type: ignore[misc]
    assert policy.pick("fixed", "max_pool", "lanes") == "lanes"
    shared = policy_from_keywords(zero_dp_strategy="optim_grads_params", maxpool_double_buffer=True)
    assert shared.pick("fixed", "max_pool", "lanes") == "max_pool" and shared.live_units == 2
    fixed = policy_from_keywords(zero_dp_strategy="optim_grads_params", nccl_ub=True)
    assert fixed.double_buffer and not fixed.max_pool and fixed.nccl_ub and not fixed.stage_symmetric
    assert fixed.pick("fixed", "max_pool", "lanes") == "fixed"
    none = policy_from_keywords()
    assert not none.double_buffer
    with pytest.raises(ValueError, match="has no double-buffer allocator"):
        none.pick("fixed", "max_pool", "lanes")


def test_max_pool_and_user_buffers_imply_double_buffering_in_one_function():
    assert [dbp.double_buffering(d, m, u) for d, m, u in
            [(False, False, False), (True, False, False), (False, True, False), (False, False, True)]] == [
        False, True, True, True]


def test_every_route_gives_the_same_policy(validated):
    args = validated(FSDP + FLAGS_3)
    assert args.fsdp_double_buffer  # validate_args mirrors the policy's answer for upstream readers
    cli = policy_from_args(args)
    core = get_megatron_ddp_config(args).double_buffer_policy
    mcore = MCoreDDPConfig(use_megatron_fsdp=True, **STRATEGY, **MAXPOOL_3).double_buffer_policy
    fsdp = FsdpDDPConfig(**STRATEGY, **MAXPOOL_3).double_buffer_policy
    fully_shard_keywords_checked(**KEYWORDS_3)
    assert cli == core == mcore == fsdp == policy_from_keywords(**KEYWORDS_3) == EXPECTED_3


def test_a_config_builds_its_policy_once_and_keeps_it():
    cfg = FsdpDDPConfig(**STRATEGY, megatron_fsdp_max_pool_double_buffer=True)
    assert cfg.fsdp_double_buffer and cfg.double_buffer_policy.max_pool  # the implication, mirrored
    assert "double_buffer_policy" not in {f.name for f in dataclasses.fields(FsdpDDPConfig)}  # never copied
    assert not [name for name in vars(dbp) if not name.startswith("__") and isinstance(getattr(dbp, name), dict | set)]


LANES_WITHOUT_MAXPOOL = "{lanes} 3 needs {max_pool}: lanes are arenas of the max-pool double buffer"
STRATEGY_PROBLEM = "{max_pool} requires {strategy} optim_grads_params (the only strategy with FSDP units), got 'optim'"
PERSISTENT_PROBLEM = "{persistent} requires {double_buffer} or {max_pool}."
SPELLED = {
    FLAGS: {"lanes": "--megatron-fsdp-max-pool-lanes", "max_pool": "--megatron-fsdp-max-pool-double-buffer",
                "strategy": "--data-parallel-sharding-strategy", "double_buffer": "--fsdp-double-buffer",
                "persistent": "--fsdp-db-use-persist-buf-on-alloc-fail"},
    FIELDS: {"lanes": "megatron_fsdp_max_pool_lanes", "max_pool": "megatron_fsdp_max_pool_double_buffer",
                   "strategy": "data_parallel_sharding_strategy", "double_buffer": "fsdp_double_buffer",
                   "persistent": "fsdp_db_use_persist_buf_on_alloc_fail"},
    KEYWORDS: {"lanes": "maxpool_lanes", "max_pool": "maxpool_double_buffer", "strategy": "zero_dp_strategy",
                        "double_buffer": "fsdp_double_buffer", "persistent": "fsdp_db_use_persist_buf_on_alloc_fail"},
}
CASES = [  # (message, flags, config fields, fully_shard keywords)
    (LANES_WITHOUT_MAXPOOL, FSDP + ["--megatron-fsdp-max-pool-lanes", "3"],
     {**STRATEGY, "megatron_fsdp_max_pool_lanes": 3}, {"zero_dp_strategy": "optim_grads_params", "maxpool_lanes": 3}),
    (STRATEGY_PROBLEM, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim",
                        "--megatron-fsdp-max-pool-double-buffer"],
     {"data_parallel_sharding_strategy": "optim", "megatron_fsdp_max_pool_double_buffer": True},
     {"zero_dp_strategy": "optim", "maxpool_double_buffer": True}),
    (PERSISTENT_PROBLEM, FSDP + ["--fsdp-db-use-persist-buf-on-alloc-fail"],
     {**STRATEGY, "fsdp_db_use_persist_buf_on_alloc_fail": True},
     {"zero_dp_strategy": "optim_grads_params", "fsdp_db_use_persist_buf_on_alloc_fail": True}),
]


@pytest.mark.parametrize("message, flags, fields, keywords", CASES)
def test_each_error_names_the_users_spelling(validated, message, flags, fields, keywords):
    def expected(route):
        return "^" + message.format(**SPELLED[route]).replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")

    with pytest.raises(ValueError, match=expected(FLAGS)):
        validated(flags)
    for cfg_cls in (MCoreDDPConfig, FsdpDDPConfig):
        with pytest.raises(ValueError, match=expected(FIELDS)):
            cfg_cls(**fields)
    with pytest.raises(ValueError, match=expected(KEYWORDS)):
        fully_shard_keywords_checked(**keywords)


def test_each_spelling_names_real_settings():
    """Each config field is a field of both configs, each keyword fully_shard's, each flag the field's."""
    import inspect

    keywords = set(inspect.signature(fs.fully_shard_model).parameters)
    for name in ("max_pool", "lanes", "double_buffer", "persistent_fallback", "strategy"):
        field = getattr(FIELDS, name)
        assert field in {f.name for f in dataclasses.fields(MCoreDDPConfig)}, name
        assert field in {f.name for f in dataclasses.fields(FsdpDDPConfig)}, name
        assert getattr(KEYWORDS, name) in keywords, name
        assert getattr(FLAGS, name) == "--" + field.replace("_", "-"), name


def test_lanes_are_range_checked():
    assert policy_from_keywords(zero_dp_strategy="optim_grads_params", maxpool_double_buffer=True,
                                      maxpool_lanes=3).lanes == 3
    for bad in (3.0, True, "3", [3]):
        with pytest.raises(ValueError, match=re.escape(f"maxpool_lanes must be an integer >= 2, got {bad!r}")):
            policy_from_keywords(zero_dp_strategy="optim_grads_params", maxpool_double_buffer=True,
                                       maxpool_lanes=bad)
