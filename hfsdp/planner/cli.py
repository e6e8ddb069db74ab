"""``scripts/fsdp_memory_planner.py``: plan Megatron-FSDP double buffering without a GPU.

Takes pretrain_gpt.py / pretrain_hybrid.py model flags (parsed by Megatron's own parser) plus
``--plan-*`` options, builds the model on the meta device, computes the FSDP units and bucket
layout with Megatron-FSDP's own functions, and prints the max-pool / N-lane / rank-matched /
analytic minimum pool sizes and what 0.18.2's FixedPool would pool.

The model is the one the given flags define when they set its depth, else the default model
with the given flags on top ([Note: planner flags] in setup.py). Inconsistent flags are one
sentence and exit status 2 (``HFSDP_DEBUG=1`` for the trace). Training's own settings apply as
training applies them: ``--megatron-fsdp-max-pool-lanes N`` plans the N-lane pool (refused, in
training's words, for more lanes than units) and ``$HFSDP_FSDP_UNIT_MODULES`` names the units
unless ``--fsdp-unit-modules`` does.

[Note: cannot fit] A plan is refused when the pools alone, which no data-parallel size shrinks,
exceed the largest GPU memory known (``memory.LARGEST_GPU_BYTES``, an H200's 141 GiB): no GPU can
hold it. When only the rank's whole planned memory (its shards plus the pools,
``memory.planned_memory``, a lower bound) exceeds it, the plan is printed with a warning on
stderr: a larger ``--plan-dp-size`` shrinks the shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from hfsdp.atomic import write_json_atomic
from hfsdp.planner import fp8 as fp8_mod
from hfsdp.planner import layout as layout_mod
from hfsdp.planner import model as model_mod
from hfsdp.planner import report, setup
from hfsdp.planner.memory import (
    GIB,
    LARGEST_GPU,
    LARGEST_GPU_BYTES,
    grad_dtypes,
    planned_memory,
    reference_memory,
    two_models_lines,
)
from hfsdp.training import fsdp_units
from hfsdp.training.spec_error import SpecError
from hfsdp.usererror import UserError, output_file, rejection, run_cli

UNITS_FIX = ("give --fsdp-unit-modules TransformerLayer, MoETransformerLayer or MambaLayer (comma-separated), "
             "dotted class paths, megatron-0.18.2 or none")
NO_UNITS_FIX = ("give --fsdp-unit-modules classes the model has (TransformerLayer, MoETransformerLayer, "
                "MambaLayer, or dotted class paths)")


def unit_modules(args: Any) -> tuple[str | None, str]:
    """The unit list training would use, and where it comes from: ``--fsdp-unit-modules``, else
    ``$HFSDP_FSDP_UNIT_MODULES`` (training reads only that), else the fork's default."""
    if args.fsdp_unit_modules is not None:
        return args.fsdp_unit_modules, "--fsdp-unit-modules"
    if os.environ.get(fsdp_units.ENV, "").strip():
        return os.environ[fsdp_units.ENV], f"${fsdp_units.ENV}"
    return None, "the fork's default"


def resolve_unit_classes(value: str | None, strategy: str = "optim_grads_params",
                         source: str = "--fsdp-unit-modules") -> list[type]:
    """Unit classes for ``--fsdp-unit-modules`` (same specs as HFSDP_FSDP_UNIT_MODULES); a name
    that is no class is a UserError naming ``source``."""
    try:
        resolve = fsdp_units.unit_resolver(value)
        if resolve is None:
            return [fsdp_units.import_unit_class(p) for p in fsdp_units.default_unit_paths()]
        return resolve(strategy)
    except (ValueError, ImportError) as exc:
        why = str(exc).removeprefix(f"{fsdp_units.ENV}: ")
        raise UserError(f"{source} {value!r}: {why}", UNITS_FIX) from exc


def training_lanes_setting() -> str:
    """The lane count in every spelling, as LaneMaxPool names it (the double-buffer policy's table)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.policy import FIELDS, FLAGS, KEYWORDS

    return f"{FIELDS.lanes} ({FLAGS.lanes}, fully_shard: {KEYWORDS.lanes})"


def lanes_to_plan(args: Any) -> tuple[int, ...] | None:
    """``--plan-lanes`` and the lanes training would hold (``--megatron-fsdp-max-pool-lanes``);
    None: the default (:data:`report.DEFAULT_LANES`)."""
    training = fsdp_units.training_lanes(args)
    if args.plan_lanes is None:
        return None if training is None else (training,)
    return tuple(dict.fromkeys([*args.plan_lanes, *([training] if training else [])]))


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
    recipe = fp8_mod.fp8_recipe(args)  # before any work: MXFP8 and custom recipes are refused
    setup.init_fake_parallel_state(args)
    try:
        value, source = unit_modules(args)
        unit_classes = resolve_unit_classes(value, args.data_parallel_sharding_strategy, source)
        try:
            model = model_mod.build_meta_model(args)
        except (AssertionError, ValueError) as exc:
            # Megatron's layer constructors check shapes with asserts (e.g. Mamba heads vs groups) and
            # refuse what this machine lacks with a ValueError (the fused Mamba path without
            # causal-conv1d): bad flags, said in one sentence. One of ours is a bug and keeps its traceback.
            if "/megatron/" not in traceback.extract_tb(exc.__traceback__)[-1].filename:
                raise
            raise rejection(exc, "Megatron cannot build this model", setup.FIX) from exc
        except SpecError as exc:  # the training entry's own refusals (e.g. TE asked for, not installed)
            raise exc.user_error(setup.FIX) from exc
        lay = layout_mod.compute_layout(
            model,
            unit_classes=unit_classes,
            strategy=args.data_parallel_sharding_strategy,
            dp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
            expert_dp_size=ps.get_expert_data_parallel_world_size(),
            bucket_size=bucket_size_for(args, sum(p.numel() for p in model.parameters())),
            fp8_names=fp8_mod.meta_fp8_params(model), fp8_recipe=recipe,
            keep_fp8_transpose=bool(args.keep_fp8_transpose_cache),
            live_units=fsdp_units.training_lanes(args) or layout_mod.SHARED_LIVE_UNITS,
        )
    finally:
        setup.teardown_fake_parallel_state()
    if not lay.units:
        what = (f"no module of the model is a {' or '.join(c.__name__ for c in unit_classes)}" if unit_classes
                else "it names no unit class")
        raise UserError(f"{source} {value!r} gives the model no FSDP unit ({what}), so there is no double "
                        "buffer to plan", NO_UNITS_FIX)
    lanes = fsdp_units.training_lanes(args)
    if lanes is not None and (problem := report.lanes_units_problem(lay, lanes, training_lanes_setting())):
        raise UserError(problem, f"give --megatron-fsdp-max-pool-lanes between 3 and {len(lay.units)}, "
                                 "or leave it at 2 (the shared pool)")
    main_grads, comm = grad_dtypes(args)
    wanted = lanes_to_plan(args)
    results = [
        report.plan_allocator(lay, "weight", align_bytes=args.plan_align_bytes, lanes=wanted),
        report.plan_allocator(lay, "grad", align_bytes=args.plan_align_bytes, lanes=wanted,
                              main_grads_dtype=main_grads, grad_comm_dtype=comm),
    ]
    return lay, results


def check_fits(args: Any, lay: layout_mod.Layout, results: list[dict[str, Any]]) -> str | None:
    """Refuse a plan no GPU can hold; the warning to print when a rank's whole memory exceeds the
    largest GPU at this data-parallel size (None when it does not). See [Note: cannot fit]."""
    memory = planned_memory(args, lay, results, fsdp_units.training_lanes(args))
    largest = f"the {LARGEST_GPU_BYTES / GIB:.0f} GiB of the largest GPU known ({LARGEST_GPU})"
    if memory.pools > LARGEST_GPU_BYTES:
        raise UserError(f"this model cannot fit any GPU: its double-buffer pools alone take "
                        f"{memory.pools / GIB:,.1f} GiB on every rank at any data-parallel size, more than "
                        f"{largest}", "shrink the model (--hidden-size, --ffn-hidden-size, --num-experts, "
                        "--moe-ffn-hidden-size) or split it into more FSDP units")
    if memory.total > LARGEST_GPU_BYTES:
        return (f"warning: at --plan-dp-size {args.plan_dp_size} each rank holds at least "
                f"{memory.describe()} before activations, more than {largest}; a larger --plan-dp-size "
                "shrinks the shards")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("fsdp_memory_planner", lambda: _main(list(sys.argv[1:] if argv is None else argv)))


def help_asked(argv: Sequence[str]) -> int | None:
    """``--help``: the planner's own options and where Megatron's flags are, nothing imported from
    Megatron (so no upstream warnings); ``--help-megatron``: every flag the planner takes, the
    planner's first, Megatron's import warnings held back. None: no help asked for."""
    if setup.HELP_MEGATRON in argv:
        from hfsdp.flags import quiet

        with quiet():
            text = setup.full_parser().format_help()
        print(text, end="")
        return 0
    if "-h" in argv or "--help" in argv:
        setup.planner_parser().print_help()
        return 0
    return None


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
    if (rc := help_asked(argv)) is not None:
        return rc
    with logs_to_stderr():
        return _plan(argv)


def _plan(argv: list[str]) -> int:
    args = setup.parse_flags(setup.model_argv(argv))
    setup.check_planner_flags(args)
    if args.plan_json is not None:
        output_file("--plan-json", args.plan_json)  # before the work, not after it
    print(f"fsdp_memory_planner: {setup.plan_note(argv, args)}", file=sys.stderr, flush=True)
    value, source = unit_modules(args)
    if source.startswith("$"):
        print(f"fsdp_memory_planner: FSDP units from {source}={value}, as training takes them.",
              file=sys.stderr, flush=True)
    args = setup.validate(args)
    lay, results = plan_from_args(args)
    warning = check_fits(args, lay, results)
    print("\n".join(report.format_report(lay, results)))
    trained = planned_memory(args, lay, results, fsdp_units.training_lanes(args))
    if args.plan_reference:
        print("\n".join(two_models_lines(trained)))
    if warning:
        print(f"fsdp_memory_planner: {warning}", file=sys.stderr, flush=True)
    if args.plan_json is not None:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.plan_json)), exist_ok=True)
            plan = report.report_dict(lay, results)
            if args.plan_reference:
                parts = {"trained": trained, "reference": reference_memory(trained)}
                plan["models"] = {k: {**dataclasses.asdict(m), "total": m.total} for k, m in parts.items()}
                plan["models_total_bytes"] = sum(m.total for m in parts.values())
            write_json_atomic(args.plan_json, plan)
        except OSError as exc:  # what no check beforehand can tell: a full disk, a folder that takes no file
            raise UserError(f"--plan-json {args.plan_json} could not be written ({exc.strerror or exc}); the "
                            "plan above is complete, and no file was left half-written",
                            "give --plan-json a file in a folder you can write to") from None
        print(f"fsdp_memory_planner: wrote the plan as JSON to {args.plan_json}.")
    return 0
