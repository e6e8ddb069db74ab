"""``python -m hfsdp.flags``: the fork's own training flags, one line each (what, default).

``python pretrain_gpt.py --help`` lists every Megatron flag, thousands of lines. This lists only
the flags the fork adds to Megatron's parser.

[Note: the fork's flags] Which flags are the fork's is read off the patches this ``megatron`` tree
was built from (its stamp records their texts, ``megatron/.patchset-stamp.json``): a flag is the
fork's when a patch adds its ``add_argument('--flag', ...)``, or adds a field to a config dataclass
that Megatron's ``ArgumentGroupFactory`` turns into ``--flag``. What each flag does and its default
come from the argparse actions of Megatron's real parser (the one ``--help`` prints), so the
listing cannot drift from the flags; a test holds it to the flags the materialized parser has and
the pristine release's parser lacks. The training entry (hfsdp/training/entry.py) uses
:func:`fork_flag_names` to point a bad value of one of these flags here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from hfsdp.usererror import UserError, run_cli

_OPTION = re.compile(r"""['"](--[a-z0-9][a-z0-9-]*)['"]""")
_FIELD = re.compile(r"^\+\s{4}([a-z_][a-z0-9_]*)\s*:\s*[^=()]+=")  # a dataclass field added to a config class
_FILE = re.compile(r"^diff --git a/(\S+) ")
FIX = "run `scripts/patchset materialize` (or `pip install -e .`) to build the megatron tree with its stamp"


def added_flags(patch_texts: Iterable[str]) -> set[str]:
    """The option strings the patches add (see the note): quoted ``--flag`` literals on added lines,
    and ``--field-name`` for each field added to a ``*config.py`` dataclass."""
    found: set[str] = set()
    for text in patch_texts:
        path = ""
        for line in text.splitlines():
            if m := _FILE.match(line):
                path = m.group(1)
            if not line.startswith("+") or line.startswith("+++"):
                continue
            found.update(_OPTION.findall(line))
            if path.endswith("config.py") and (m := _FIELD.match(line)):
                found.add("--" + m.group(1).replace("_", "-"))
    return found


def stamp_patch_texts() -> dict[str, str]:
    """The texts of the patches applied to the imported ``megatron`` tree (its stamp)."""
    import megatron.core.fork_info as fork_info
    from hfsdp.patchset.scan import STAMP_NAME
    from hfsdp.patchset.stamp import read_stamp_file

    path = Path(fork_info.__file__).resolve().parents[1] / STAMP_NAME
    stamp = read_stamp_file(path)
    if stamp is None or stamp.texts is None:
        raise UserError(f"{path} is missing or records no patch texts, so the fork's flags cannot be told", FIX)
    return stamp.texts


def fork_flag_names() -> set[str]:
    """Every option string of the fork's flags (see the note)."""
    return added_flags(stamp_patch_texts().values())


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
            from megatron.training.arguments import add_megatron_arguments

            parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))  # what --help lists
            names = fork_flag_names()
        lines = listing(parser, names)
        print("The fork's flags (on top of every Megatron flag; `python pretrain_gpt.py --help` lists all):")
        print("\n".join(lines))
        return 0

    return run_cli("hfsdp.flags", run)


if __name__ == "__main__":
    sys.exit(main())
