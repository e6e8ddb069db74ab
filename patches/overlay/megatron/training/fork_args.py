# Copyright (c) 2026, hfsdp authors. Licensed under the Apache License, Version 2.0.
"""The fork's own command-line flags, in an argument group of their own.

``add_megatron_arguments`` calls :func:`add_fork_args` after upstream's groups (a one-line hook
in arguments.py), so ``--help`` lists these flags under :data:`GROUP_TITLE` and
``python -m hfsdp.flags`` reads that group instead of guessing from patch texts. Flags whose value
is also a config field keep the field's name as their ``dest`` (get_megatron_ddp_config and the
training configs copy args by field name): ``--nccl-comm-warmup`` is
``DistributedInitConfig.nccl_comm_warmup``, which upstream's ``ArgumentGroupFactory`` leaves out of
its "distributed init" group (:data:`FACTORY_EXCLUDED`) so that it is declared here once. What the
double-buffer flags may be combined with is the double-buffer policy's business
(double_buffer/policy.py; [Note: double buffer], policy).

A base whose release lacks what a flag drives, or declares the flag itself, passes ``only``: the
option strings of the flags that have behaviour there, so that no flag without it is offered.
"""

import argparse
from collections.abc import Collection
from typing import Any

GROUP_TITLE = "hfsdp (fork)"
GROUP_DESCRIPTION = "Flags of the hfsdp fork, on top of megatron-core (python -m hfsdp.flags lists them)."
FACTORY_EXCLUDED = ["nccl_comm_warmup"]  # DistributedInitConfig fields declared here instead


def fork_group(parser: argparse.ArgumentParser) -> "argparse._ArgumentGroup | None":
    """The fork's argument group of ``parser``, or None when it has none (e.g. a pristine tree)."""
    return next((g for g in parser._action_groups if g.title == GROUP_TITLE), None)


def add_fork_args(parser: argparse.ArgumentParser, only: Collection[str] | None = None) -> argparse.ArgumentParser:
    """Add the fork's flags to ``parser`` in their own group; returns the parser. ``only``: just these
    option strings (see the module's docstring); None: every flag."""
    group = parser.add_argument_group(title=GROUP_TITLE, description=GROUP_DESCRIPTION)
    known: set[str] = set()

    def add(name: str, **kwargs: Any) -> None:
        known.add(name)
        if only is None or name in only:
            group.add_argument(name, **kwargs)

    add('--megatron-fsdp-max-pool-double-buffer', action='store_true',
        help='Size Megatron-FSDP double buffers by the largest FSDP unit so that '
        'every unit is pooled (implies --fsdp-double-buffer).')
    add('--megatron-fsdp-max-pool-lanes', type=int, default=2,
        help='Lanes of the max-pool double buffer = FSDP units live at once. 2: the '
        'shared pool, each lane sized by the largest unit; 3 or more: unit i lives '
        'in lane i %% N, each lane sized by its own largest unit, and all-gathers '
        'prefetch N-1 units ahead. Needs --megatron-fsdp-max-pool-double-buffer '
        'above 2.')
    add('--fsdp-db-use-persist-buf-on-alloc-fail', action='store_true',
        help='Give buckets that the FSDP double buffer does not pool (non-unit '
        'modules, FixedPool outliers) a persistent buffer instead of dynamic memory.')
    add('--nccl-comm-warmup', action='store_true', dest='nccl_comm_warmup',
        help='Before the training loop, run one inert collective on every NCCL group '
        'this rank belongs to (in group-creation order) so NCCL communicators are '
        'created while GPU memory is still free instead of lazily at the iteration-1 '
        'memory peak. Logs the count and time taken.')
    unknown = sorted(set(only or ()) - known)
    if unknown:
        raise ValueError(f"add_fork_args: {unknown} are not flags of the fork group {sorted(known)}")
    return parser
