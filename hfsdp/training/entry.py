"""Shared ``main()`` for ``pretrain_gpt.py`` and ``pretrain_hybrid.py``.

Flow: fork guard -> parse and validate *upstream* Megatron args (every upstream flag, plus the
flags our patches add to Megatron's own parser) -> pick the model family -> install the optional explicit
FSDP unit list hook -> build the
``PretrainConfigContainer`` -> ``megatron.training.pretrain``.

This module imports only the stdlib at import time so the guard runs before ``megatron`` loads.

Errors ([Note: user errors] in hfsdp/usererror.py): a flag argparse or Megatron's validation
rejects, an unreadable ``--yaml-cfg``, more max-pool lanes than a model chunk's units, a unit
list naming no class, a model family or spec that cannot be built, a stale or foreign
``megatron`` tree, and a machine without CUDA (after validating the flags as for an assumed GPU,
hfsdp/training/assumed_device.py) each end in one sentence with the way out and exit status 2;
``HFSDP_DEBUG=1`` adds the traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hfsdp.diagnostics import install_stack_dump_signal
from hfsdp.patchset.guard import ensure_fork
from hfsdp.training import upstream_base
from hfsdp.usererror import UserError, quoted, rejection, run_cli


def flags_fix() -> str:
    script = os.path.basename(sys.argv[0]) if sys.argv[0].endswith(".py") else "pretrain_gpt.py"
    return f"fix the flags; `python {quoted(script)} --help` lists every flag and its choices"

# Tokenizer default matches upstream's GPT entry point; mock-data runs pass
# `--tokenizer-type NullTokenizer --vocab-size N`.
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


USAGE = "%(prog)s [Megatron flags ...]"
EPILOG = "The fork's own flags, one line each: python -m hfsdp.flags"


def flag_error(message: str) -> UserError:
    """argparse's complaint about a flag as one sentence (not the usage of every Megatron flag):
    a bad number says which flag and what it got; an unknown flag names the nearest known one; a
    bad value of one of the fork's flags points at ``python -m hfsdp.flags``."""
    cause = message
    flag = None
    if m := re.fullmatch(r"argument ([^:/ ]+)[^:]*: invalid (int|float) value: '(.*)'", message):
        flag, kind, value = m.groups()
        cause = f"{flag} {value!r} is not a {'whole ' if kind == 'int' else ''}number"
    elif m := re.fullmatch(r"argument ([^:/ ]+)[^:]*: (.*)", message):
        flag = m.group(1)
        cause = f"{flag}: {m.group(2)}"
    if flag is not None and flag in _fork_flags():
        return UserError(cause, f"`python -m hfsdp.flags` says what {flag} takes and its default")
    return UserError(cause, flags_fix())


def _fork_flags() -> set[str]:
    from hfsdp.flags import fork_flag_names

    try:
        return fork_flag_names()
    except UserError:  # a tree without its stamp: the generic advice
        return set()


class _EntryParser(argparse.ArgumentParser):
    """Megatron's flags with argparse's errors raised as one-sentence UserErrors (:func:`flag_error`)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            known = [s for a in self._actions for s in a.option_strings]
            unknown = [a.split("=", 1)[0] for a in message.split(": ", 1)[1].split() if a.startswith("--")]
            near = {u: m[0] for u in unknown if (m := difflib.get_close_matches(u, known, n=1, cutoff=0.75))}
            if near:
                hint = ", ".join(m if len(unknown) == 1 else f"{m} for {u}" for u, m in near.items())
                message += f" (did you mean {hint}?)"
        raise flag_error(message)


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's own argument parser (every upstream flag plus the fork's patched-in ones); a bad
    flag is a UserError (one sentence) instead of argparse's usage of every flag and exit."""
    from megatron.training.arguments import add_megatron_arguments

    parser = _EntryParser(description="Megatron-LM Arguments (hfsdp entry point)", usage=USAGE, epilog=EPILOG,
                          allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser


def check_yaml_cfg(path: str) -> None:
    """``--yaml-cfg`` must name a readable YAML mapping; Megatron opens it with no check."""
    import yaml

    fix = "give --yaml-cfg a YAML file of flag values (a mapping), or leave it out and pass the flags"
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except IsADirectoryError:
        raise UserError(f"--yaml-cfg {path} is a folder, not a YAML file", fix) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--yaml-cfg {path} cannot be read: {getattr(exc, 'strerror', None) or exc}", fix) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"--yaml-cfg {path} is not valid YAML{at}: {problem}", fix) from exc
    if not isinstance(config, dict):
        raise UserError(f"--yaml-cfg {path} holds a YAML {type(config).__name__}, not a mapping of flag values", fix)


def parse_args(argv: Sequence[str] | None = None, forced_family: str | None = None):
    """Parse + validate Megatron args (sets Megatron's globals) and resolve the family.

    Returns ``(args, family)``. ``argv`` replaces ``sys.argv[1:]`` when given.
    """
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    from hfsdp.training import requirements, specs
    from hfsdp.training.assumed_device import validation_device
    from megatron.training.arguments import parse_and_validate_args

    # Optional packages (TE, mamba_ssm, causal_conv1d) first, from the flags as given: validate_args
    # already touches CUDA for some TE-only flags (--moe-grouped-gemm reads the device capability).
    # Flags read from a checkpoint or a YAML file are only known after validation.
    raw = megatron_parser().parse_args(sys.argv[1:])  # a bad flag: one sentence (flag_error)
    if raw.yaml_cfg is not None:
        check_yaml_cfg(raw.yaml_cfg)
    if not (raw.use_checkpoint_args or raw.yaml_cfg):
        requirements.check(raw)
    try:
        with validation_device():  # no GPU: an assumed one answers validate_args' device queries
            args = parse_and_validate_args(args_defaults=dict(ARGS_DEFAULTS))
    except (AssertionError, ValueError) as exc:  # Megatron validates flags with asserts and ValueErrors
        raise rejection(exc, "invalid flags", flags_fix()) from exc
    family = specs.resolve_family(args, forced_family)
    requirements.check(args)  # clear errors before any CUDA/NCCL work
    if (apex := requirements.apex_problem()) is not None and os.environ.get("RANK", "0") == "0":
        print(f"hfsdp: warning: {apex}", file=sys.stderr)  # said once, before Megatron imports Apex
    specs.use_transformer_engine(args)
    return args, family


def unit_override() -> list[str] | None:
    """Install ``HFSDP_FSDP_UNIT_MODULES``'s unit list (fsdp_units.py); a value naming no class is one sentence."""
    from hfsdp.training import fsdp_units

    try:
        return fsdp_units.install_unit_override()
    except (ValueError, ImportError) as exc:
        what = str(exc).removeprefix(f"{fsdp_units.ENV}: ")
        raise UserError(f"{fsdp_units.ENV}={os.environ.get(fsdp_units.ENV)!r}: {what}",
                        f"unset it, or give {fsdp_units.PRESET_0182}, none, or comma-separated dotted class "
                        "paths (docs/functional-tests.md)") from exc


def ensure_tree() -> Path | None:
    """The fork's guard, or on an upstream tree (``HFSDP_UPSTREAM_BASE``) the check that ``megatron`` is that
    tree; returns the upstream tree, None for the fork."""
    base = upstream_base.active()
    if base is None:
        ensure_fork()
    else:
        upstream_base.ensure(base)
    return base


def no_unit_override() -> None:
    """On an upstream tree (upstream_base.py) the FSDP units are upstream's: the fork's unit list is refused."""
    from hfsdp.training import fsdp_units

    if os.environ.get(fsdp_units.ENV):
        raise UserError(f"{fsdp_units.ENV} is the fork's setting, and this run is on the upstream tree "
                        f"{upstream_base.active()}, whose FSDP units are its own", f"unset {fsdp_units.ENV}")


def lanes_errors(base: Path | None) -> tuple[type[Exception], ...]:
    """The fork's max-pool lanes error, which the entry turns into one sentence; none on an upstream tree."""
    if base is not None:
        return ()
    from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer.lanes import MaxPoolLanesError

    return (MaxPoolLanesError,)


def require_cuda() -> None:
    """Training needs CUDA GPUs: say so, instead of torch's "Found no NVIDIA driver" deep inside."""
    import torch

    from hfsdp.training.assumed_device import ASSUMED_ARCH, arch_name

    if torch.cuda.is_available():
        return
    why = ("this torch is built without CUDA" if torch.version.cuda is None
           else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU or driver")
    raise UserError(
        f"training needs CUDA GPUs and {why}; the flags themselves are valid, checked as for "
        f"{arch_name(ASSUMED_ARCH)}",
        "run on a machine with NVIDIA GPUs (`torchrun --nproc-per-node N <this script> <the same flags>`); on this "
        "machine `python scripts/fsdp_memory_planner.py --plan-dp-size N <the same flags>` plans the memory "
        "without a GPU (N: the data-parallel size)",
    )


@dataclass(frozen=True)
class Hooks:
    """How an entry point built on this one (examples/) changes the run; each None keeps the usual."""

    check_args: Callable[[Any], None] | None = None  # after validation: a UserError for what it does not support
    model_provider: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None  # wraps the usual provider
    datasets_provider: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None  # wraps the usual one
    forward_step: Callable[..., Any] | None = None  # replaces the usual forward step


def main(argv: Sequence[str] | None = None, forced_family: str | None = None, hooks: Hooks | None = None) -> None:
    """Run pretraining; ``forced_family='hybrid'`` is ``pretrain_hybrid.py``. Exits 2 on bad input."""
    prog = os.path.basename(sys.argv[0]) or "pretrain"
    rc = run_cli(prog, lambda: run(argv, forced_family, hooks or Hooks()))
    if rc:
        sys.exit(rc)


def run(argv: Sequence[str] | None, forced_family: str | None, hooks: Hooks) -> None:
    """:func:`main` without its exit: a UserError propagates (for entry points built on this one)."""
    program_start = time.time()
    install_stack_dump_signal()  # `kill -USR1 <pid>` prints this rank's stacks (hung jobs)
    from hfsdp.autotune_cache import pin_cache_dir
    pin_cache_dir()  # before torch.compile runs: one Triton cache folder for every process ([Note] there)
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        from hfsdp.flags import quiet

        with quiet():  # every flag, without Megatron's import-time warnings before them
            ensure_tree()
            parser = megatron_parser()
        parser.parse_args(["--help"])  # prints the help and exits 0
    base = ensure_tree()
    from hfsdp import autotune_cache
    from hfsdp.determinism import ENV as PIN_ENV
    from hfsdp.determinism import pin_triton_autotune_from_env
    from hfsdp.step_digest import ENV as DIGEST_ENV
    from hfsdp.step_digest import install_from_env as install_digest_from_env
    from hfsdp.training import data, forward_step, model_provider, requirements, run_report
    from hfsdp.training.spec_error import SpecError
    from megatron.core.enums import ModelType
    from megatron.training import print_rank_0
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain, set_startup_timestamps

    set_startup_timestamps(program_start=program_start, main_entry=time.time())
    try:
        args, family = parse_args(argv, forced_family)
    except SpecError as exc:  # a MissingPackage carries its own way out: the extra, or a flag that avoids it
        raise exc.user_error(flags_fix()) from exc
    if hooks.check_args is not None:
        hooks.check_args(args)
    if base is not None:
        no_unit_override()
    units = unit_override() if base is None else None  # an environment setting: checked before the GPU is
    require_cuda()
    if install_digest_from_env() is not None:
        print_rank_0(f"> hfsdp entry: {DIGEST_ENV} set, weight/optimizer digests are logged")
    if pin_triton_autotune_from_env():  # before any Triton kernel runs
        print_rank_0(f"> hfsdp entry: {PIN_ENV}=1, Triton autotuners use their first valid config")
    autotune_cache.install()  # TRITON_CACHE_AUTOTUNING=1 covers pre_hook kernels too (inert without it)
    print_rank_0(f"> hfsdp entry: model family={family}, transformer_impl={args.transformer_impl}"
                 + (f", FSDP units override={units[0]}" if units else "")
                 + (f", pristine upstream tree {base}" if base is not None else ""))
    if base is None:  # which kernels Megatron takes: TE's, else Apex's, else torch's ([Note: NVIDIA Apex])
        paths = requirements.megatron_paths()
        print_rank_0("> hfsdp entry: Megatron takes " + "; ".join(f"{k}: {v}" for k, v in paths.items()))
    with warnings.catch_warnings():
        # We pass a model_provider function on purpose (the ModelConfig path is hybrid-only).
        warnings.filterwarnings("ignore", message=r"(?s).*recommended to use a ModelConfig")
        cfg = pretrain_cfg_container_from_args(args)
    provider = model_provider.make_model_provider(family)
    datasets: Callable[..., Any] = data.train_valid_test_datasets_provider
    if hooks.datasets_provider is not None:
        datasets = hooks.datasets_provider(datasets)
    try:
        pretrain(  # by keyword: 0.19 moved model_provider behind forward_step_func
            cfg,
            train_valid_test_dataset_provider=datasets,
            model_provider=hooks.model_provider(provider) if hooks.model_provider else provider,
            model_type=ModelType.encoder_or_decoder,
            forward_step_func=hooks.forward_step or forward_step.forward_step,
        )
    except lanes_errors(base) as exc:  # a flag error only the built model reveals (unit count)
        raise UserError(str(exc), flags_fix()) from exc
    run_report.write_if_requested()  # HFSDP_RUN_REPORT: peaks, pools, capture (run_report.py)
