"""``scripts/fsdp_memory_planner.py``: plan Megatron-FSDP double buffering without a GPU.

Takes pretrain_gpt.py / pretrain_hybrid.py model flags (parsed by Megatron's own parser) plus
``--plan-*`` options, builds the model on the meta device, computes the FSDP units and bucket
layout with Megatron-FSDP's own functions, and prints the max-pool / N-lane / rank-matched /
analytic minimum pool sizes and what 0.18.2's FixedPool would pool.

The model is the one the given flags define when they set its depth, else the default model
with the given flags on top ([Note: planner flags] in setup.py). Inconsistent flags are one
sentence and exit status 2 (``HFSDP_DEBUG=1`` for the trace).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from hfsdp.atomic import write_json_atomic
from hfsdp.planner import layout as layout_mod
from hfsdp.planner import model as model_mod
from hfsdp.planner import report, setup
from hfsdp.training import fsdp_units
from hfsdp.usererror import rejection, run_cli


def resolve_unit_classes(value: str | None, strategy: str = "optim_grads_params") -> list[type]:
    """Unit classes for ``--fsdp-unit-modules`` (same specs as HFSDP_FSDP_UNIT_MODULES)."""
    resolve = fsdp_units.unit_resolver(value)
    if resolve is None:
        return [fsdp_units.import_unit_class(p) for p in fsdp_units.DEFAULT_UNIT_CLASSES]
    return resolve(strategy)


def grad_dtypes(args: Any) -> tuple[Any, Any]:
    """(main_grads_dtype, grad_comm_dtype) as the Megatron-FSDP adapter derives them."""
    import torch

    if getattr(args, "accumulate_allreduce_grads_in_fp32", False):
        return torch.float32, torch.float32
    return (getattr(args, "megatron_fsdp_main_grads_dtype", None),
            getattr(args, "megatron_fsdp_grad_comm_dtype", None))


def bucket_size_for(args: Any, num_parameters: int) -> int | None:
    """Megatron-FSDP ``suggested_bucket_size`` as ``get_model`` computes it (non-units only):
    the same function (megatron/training/ddp_bucket_size.py)."""
    from megatron.training.ddp_bucket_size import default_bucket_size

    return default_bucket_size(
        bucket_size=args.ddp_bucket_size, num_buckets=args.ddp_num_buckets, num_parameters=num_parameters,
        dp_size=args.data_parallel_size, overlap_grad_reduce=args.overlap_grad_reduce,
    )


def plan_from_args(args: Any) -> tuple[layout_mod.Layout, list[dict[str, Any]]]:
    """Build the meta model for parsed ``args`` and return (layout, per-allocator results)."""
    from megatron.core import parallel_state as ps

    model_mod.ensure_selective_scan_stub()
    setup.init_fake_parallel_state(args)
    try:
        try:
            model = model_mod.build_meta_model(args)
        except AssertionError as exc:
            # Megatron's layer constructors check shapes with asserts (e.g. Mamba heads vs groups):
            # bad flags, said in one sentence. An assert of ours is a bug and keeps its traceback.
            if "/megatron/" not in traceback.extract_tb(exc.__traceback__)[-1].filename:
                raise
            raise rejection(exc, "Megatron cannot build this model", setup.FIX) from exc
        lay = layout_mod.compute_layout(
            model,
            unit_classes=resolve_unit_classes(args.fsdp_unit_modules, args.data_parallel_sharding_strategy),
            strategy=args.data_parallel_sharding_strategy,
            dp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
            expert_dp_size=ps.get_expert_data_parallel_world_size(),
            bucket_size=bucket_size_for(args, sum(p.numel() for p in model.parameters())),
        )
    finally:
        setup.teardown_fake_parallel_state()
    main_grads, comm = grad_dtypes(args)
    results = [
        report.plan_allocator(lay, "weight", align_bytes=args.plan_align_bytes, lanes=args.plan_lanes),
        report.plan_allocator(lay, "grad", align_bytes=args.plan_align_bytes, lanes=args.plan_lanes,
                              main_grads_dtype=main_grads, grad_comm_dtype=comm),
    ]
    return lay, results


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("fsdp_memory_planner", lambda: _main(list(sys.argv[1:] if argv is None else argv)))


@contextlib.contextmanager
def logs_to_stderr() -> Iterator[None]:
    """Megatron's training module logs to stdout (``log_handler.CustomHandler``); the planner's
    stdout is the plan alone, so that ``planner > plan.txt`` and ``planner | head`` get the plan,
    while Megatron's log lines go to stderr with our notes."""
    import megatron.training.training  # noqa: F401 (installs the handler at import)

    moved = [(h, h.stream) for h in logging.getLogger().handlers
             if isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.__stdout__)]
    for handler, _ in moved:
        handler.setStream(sys.stderr)
    try:
        yield
    finally:
        for handler, stream in moved:
            handler.setStream(stream)


def _main(argv: list[str]) -> int:
    with logs_to_stderr():
        return _plan(argv)


def _plan(argv: list[str]) -> int:
    args = setup.parse_flags(setup.model_argv(argv))
    print(f"fsdp_memory_planner: {setup.plan_note(argv, args)}", file=sys.stderr, flush=True)
    args = setup.validate(args)
    lay, results = plan_from_args(args)
    print("\n".join(report.format_report(lay, results)))
    if args.plan_json:
        write_json_atomic(args.plan_json, report.report_dict(lay, results))
        print(f"fsdp_memory_planner: wrote the plan as JSON to {args.plan_json}.")
    return 0
