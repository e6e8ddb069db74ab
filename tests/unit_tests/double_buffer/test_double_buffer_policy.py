"""The double-buffer policy ([Note: double-buffer policy] in megatron_fsdp/double_buffer/policy.py):
frozen, built once by one builder, the same from every route, errors in the route's spelling (CPU)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from test_maxpool_flags import BASE, FSDP, FsdpDDPConfig, MCoreDDPConfig, fs

import megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy as dbp
from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy import (
    Allocator,
    DoubleBufferPolicy,
    Route,
    policy_of,
)
from megatron.training.training import get_megatron_ddp_config

STRATEGY = {"data_parallel_sharding_strategy": "optim_grads_params"}
MAXPOOL_3 = {"megatron_fsdp_max_pool_double_buffer": True, "megatron_fsdp_max_pool_lanes": 3,
             "fsdp_db_use_persist_buf_on_alloc_fail": True}
FLAGS_3 = ["--megatron-fsdp-max-pool-double-buffer", "--megatron-fsdp-max-pool-lanes", "3",
           "--fsdp-db-use-persist-buf-on-alloc-fail"]
KEYWORDS_3 = {"zero_dp_strategy": "optim_grads_params", "maxpool_double_buffer": True, "maxpool_lanes": 3,
              "fsdp_db_use_persist_buf_on_alloc_fail": True}
EXPECTED_3 = DoubleBufferPolicy(allocator=Allocator.MAX_POOL, lanes=3, persistent_fallback=True)


@pytest.fixture(autouse=True)
def fresh_cache():
    dbp.clear_policy_cache()
    yield
    dbp.clear_policy_cache()


@pytest.fixture
def validated(megatron_validator):
    return megatron_validator(BASE, world_size=2)


@pytest.fixture
def rule_runs(monkeypatch):
    """How often the builder ran the policy's rules (the command line's own not counted)."""
    runs = []
    first_problem = dbp._first_problem

    def counting(s, names, rules):
        if rules is dbp.RULES:
            runs.append(names.route)
        return first_problem(s, names, rules)

    monkeypatch.setattr(dbp, "_first_problem", counting)
    return runs


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
    policy = dbp.policy_for_fully_shard(**KEYWORDS_3)
    assert policy == EXPECTED_3 and policy.round_robin and policy.live_units == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.lanes = 4  # type: ignore[misc]
    assert policy.pick("fixed", "max_pool", "lanes") == "lanes"
    shared = dbp.policy_for_fully_shard(zero_dp_strategy="optim_grads_params", maxpool_double_buffer=True)
    assert shared.pick("fixed", "max_pool", "lanes") == "max_pool" and shared.live_units == 2
    fixed = dbp.policy_for_fully_shard(zero_dp_strategy="optim_grads_params", nccl_ub=True)
    assert fixed.allocator is Allocator.FIXED and fixed.nccl_ub and not fixed.stage_symmetric
    none = dbp.policy_for_fully_shard()
    assert not none.double_buffer
    with pytest.raises(ValueError, match="has no double-buffer allocator"):
        none.pick("fixed", "max_pool", "lanes")


def test_every_route_gives_the_same_policy_built_once(validated, rule_runs):
    args = validated(FSDP + FLAGS_3)
    cli = dbp.build_double_buffer_policy(Route.CLI, args)
    core = get_megatron_ddp_config(args).double_buffer_policy  # the flags' config finds it built
    assert rule_runs == [Route.CLI]
    mcore = MCoreDDPConfig(use_megatron_fsdp=True, **STRATEGY, **MAXPOOL_3).double_buffer_policy
    fsdp = FsdpDDPConfig(**STRATEGY, **MAXPOOL_3).double_buffer_policy
    fully_shard_keywords_checked(**KEYWORDS_3)
    keywords = dbp.policy_for_fully_shard(**KEYWORDS_3)
    assert cli == core == mcore == fsdp == keywords == EXPECTED_3
    assert cli is core is mcore is fsdp is keywords  # one object: the rules ran once
    assert rule_runs == [Route.CLI]


def test_a_config_builds_its_policy_once_and_keeps_it(rule_runs):
    cfg = FsdpDDPConfig(**STRATEGY, megatron_fsdp_max_pool_double_buffer=True)
    assert rule_runs == [Route.CONFIG] and cfg.fsdp_double_buffer  # the implication, applied once
    assert policy_of(cfg) is cfg.double_buffer_policy and rule_runs == [Route.CONFIG]
    FsdpDDPConfig(**STRATEGY, megatron_fsdp_max_pool_double_buffer=True)
    assert rule_runs == [Route.CONFIG]
    assert "double_buffer_policy" not in {f.name for f in dataclasses.fields(FsdpDDPConfig)}  # never copied


def test_a_config_changed_after_post_init_gets_the_policy_of_its_fields():
    cfg = MCoreDDPConfig(use_megatron_fsdp=True, **STRATEGY, megatron_fsdp_max_pool_double_buffer=True)
    assert policy_of(cfg).live_units == 2
    cfg.megatron_fsdp_max_pool_lanes = 4
    assert policy_of(cfg).lanes == 4 and cfg.double_buffer_policy.lanes == 4
    cfg.megatron_fsdp_max_pool_double_buffer = False
    with pytest.raises(ValueError, match="^megatron_fsdp_max_pool_lanes 4 needs megatron_fsdp_max_pool_double_buffer"):
        policy_of(cfg)


LANES_WITHOUT_MAXPOOL = "{lanes} 3 needs {max_pool}: lanes are arenas of the max-pool double buffer"
STRATEGY_PROBLEM = "{max_pool} requires {strategy} optim_grads_params (the only strategy with FSDP units), got 'optim'"
PERSISTENT_PROBLEM = "{persistent} requires {double_buffer} or {max_pool}."
SPELLED = {
    Route.CLI: {"lanes": "--megatron-fsdp-max-pool-lanes", "max_pool": "--megatron-fsdp-max-pool-double-buffer",
                "strategy": "--data-parallel-sharding-strategy", "double_buffer": "--fsdp-double-buffer",
                "persistent": "--fsdp-db-use-persist-buf-on-alloc-fail"},
    Route.CONFIG: {"lanes": "megatron_fsdp_max_pool_lanes", "max_pool": "megatron_fsdp_max_pool_double_buffer",
                   "strategy": "data_parallel_sharding_strategy", "double_buffer": "fsdp_double_buffer",
                   "persistent": "fsdp_db_use_persist_buf_on_alloc_fail"},
    Route.FULLY_SHARD: {"lanes": "maxpool_lanes", "max_pool": "maxpool_double_buffer", "strategy": "zero_dp_strategy",
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

    with pytest.raises(ValueError, match=expected(Route.CLI)):
        validated(flags)
    for cfg_cls in (MCoreDDPConfig, FsdpDDPConfig):
        with pytest.raises(ValueError, match=expected(Route.CONFIG)):
            cfg_cls(**fields)
    with pytest.raises(ValueError, match=expected(Route.FULLY_SHARD)):
        fully_shard_keywords_checked(**keywords)


def test_one_table_spells_every_setting():
    """Every spelling a message uses comes from SPELLINGS; each config field is a field of both
    configs (or of Megatron-Core's only, for the command line's own), each keyword fully_shard's."""
    import inspect

    keywords = set(inspect.signature(fs.fully_shard_model).parameters)
    core = {f.name for f in dataclasses.fields(MCoreDDPConfig)}
    own = {f.name for f in dataclasses.fields(FsdpDDPConfig)}
    for name, spelling in dbp.SPELLINGS.items():
        if name in dbp.INPUTS:
            assert spelling.field in core and spelling.field in own, name
        assert spelling.keyword is None or spelling.keyword in keywords, name
        assert spelling.flag == "--" + spelling.field.replace("_", "-") or name == "nccl_ub", name
    assert dbp.SPELLINGS["nccl_ub"].flag == "--use-nccl-ub"


def test_lanes_are_range_checked_once_and_a_float_is_never_taken_from_the_cache():
    assert dbp.policy_for_fully_shard(zero_dp_strategy="optim_grads_params", maxpool_double_buffer=True,
                                      maxpool_lanes=3).lanes == 3
    for bad in (3.0, True, "3", [3]):
        with pytest.raises(ValueError, match=re.escape(f"maxpool_lanes must be an integer >= 2, got {bad!r}")):
            dbp.policy_for_fully_shard(zero_dp_strategy="optim_grads_params", maxpool_double_buffer=True,
                                       maxpool_lanes=bad)
