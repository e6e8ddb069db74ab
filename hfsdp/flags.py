"""``python -m hfsdp.flags``: the fork's own training flags, one line each (what, default).

``python pretrain_gpt.py --help`` lists every Megatron flag, thousands of lines. This lists only
the flags the fork adds to Megatron's parser.

[Note: the fork's flags] The fork declares its flags in an argument group of its own,
``hfsdp (fork)`` (``megatron/training/fork_args.py``, added to Megatron's parser by a one-line hook in
``add_megatron_arguments``): a flag is the fork's when it is in that group of Megatron's real parser
(the one ``--help`` prints), which also says what each flag does and its default, so the listing
cannot drift from the flags; a test holds it to the flags the materialized parser has and the
pristine release's parser lacks. The training entry (hfsdp/training/entry.py) uses
:func:`fork_flag_names` to point a bad value of one of these flags here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import warnings
from collections.abc import Iterator, Sequence

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


def listing(parser: argparse.ArgumentParser, names: set[str]) -> list[str]:
    """One line per fork flag: its option strings (and metavar), its default, what it does."""
    rows = []
    for action in fork_actions(parser, names):
        takes = "" if action.nargs == 0 else f" {metavar(action)}"
        rows.append((", ".join(action.option_strings) + takes, default_text(action), what_it_does(parser, action)))
    if not rows:
        return []
    width = max(len(r[0]) for r in rows)
    dwidth = max(len(r[1]) for r in rows)
    return [f"{flag:<{width}}  {default:<{dwidth}}  {does}" for flag, default, does in rows]


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


def main(argv: Sequence[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m hfsdp.flags", description=__doc__.split("\n")[0])
    cli.parse_args(argv)

    def run() -> int:
        from hfsdp.patchset.guard import ensure_fork

        ensure_fork()
        with quiet():
            parser = megatron_parser()  # what --help lists
            names = fork_flag_names(parser)
        lines = listing(parser, names)
        print("The fork's flags (on top of every Megatron flag; `python pretrain_gpt.py --help` lists all):")
        print("\n".join(lines))
        return 0

    return run_cli("hfsdp.flags", run)


if __name__ == "__main__":
    sys.exit(main())
