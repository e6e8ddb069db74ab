"""``python -m hfsdp.flags``: every option the fork adds, one line each (what it takes, default, meaning).

``python pretrain_gpt.py --help`` lists every Megatron flag, thousands of lines. This lists what the
fork adds: its flags on Megatron's parser (``pretrain_gpt.py``, ``pretrain_hybrid.py``, the planner),
the upstream flag value it makes work (``--cuda-graph-impl full_iteration``), and the options our
launchers share that are the fork's (``--ranks-per-gpu``, ``--env``, the benchmark's ``--base``).

[Note: the fork's flags] The fork declares its Megatron flags in an argument group of its own,
``hfsdp (fork)`` (``megatron/training/fork_args.py``, added to Megatron's parser by a one-line hook in
``add_megatron_arguments``): a flag is the fork's when it is in that group of Megatron's real parser.
The listing itself is the table :data:`PRETRAIN` + :data:`LAUNCHERS`, printed without importing
Megatron or torch (importing ``megatron.training`` alone takes seconds); a CPU test
(tests/unit_tests/training_entry/test_flags.py) holds the table to the real parsers, so the two cannot
drift: on the materialized base, the rows of :data:`PRETRAIN` are exactly the fork group plus the
upstream values the fork makes work, with the parser's default and the first words of its help,
and every launcher a row names has that option, with that default and help. The training entry
(hfsdp/training/entry.py) uses :func:`fork_flag_names` to point a bad value of one of these flags here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence

from hfsdp.usererror import UserError, run_cli

GROUP_TITLE = "hfsdp (fork)"  # megatron/training/fork_args.py (a test holds the two equal)
FIX = "run `scripts/patchset materialize` (or `pip install -e .`) to build the megatron tree with its fork group"


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's parser with every flag, as ``--help`` prints it."""
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def fork_group_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of ``parser``'s fork group (see the note); UserError when it has none."""
    try:
        from megatron.training.fork_args import fork_group
    except ImportError:  # a tree without the fork's overlay (e.g. a pristine release)
        group = None
    else:
        group = fork_group(parser)
    if group is None:
        raise UserError(f"Megatron's parser has no argument group {GROUP_TITLE!r}, so the fork's flags cannot be told",
                        FIX)
    return list(group._group_actions)


def fork_flag_names(parser: argparse.ArgumentParser | None = None) -> set[str]:
    """Every option string of the fork's flags (see the note), from ``parser`` (default: Megatron's)."""
    actions = fork_group_actions(megatron_parser() if parser is None else parser)
    return {s for a in actions for s in a.option_strings}


def fork_actions(parser: argparse.ArgumentParser, names: set[str]) -> list[argparse.Action]:
    """The parser's actions that are the fork's, in the order ``--help`` lists them."""
    return [a for a in parser._actions if set(a.option_strings) & names]


def metavar(action: argparse.Action) -> str:
    """What the flag takes, briefly: its metavar, its choices, or N / X / VALUE by type."""
    if action.metavar:
        return str(action.metavar)
    if action.choices:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return {int: "N", float: "X"}.get(action.type, "VALUE")  # type: ignore[call-overload]


def default_text(action: argparse.Action) -> str:
    if action.default == []:  # a repeatable option given no times
        return "none"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    return "unset" if action.default is None else str(action.default)


def what_it_does(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The first sentence of the flag's help, as ``--help`` prints it (``%%`` expanded)."""
    text = " ".join(parser._get_formatter()._expand_help(action).split()) if action.help else ""
    first = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
    return first or "(no help text)"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Megatron's import-time warnings held back (shown only if what runs inside fails)."""
    noise = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(noise), contextlib.redirect_stdout(noise):
            warnings.simplefilter("ignore")
            yield
    except BaseException:
        sys.stderr.write(noise.getvalue())
        raise


@dataclasses.dataclass(frozen=True)
class Row:
    """One option as the listing prints it; the test holds each field to the real parser (see the note)."""

    option: str  # the option string, e.g. --nccl-comm-warmup
    takes: str  # its metavar ("" for a switch), or the one value the row is about
    default: str  # as :func:`default_text` writes the parser's default
    meaning: str  # the first words of the parser's help (a prefix of its first sentence; "…": cut short)
    where: tuple[str, ...]  # PRETRAIN: the bases whose fork group has it; LAUNCHERS: the launchers that take it


BASES = ("0.18.2", "0.19.2")
UPSTREAM_VALUES = {"--cuda-graph-impl": "full_iteration"}  # upstream flags whose value the fork makes work

PRETRAIN = (
    Row("--megatron-fsdp-max-pool-double-buffer", "", "off",
        "Size Megatron-FSDP double buffers by the largest FSDP unit so that every unit is pooled "
        "(implies --fsdp-double-buffer).", ("0.18.2",)),
    Row("--megatron-fsdp-max-pool-lanes", "N", "2",
        "Lanes of the max-pool double buffer = FSDP units live at once.", BASES),
    Row("--fsdp-db-use-persist-buf-on-alloc-fail", "", "off",
        "Give buckets that the FSDP double buffer does not pool (non-unit modules, FixedPool outliers) a "
        "persistent buffer instead of dynamic memory.", ("0.18.2",)),
    Row("--nccl-comm-warmup", "", "off",
        "Before the training loop, run one inert collective on every NCCL group this rank belongs to …", BASES),
    Row("--cuda-graph-impl", "full_iteration", "none",
        "upstream's flag; the fork makes full_iteration work on every torch: capture on the capture stream, "
        "capture checks, capture memory report, rerun mode off, evaluation graphs (docs/cuda-graphs.md)", BASES),
)

EXAMPLE = "examples/reference_kl/train.py"
EXAMPLES = (  # beside every pretrain_gpt.py flag (hfsdp/training/reference_flags.py)
    Row("--reference-kl-weight", "W", "0.1", "Weight of the KL(reference || trained) term in the loss; 0 trains on "
        "the cross entropy alone.", (EXAMPLE,)),
    Row("--reference-free-after", "N", "unset", "Free the reference model after training step N.", (EXAMPLE,)),
    Row("--no-reference", "", "off", "No reference model: the same loss path without the KL term.", (EXAMPLE,)),
)

LAUNCHER_NAMES = {
    "run_case": "python -m hfsdp.functional.run_case",
    "batch": "python -m hfsdp.functional.batch",
    "benchmark": "scripts/benchmark_double_buffer.py",
    "submit": "python -m hfsdp.slurm.submit",
    "launch": "python -m hfsdp.launch",
}
COUNT_LAUNCHERS = ("run_case", "batch", "benchmark", "submit")

LAUNCHERS = (
    Row("--ranks-per-gpu", "N", "1", "start N ranks on each GPU (one host only): data-parallel runs on fewer GPUs, "
        "for numerics, memory and exit-path checks, never for speed", COUNT_LAUNCHERS),
    Row("--ranks-per-gpu", "N|auto", "1", "ranks on each GPU (default 1); auto: as many as N ranks need on this "
        "machine", ("launch",)),
    Row("--env", "KEY=VALUE", "none", "set this variable in the launched job (repeatable); everything else in the "
        "caller's environment is passed through unchanged", COUNT_LAUNCHERS),
    Row("--base", "NAMES", "fork",
        "Megatron trees to run each configuration on, comma-separated or repeated: fork, upstream-0.19.2, "
        "upstream-0.18.2 (default fork)", ("benchmark",)),
)


def table(rows: Sequence[Row], where: Callable[[Row], str]) -> list[str]:
    """The rows as aligned lines: option and what it takes, default, meaning, where it applies."""
    cells = [(f"{r.option} {r.takes}".rstrip(), r.default, f"{r.meaning} [{where(r)}]") for r in rows]
    width = max(len(c[0]) for c in cells)
    dwidth = max(len(c[1]) for c in cells)
    return [f"  {flag:<{width}}  {default:<{dwidth}}  {does}" for flag, default, does in cells]


def lines() -> list[str]:
    """What ``python -m hfsdp.flags`` prints (no Megatron, no torch)."""
    def bases(r: Row) -> str:
        return "both bases" if r.where == BASES else f"{', '.join(r.where)} base only"

    return [
        "The fork's options: option, default, meaning [where]. Every Megatron flag: python pretrain_gpt.py --help.",
        f"pretrain_gpt.py, pretrain_hybrid.py and scripts/fsdp_memory_planner.py (group {GROUP_TITLE!r}):",
        *table(PRETRAIN, bases),
        f"{EXAMPLE}, beside every pretrain_gpt.py flag (docs/reference-model.md):",
        *table(EXAMPLES, lambda r: "example"),
        "Our launchers (" + "; ".join(f"{k}: {v}" for k, v in LAUNCHER_NAMES.items())
        + "; each one's --help lists its other options):",
        *table(LAUNCHERS, lambda r: ", ".join(r.where)),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m hfsdp.flags", description=__doc__.split("\n")[0])

    def run() -> int:
        cli.parse_args(argv)
        print("\n".join(lines()))
        return 0

    return run_cli("hfsdp.flags", run)


if __name__ == "__main__":
    sys.exit(main())
