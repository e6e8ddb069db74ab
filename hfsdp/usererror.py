"""Bad input is a sentence, not a traceback: one error type and one reporting rule for our CLIs.

[Note: user errors] Every command line tool of this project (``scripts/patchset``, the
functional driver, the SLURM submitter and summary, the memory planner, the benchmark runner
and the ``pretrain_*.py`` entry points) raises :class:`UserError` for input it refuses. The
error carries the cause and the way out; :func:`run_cli` prints them as

    <prog>: error: <cause>
      -> <way out>

and exits with status 2. A traceback is printed only with ``HFSDP_DEBUG=1`` (one convention
for every tool, including inside ``pip install -e .`` and under ``torchrun``). Anything that
is not a ``UserError`` is a bug and keeps its traceback.

[Note: closed pipe and Ctrl-C] :func:`run_cli` also ends a tool the way standard tools end:
output into a pipe whose reader has gone (``planner | head -1``) stops the tool quietly with
status 141 (128 + SIGPIPE, what a shell reports for ``seq 100000 | head -1``: coreutils die of
SIGPIPE, which Python ignores and turns into ``BrokenPipeError``); stdout is pointed at
``/dev/null`` first, as Python's documentation on SIGPIPE advises, so that the flush at exit
does not fail once more. Each tool parses its arguments inside ``run_cli``, so ``--help | head``
is covered too.

[Note: interrupts] While ``run_cli`` runs a tool (in the main thread), SIGINT and SIGTERM raise
:class:`Interrupted` where the tool is, instead of Python's KeyboardInterrupt or its silent death
on SIGTERM. Our launchers start torchrun in a session of its own (hfsdp/proc.py), so neither a
Ctrl-C in the terminal nor a SIGTERM (``timeout``, ``scancel``, a Slurm time limit) reaches the
run's processes: the exception unwinds through :func:`hfsdp.proc.run_group`, which ends its run
on the way out, and through every ``finally`` of a writer. Then one line,
``<prog>: interrupted by SIGTERM; <what became of the work>``, and exit status 128 + the signal's
number (130, 143). Once one signal arrived, further ones are ignored, so that ending the run is
not cut short. A KeyboardInterrupt raised otherwise reads ``<prog>: interrupted`` (130). Neither
prints a traceback unless ``HFSDP_DEBUG=1``.

Standard library only: ``hfsdp.patchset`` runs inside pip's isolated build environment.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import stat
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

DEBUG_ENV = "HFSDP_DEBUG"
EXIT_CODE = 2
CLOSED_PIPE_EXIT = 128 + signal.SIGPIPE  # 141 (see the note)
INTERRUPTED_EXIT = 128 + signal.SIGINT  # 130


class UserError(Exception):
    """Input the tool refuses: ``cause`` says what is wrong, ``fix`` what to do about it."""

    exit_code = EXIT_CODE

    def __init__(self, cause: str, fix: str) -> None:
        assert cause and fix, f"a user error needs a cause and a way out, got {cause!r} / {fix!r}"
        self.cause = cause
        self.fix = fix
        super().__init__(f"{cause}\n  -> {fix}")


def positive(kind: type = int, *, zero: bool = False) -> Callable[[str], object]:
    """argparse ``type=``: a number of ``kind`` that is > 0 (>= 0 with ``zero``; argparse then says
    which option is wrong). NaN and infinities are refused: no count or size is either."""
    import argparse
    import math

    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if not math.isfinite(value) or not (value >= 0 if zero else value > 0):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero else '> 0'}, got {text}")
        return value

    parse.__name__ = f"{'non-negative' if zero else 'positive'} {kind.__name__}"
    return parse


def comma_choices(option: str, values: str | Sequence[str], allowed: Sequence[str], noun: str,
                  once: str | None = None) -> list[str]:
    """The names ``option`` gives as a comma-separated list (a repeated option's values joined),
    stripped, in order. No name, a name not in ``allowed`` or a name given twice is a UserError
    naming the option and, as the way out, the choices (``once``: the fix for a repeat)."""
    names = [n.strip() for text in ([values] if isinstance(values, str) else values) for n in text.split(",")]
    names = [n for n in names if n]
    choices = ", ".join(allowed)
    if not names:
        raise UserError(f"{option} names no {noun}", f"name one or more of {choices}")
    if unknown := [n for n in names if n not in allowed]:
        raise UserError(f"{option} names {', '.join(map(repr, unknown))}, not a {noun}", f"use {choices}")
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise UserError(f"{option} names {', '.join(twice)} more than once", once or f"name each {noun} once")
    return names


def env_number(name: str, default: float | int | None, *, kind: type = int, zero: bool = False,
               environ: Mapping[str, str] | None = None, unset_means: str | None = None) -> Any:
    """The number in environment variable ``name`` (``default`` when unset or empty), held to
    :func:`positive`'s rule; a bad value is a :class:`UserError` naming the variable and what
    unsetting it gives (``unset_means``, else the default)."""
    import argparse

    text = (os.environ if environ is None else environ).get(name, "")
    if not text.strip():
        return default
    try:
        return positive(kind, zero=zero)(text.strip())
    except argparse.ArgumentTypeError as exc:
        unset = unset_means or f"the default ({default})"
        raise UserError(f"{name}={text!r}: {exc}", f"set {name} to a {'whole ' if kind is int else ''}number "
                        f"{'>= 0' if zero else '> 0'}, or unset it for {unset}") from None


_ON, _OFF = ("1", "true", "yes", "on", "y", "t"), ("0", "false", "no", "off", "n", "f")


def env_flag(name: str, *, environ: Mapping[str, str] | None = None, unset_means: str = "off") -> bool:
    """Whether environment variable ``name`` is on: 1/true/yes/on or 0/false/no/off, in any case (y, t, n, f
    too, as pip reads its own PIP_* switches); unset or empty is off. Any other value is a :class:`UserError`
    naming the variable: a typo must not silently mean off."""
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if text.lower() in _ON:
        return True
    if not text or text.lower() in _OFF:
        return False
    raise UserError(f"{name}={text!r} is neither on (1, true, yes, on) nor off (0, false, no, off)",
                    f"set {name}=1 or {name}=0, or unset it ({unset_means})")


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that is there; a symbolic link to nothing counts (nothing
    can be made through it)."""
    path = path.absolute()
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def quoted(word: object) -> str:
    """``word`` (a path, a name) as a shell reads it back: every command a fix suggests quotes what it
    fills in, so that it still runs from a checkout whose path holds a space."""
    return shlex.quote(str(word))


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def kind_of(path: str | Path) -> str:
    """What stands at ``path``, as a noun: "a file", "a folder", "a named pipe", "a socket", a device, "a
    symbolic link to nothing" or "nothing" (a link is followed)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a symbolic link to nothing" if os.path.islink(path) else "nothing"
    except OSError as exc:
        return f"something that cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return "a file"
    return next((name for test, name in _KINDS if test(mode)), "an entry of an unknown kind")


def not_a_regular_file(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as a file, as the end of a sentence about it ("is a named pipe,
    not a regular file", "does not exist"), or None for a regular file (a link to one included).
    Every tool asks this before it reads a file a user may have replaced: opening a named pipe or
    a device blocks until something writes to it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a symbolic link to nothing" if os.path.islink(path) else "does not exist"
    except NotADirectoryError:
        return "does not exist (a file stands where a folder on its path should be)"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    what = next((name for test, name in _KINDS if test(mode)), "not a file")
    return f"is {what}, not a regular file"


def output_file(option: str, path: str | Path) -> None:
    """Refuse, before any work, a file ``option`` could not write: a folder, a path through a file,
    a folder we may not write to, or something that is no regular file (a named pipe, a device, a
    link to nothing), which the rename of a write in one step would replace. Missing folders on
    the way are fine (they are made)."""
    fix = f"give {option} a file in a folder you can write to"
    if not str(path):
        raise UserError(f"{option} is empty", fix)
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option} {path} is a folder, not a file", fix)
    if os.path.lexists(path) and (why := not_a_regular_file(path)):  # written in one step, it would be replaced
        raise UserError(f"{option} {path} {why}; writing it would put a regular file in its place", fix)
    _check_parent(option, path, path.parent, fix)


def output_folder(option: str, path: str | Path) -> None:
    """Refuse, before any work, a folder ``option`` could not make or fill (see :func:`output_file`)."""
    fix = f"give {option} a folder you can write to (it is made if missing)"
    if not str(path):
        raise UserError(f"{option} is empty", fix)
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        what = "a symbolic link to nothing" if not path.exists() else "a file"
        raise UserError(f"{option} {path} is {what}, not a folder", fix)
    _check_parent(option, path, path, fix)


def _check_parent(option: str, path: Path, folder: Path, fix: str) -> None:
    """Refuse ``path`` unless ``folder`` (where it is written), or the nearest ancestor of it that is
    there, is a folder in which a file can be made (:func:`cannot_make_file_in`)."""
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        what = "a symbolic link to nothing" if existing.is_symlink() and not existing.exists() else "a file"
        raise UserError(f"{option} {path} lies under {existing}, which is {what}", fix)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: {existing} is not writable", fix)
    if why := cannot_make_file_in(existing):
        raise UserError(f"{option} {path}: no file can be made in {existing} ({why})", fix)


def cannot_make_file_in(folder: str | Path) -> str | None:
    """Why no file can be made in ``folder`` (the system's words), or None where one can: found by
    making a temporary file there and removing it, as the final write in one step
    (:func:`hfsdp.atomic.write_text_atomic`) will. ``os.access`` alone says yes to root where
    nothing can be made (/proc, /sys, a read-only mount)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".hfsdp-probe-", suffix=".tmp", dir=folder)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(probe)
    return None


def rejection(exc: BaseException, what: str, fix: str) -> UserError:
    """A validation ``AssertionError``/``ValueError`` from code we call (Megatron's ``validate_args``)
    as a UserError: its message, or for a bare ``assert`` the line that failed."""
    text = str(exc).strip()
    if not text:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        text = f"{frame.line} ({Path(frame.filename).name}:{frame.lineno})"
    return UserError(f"{what}: {text}", fix)


def debug_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether ``HFSDP_DEBUG`` asks for tracebacks."""
    value = (os.environ if environ is None else environ).get(DEBUG_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def format_error(prog: str, exc: UserError) -> str:
    """The two lines every tool prints for a refused input."""
    return f"{prog}: error: {exc.cause}\n  -> {exc.fix}"


def report(prog: str, exc: UserError, stream: TextIO | None = None) -> int:
    """Print ``exc`` (with its traceback under ``HFSDP_DEBUG=1``); return the exit status."""
    stream = sys.stderr if stream is None else stream
    if debug_enabled():
        traceback.print_exception(exc, file=stream)
    print(format_error(prog, exc), file=stream, flush=True)
    if not debug_enabled():
        print(f"  (set {DEBUG_ENV}=1 for a traceback)", file=stream, flush=True)
    return exc.exit_code


def _flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


def _silence_closed_pipe() -> None:
    """Point stdout and stderr at /dev/null, so that nothing written later (the flush at exit
    included) meets the closed pipe again (see the note)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(devnull, stream.fileno())
            except (AttributeError, OSError, ValueError):  # not a real file (a test's capture)
                pass
    finally:
        os.close(devnull)


INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the tool (inside :func:`signals_interrupt`). A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` swallows it on the way out."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {self.name}")

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """While active, SIGINT and SIGTERM raise :class:`Interrupted` in the main thread (see the
    note). Elsewhere than in the main thread, Python's own handling stays."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        for sig in INTERRUPT_SIGNALS:  # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    saved = {sig: signal.signal(sig, stop) for sig in INTERRUPT_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def run_cli(prog: str, main: Callable[[], int | None], after: Callable[[], str] | None = None) -> int:
    """Call ``main``; a :class:`UserError` becomes the two-line message and exit status 2, a
    closed output pipe status 141, and SIGINT or SIGTERM one line (ending in ``after()``, what
    became of the work, when given) and 128 + the signal's number, each without a traceback
    (see the notes)."""

    def interrupted(what: str) -> None:
        if debug_enabled():
            traceback.print_exc()
        print(f"{prog}: {what}" + (f"; {after()}" if after is not None else ""), file=sys.stderr, flush=True)

    try:
        try:
            with signals_interrupt():
                rc = int(main() or 0)
        except UserError as exc:
            rc = report(prog, exc)
        except Interrupted as exc:
            interrupted(f"interrupted by {exc.name}")
            rc = 128 + exc.signum
        except KeyboardInterrupt:
            interrupted("interrupted")
            rc = INTERRUPTED_EXIT
        finally:
            _flush_standard_streams()  # a closed pipe shows here, not at interpreter exit
        return rc
    except BrokenPipeError:
        if debug_enabled():
            try:
                traceback.print_exc()
                sys.stderr.flush()
            except OSError:  # stderr is the closed pipe too
                pass
        _silence_closed_pipe()
        return CLOSED_PIPE_EXIT
