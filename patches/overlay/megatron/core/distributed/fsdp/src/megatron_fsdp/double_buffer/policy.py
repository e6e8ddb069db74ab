# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""DoubleBufferPolicy: how Megatron-FSDP double-buffers, as one small frozen object built once.

[Note: double-buffer policy]
Double buffering can be asked for in four ways: Megatron's command line (validate_args), either
``DistributedDataParallelConfig`` (Megatron-Core's and Megatron-FSDP's own) and ``fully_shard``'s
keywords. Each is read by :func:`build_double_buffer_policy`, the one builder, into one
:class:`DoubleBufferPolicy` (modelled on FSDP2's ``MixedPrecisionPolicy``: small, frozen, checked
once); everything downstream reads that object, never the settings:
- the allocator: ParamAndGradBuffer picks FixedPool, MaxPool or LaneMaxPool with
  :meth:`DoubleBufferPolicy.pick` and builds it with ``live_units`` groups and the persistent
  fallback; symmetric.py stages the pool from ``stage_symmetric`` and the registration
  fields; the training checks (te_arg_checks.py, hfsdp's fsdp_units.training_lanes) read
  ``max_pool`` and ``lanes``.
Invariants:
- one set of rules: each rule is one function below, run only by the builder, in a fixed order;
  a message names each setting as the user wrote it (flag, config field or keyword), read off the
  one table :data:`SPELLINGS`.
- built once: the builder caches the policy by its (normalized) inputs, so the config that
  validate_args' flags become, or that ``fully_shard`` builds from its keywords, finds the policy
  already checked and the rules do not run again. Both configs' ``__post_init__`` store it as
  ``double_buffer_policy`` (a plain attribute, not a dataclass field); :func:`policy_of` rebuilds it
  only for a config whose fields were changed after ``__post_init__``.
- the implications stay where 0.18.2 code reads them: max-pool turns ``fsdp_double_buffer`` on
  (the configs and the flags), ``--use-nccl-ub`` with Megatron-FSDP does on the command line, and
  ParamAndGradBuffer does for ``nccl_ub`` at run time, so the policy counts NCCL user buffers as
  asking for double buffering.
- lanes are range-checked once, here; units are counted once, by the allocator that serves them
  (LaneMaxPool, with :func:`lanes_units_problem`): only the built model knows its FSDP units.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from .plan import SHARED_LANES, buffer_groups
from .plan import lanes_units_problem as _plan_lanes_units_problem

UNIT_STRATEGY = "optim_grads_params"  # the only sharding strategy with FSDP units
POLICY_ATTR = "double_buffer_policy"  # where both configs keep their policy
T = TypeVar("T")


class Allocator(enum.Enum):
    """Which double-buffer allocator ParamAndGradBuffer builds."""

    NONE = "none"  # no double buffer (StorageResize buckets)
    FIXED = "fixed"  # 0.18.2's FixedPoolAllocator (--fsdp-double-buffer)
    MAX_POOL = "max_pool"  # MaxPool; LaneMaxPool with 3 or more lanes


class Route(enum.Enum):
    """How the user gave the settings; picks the column of :data:`SPELLINGS`."""

    CLI = "command line"
    CONFIG = "DistributedDataParallelConfig"
    FULLY_SHARD = "fully_shard"


@dataclass(frozen=True)
class Spelling:
    """One setting: its flag, its config field (= argparse dest, read from args and configs), its
    ``fully_shard`` keyword (None: fully_shard has none and uses ``default``)."""

    flag: str
    field: str
    keyword: str | None
    default: Any = False

    def on(self, route: Route) -> str:
        if route is Route.CLI:
            return self.flag
        if route is Route.FULLY_SHARD and self.keyword is not None:
            return self.keyword
        return self.field

    def everywhere(self) -> str:
        """Every spelling, for messages of code that cannot tell the route (the allocators)."""
        keyword = f", fully_shard: {self.keyword}" if self.keyword else ""
        return f"{self.field} ({self.flag}{keyword})"


# The one table of the settings' names. Command line / config field / fully_shard keyword.
SPELLINGS: dict[str, Spelling] = {
    "max_pool": Spelling(
        "--megatron-fsdp-max-pool-double-buffer", "megatron_fsdp_max_pool_double_buffer", "maxpool_double_buffer"
    ),
    "lanes": Spelling("--megatron-fsdp-max-pool-lanes", "megatron_fsdp_max_pool_lanes", "maxpool_lanes", SHARED_LANES),
    "double_buffer": Spelling("--fsdp-double-buffer", "fsdp_double_buffer", "fsdp_double_buffer"),
    "persistent_fallback": Spelling(
        "--fsdp-db-use-persist-buf-on-alloc-fail",
        "fsdp_db_use_persist_buf_on_alloc_fail",
        "fsdp_db_use_persist_buf_on_alloc_fail",
    ),
    "nccl_ub": Spelling("--use-nccl-ub", "nccl_ub", "nccl_ub"),
    "disable_symmetric": Spelling(
        "--disable-symmetric-registration", "disable_symmetric_registration", "disable_symmetric_registration"
    ),
    "manual_registration": Spelling("--fsdp-manual-registration", "fsdp_manual_registration", None),
    "sharding_strategy": Spelling(
        "--data-parallel-sharding-strategy", "data_parallel_sharding_strategy", "zero_dp_strategy", "no_shard"
    ),
    # Only the command line says these (fully_shard builds Megatron-Core's config without them).
    "megatron_fsdp": Spelling("--use-megatron-fsdp", "use_megatron_fsdp", None),
    "ep_overlap": Spelling("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm", None),
}
INPUTS = ("max_pool", "lanes", "double_buffer", "persistent_fallback", "nccl_ub", "disable_symmetric",
          "manual_registration", "sharding_strategy")
CLI_ONLY = ("megatron_fsdp", "ep_overlap")


class Names:
    """The settings as one route spells them: ``Names(route).max_pool`` etc."""

    def __init__(self, route: Route):
        self.route = route

    def __getattr__(self, setting: str) -> str:
        spelling = SPELLINGS.get(setting)
        if spelling is None:
            raise AttributeError(setting)
        return spelling.on(self.route)


@dataclass(frozen=True)
class DoubleBufferPolicy:
    """How Megatron-FSDP double-buffers ([Note: double-buffer policy]); build it with
    :func:`build_double_buffer_policy`, which checks the settings it comes from."""

    allocator: Allocator = Allocator.NONE
    lanes: int = SHARED_LANES  # > SHARED_LANES only with the max-pool: round-robin lanes
    persistent_fallback: bool = False  # buckets the pool does not hold get a persistent buffer
    nccl_ub: bool = False  # the pool is registered as NCCL user buffers
    symmetric_registration: bool = True  # symmetric (window) registration under nccl_ub
    manual_registration: bool = False  # registration deferred to manual_buffer_registration

    @property
    def double_buffer(self) -> bool:
        return self.allocator is not Allocator.NONE

    @property
    def max_pool(self) -> bool:
        return self.allocator is Allocator.MAX_POOL

    @property
    def round_robin(self) -> bool:
        """Three or more lanes: LaneMaxPool ([Note: max-pool lanes] in plan.py)."""
        return self.max_pool and self.lanes > SHARED_LANES

    @property
    def live_units(self) -> int:
        """FSDP units that may hold double-buffer memory at once ([Note: live units])."""
        return self.lanes if self.round_robin else buffer_groups()  # plan.NUM_BUFFER_GROUPS

    @property
    def stage_symmetric(self) -> bool:
        """The max-pool arenas are staged in the NCCL pool at init (symmetric.py)."""
        return self.nccl_ub and self.max_pool

    def pick(self, fixed: T, max_pool: T, lanes: T) -> T:
        """The allocator of this policy among ParamAndGradBuffer's three."""
        if self.allocator is Allocator.NONE:
            raise ValueError(f"{self} has no double-buffer allocator to pick")
        if self.allocator is Allocator.FIXED:
            return fixed
        return lanes if self.round_robin else max_pool


def lanes_units_problem(lanes: int, num_units: int) -> str | None:
    """Why ``lanes`` round-robin lanes cannot serve a model chunk of ``num_units`` FSDP units, or
    None; the allocator that counts the units calls it, naming the lanes in every spelling."""
    return _plan_lanes_units_problem(lanes, num_units, setting=SPELLINGS["lanes"].everywhere())


# ----------------------------------------------------------------------------------------- rules
# Each rule: the settings (normalized, see _settings) and a route's names -> why they cannot work,
# or None. The command line's own rules run first, in validate_args' order of old.

Settings = dict[str, Any]
Rule = Callable[[Settings, Names], str | None]


def nccl_ub_ep_overlap_problem(s: Settings, n: Names) -> str | None:
    """NCCL user buffers with Megatron-FSDP need double buffering, which EP overlap forbids."""
    if s["nccl_ub"] and s["megatron_fsdp"] and s["ep_overlap"]:
        return (
            f"{n.nccl_ub} with {n.megatron_fsdp} needs FSDP double buffering, which "
            f"{n.ep_overlap} forbids; drop one of the two flags."
        )
    return None


def max_pool_ep_overlap_problem(s: Settings, n: Names) -> str | None:
    if s["max_pool"] and s["ep_overlap"]:
        return (
            f"{n.max_pool} is incompatible with {n.ep_overlap} (expert-parallel overlap "
            "forbids FSDP double buffering)."
        )
    return None


def max_pool_fsdp_problem(s: Settings, n: Names) -> str | None:
    """Max-pool is a Megatron-FSDP allocator: without Megatron-FSDP nothing would read it."""
    if s["max_pool"] and not s["megatron_fsdp"]:
        return f"{n.max_pool} requires {n.megatron_fsdp}."
    return None


def max_pool_strategy_problem(s: Settings, n: Names) -> str | None:
    """Max-pool needs FSDP units, which only ``optim_grads_params`` has (else a silent no-op)."""
    if s["max_pool"] and s["sharding_strategy"] != UNIT_STRATEGY:
        return (
            f"{n.max_pool} requires {n.sharding_strategy} {UNIT_STRATEGY} (the only "
            f"strategy with FSDP units), got {s['sharding_strategy']!r}."
        )
    return None


def lanes_problem(s: Settings, n: Names) -> str | None:
    """The lane count's range: an integer >= 2, above 2 only with the max-pool."""
    lanes = s["lanes"]
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < SHARED_LANES:
        return (
            f"{n.lanes} must be an integer >= {SHARED_LANES}, got {lanes!r}: a double buffer "
            f"needs a lane for the unit in use and one for the next; use {SHARED_LANES} (the "
            f"default, the shared pool) or 3 or more with {n.max_pool}."
        )
    if lanes > SHARED_LANES and not s["max_pool"]:
        return (
            f"{n.lanes} {lanes} needs {n.max_pool}: lanes are arenas of the max-pool "
            f"double buffer; add {n.max_pool}, or leave {n.lanes} at {SHARED_LANES}."
        )
    return None


def persistent_fallback_problem(s: Settings, n: Names) -> str | None:
    """The persistent fallback is for buckets a double buffer does not pool: it needs one."""
    if s["persistent_fallback"] and not s["double_buffer"]:
        return f"{n.persistent_fallback} requires {n.double_buffer} or {n.max_pool}."
    return None


CLI_RULES: tuple[Rule, ...] = (nccl_ub_ep_overlap_problem, max_pool_ep_overlap_problem, max_pool_fsdp_problem)
RULES: tuple[Rule, ...] = (max_pool_strategy_problem, lanes_problem, persistent_fallback_problem)


# ---------------------------------------------------------------------------------------- builder
_POLICIES: dict[tuple[Any, ...], DoubleBufferPolicy] = {}  # checked settings -> their policy
_CLI_CHECKED: set[tuple[Any, ...]] = set()  # checked settings + the command line's own


def _read(route: Route, source: Any, setting: str) -> Any:
    spelling = SPELLINGS[setting]
    if route is Route.FULLY_SHARD:
        return source.get(spelling.keyword, spelling.default) if spelling.keyword else spelling.default
    return getattr(source, spelling.field)


def _settings(route: Route, source: Any) -> Settings:
    """The inputs, normalized so that every route of the same setup gives the same key: double
    buffering counts as asked for by the max-pool and by NCCL user buffers too (see the note)."""
    s = {name: _read(route, source, name) for name in INPUTS}
    s["double_buffer"] = bool(s["double_buffer"] or s["max_pool"] or s["nccl_ub"])
    for name in ("max_pool", "persistent_fallback", "nccl_ub", "disable_symmetric", "manual_registration"):
        s[name] = bool(s[name])
    return s


def _key(s: Settings) -> tuple[Any, ...]:
    # The lane count's type too: 3.0 == 3, but only an int passes.
    return (*(s[name] for name in INPUTS), type(s["lanes"]))


def _first_problem(s: Settings, names: Names, rules: tuple[Rule, ...]) -> str | None:
    for rule in rules:
        problem = rule(s, names)
        if problem is not None:
            return problem
    return None


def _policy(s: Settings) -> DoubleBufferPolicy:
    allocator = Allocator.MAX_POOL if s["max_pool"] else Allocator.FIXED if s["double_buffer"] else Allocator.NONE
    return DoubleBufferPolicy(
        allocator=allocator,
        lanes=s["lanes"],
        persistent_fallback=s["persistent_fallback"],
        nccl_ub=s["nccl_ub"],
        symmetric_registration=not s["disable_symmetric"],
        manual_registration=s["manual_registration"],
    )


def build_double_buffer_policy(route: Route, source: Any) -> DoubleBufferPolicy:
    """The policy of the settings in ``source`` (Megatron's args, a DDP config, or ``fully_shard``'s
    keywords as a mapping), given by ``route``. Raises ValueError naming the first rule they break,
    in the route's spelling. Cached: the rules run once per distinct set of settings."""
    if route is Route.FULLY_SHARD and not isinstance(source, Mapping):
        raise TypeError(f"fully_shard's keywords come as a mapping, got {type(source).__name__}")
    s = _settings(route, source)
    try:
        key = _key(s)
        hash(key)
    except TypeError:  # an unhashable lane count: refused below, never cached
        key = None
    names = Names(route)
    if route is Route.CLI:
        s.update({name: bool(_read(route, source, name)) for name in CLI_ONLY})
        cli_key = None if key is None else (*key, *(s[name] for name in CLI_ONLY))
        if cli_key is None or cli_key not in _CLI_CHECKED:
            problem = _first_problem(s, names, CLI_RULES)
            if problem is not None:
                raise ValueError(problem)
            if cli_key is not None:
                _CLI_CHECKED.add(cli_key)
    cached = None if key is None else _POLICIES.get(key)
    if cached is not None:
        return cached
    problem = _first_problem(s, names, RULES)
    if problem is not None:
        raise ValueError(problem)
    policy = _policy(s)
    if key is not None:
        _POLICIES[key] = policy
    return policy


def clear_policy_cache() -> None:
    """Forget every built policy (tests)."""
    _POLICIES.clear()
    _CLI_CHECKED.clear()


# ------------------------------------------------------------------------------------ the routes
def policy_for_config(config: Any) -> DoubleBufferPolicy:
    """Both configs' ``__post_init__``: build the policy (rules in the fields' names) and apply what
    it implies (the max-pool turns ``fsdp_double_buffer`` on). The caller stores the result as
    ``double_buffer_policy``. Whether Megatron-FSDP is used is not the config's to say
    (``fully_shard`` builds Megatron-Core's config without ``use_megatron_fsdp``)."""
    policy = build_double_buffer_policy(Route.CONFIG, config)
    config.fsdp_double_buffer = bool(config.fsdp_double_buffer or policy.max_pool)
    return policy


def policy_for_fully_shard(**keywords: Any) -> DoubleBufferPolicy:
    """``fully_shard_model``'s check before it builds its config: the rules in its keywords' names."""
    return build_double_buffer_policy(Route.FULLY_SHARD, keywords)


def policy_of(config: Any) -> DoubleBufferPolicy:
    """The policy a DDP config holds: the one its ``__post_init__`` stored, unless its fields were
    changed since (or it has none), then the one its fields give now (cached, like every build)."""
    stored = getattr(config, POLICY_ATTR, None)
    s = _settings(Route.CONFIG, config)
    try:
        current = _POLICIES.get(_key(s))
    except TypeError:
        current = None
    if isinstance(stored, DoubleBufferPolicy) and current is stored:
        return stored
    policy = build_double_buffer_policy(Route.CONFIG, config)
    try:
        setattr(config, POLICY_ATTR, policy)
    except AttributeError:  # a frozen stand-in: nothing to keep
        pass
    return policy
