"""One run at a time in a case's output folder: the functional driver's lock on it.

[Note: one run per output folder] Two drivers in one case output folder clear and fill it at
once: one can print PASS on the other's metrics, or find no steps in a log the other cleared. So
a run holds a lock on its output folder from before it is cleared until its result is written,
and a second run is refused, naming the holder (pid, host, start time) and the way out.

* The lock is :mod:`hfsdp.filelock`'s ([Note: held locks]): a ``flock`` on
  ``<output folder's parent>/.<folder name>.lock``, beside the folder and not in it, since a run
  clears its folder. A holder that died holds nothing: the next run takes the lock in one step,
  and of two racing runs one gets it.
* A run takes it after the folder passed :func:`hfsdp.functional.outdir.check` (no lock file is
  made beside a folder the driver may not use) and before anything there changes; the lock is
  released when the decorated call (:func:`holding`, on ``run_case``) returns or raises.
* A COMPARE_TO twin that the run re-runs is a nested ``run_case`` call: it locks the twin's folder
  for the twin's run. A folder this process already holds is never locked a second time (that
  would refuse the run itself): a nested run into it is refused instead, since it would clear the
  outer run's outputs (a twin named like its case, or COMPARE_TO cases in a cycle).
* A case reads its twin's numbers under the twin folder's lock (:func:`reading`): a run that is
  rewriting the twin (another batch re-running it) is waited for, up to the case's timeout, and
  never read half-written; a twin still busy then is no reference, named with its holder.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from hfsdp import filelock
from hfsdp.functional import outdir
from hfsdp.usererror import UserError

_state = threading.local()  # .sessions: the ExitStacks of this thread's runs, innermost last
_held: dict[Path, str] = {}  # folders this process holds -> the case whose run holds each
_held_guard = threading.Lock()


def lock_path(out: Path) -> Path:
    """Where the lock of output folder ``out`` lives: beside it (a run clears the folder itself)."""
    folder = Path(out).resolve()  # one lock per folder, however its path is spelled
    return folder.parent / f".{folder.name}.lock"


def _sessions() -> list[contextlib.ExitStack]:
    if not hasattr(_state, "sessions"):
        _state.sessions = []
    return _state.sessions


def holding[**P, R](run: Callable[P, R]) -> Callable[P, R]:
    """Decorate a run: the locks :func:`hold` takes during a call are released when it returns or raises."""

    @functools.wraps(run)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with contextlib.ExitStack() as stack:
            _sessions().append(stack)
            try:
                return run(*args, **kwargs)
            finally:
                _sessions().pop()

    return call


def _release(key: Path) -> None:
    with _held_guard:
        _held.pop(key, None)


def _not_ours(out: Path, case: str) -> Path:
    """``out``'s key; a UserError when this same run holds it (see the note)."""
    key = Path(out).resolve()
    with _held_guard:
        outer = _held.get(key)
    if outer is not None:
        raise UserError(f"the run of {case} would write into output folder {out}, which this same run is writing "
                        f"for {outer} (a COMPARE_TO twin with its case's <model>/<case> name, or COMPARE_TO cases "
                        "that form a cycle)", "give each case of a COMPARE_TO chain a <model>/<case> name of its "
                        "own, and compare with a twin that compares with none of the cases compared with it")
    return key


def _take(stack: contextlib.ExitStack, out: Path, holder: str, wait_s: float,
          busy: Callable[[str], UserError]) -> None:
    """Take output folder ``out``'s lock into ``stack`` (waiting up to ``wait_s`` seconds); ``busy(holder)``
    is the error when another run keeps it."""
    path = lock_path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stack.enter_context(filelock.exclusive(path, filelock.holder_line(holder), wait_s=wait_s))
    except filelock.Held as held:
        raise busy(held.holder or "another run_case") from None
    except filelock.NotALockFile as exc:
        raise UserError(f"the output folder's lock {path} {exc.why}; the driver locks a file of its own there",
                        f"move {path} away (the next run makes a new one)") from None
    except OSError as exc:
        raise UserError(f"the output folder's lock {path} cannot be taken: {exc.strerror or exc}",
                        f"{outdir.FIX}, on a file system that takes file locks") from exc


def hold(out: Path, case: str) -> None:
    """Lock output folder ``out`` for ``case``'s run until the :func:`holding` call around it ends (see
    the note); a UserError names the run that holds it and the way out."""
    if not _sessions():
        raise RuntimeError("runlock.hold() called outside a @runlock.holding run")
    outdir.check(out)
    key = _not_ours(out, case)
    _take(_sessions()[-1], out, f"run_case {case}", 0.0, lambda who: UserError(
        f"output folder {out} is in use by {who}, and two runs in one folder would mix their logs and metrics",
        f"wait for that run to end (its lock {lock_path(out)} ends with its process), or give this run "
        "another --output-dir"))
    with _held_guard:
        _held[key] = case
    _sessions()[-1].callback(_release, key)


class Busy(UserError):
    """A twin folder that stayed in use while a case waited to read it."""


@contextlib.contextmanager
def reading(out: Path, case: str, wait_s: float) -> Iterator[None]:
    """Hold twin folder ``out``'s lock while ``case`` reads its numbers, waiting up to ``wait_s`` seconds
    for a run that writes there (see the note); :class:`Busy` names that run once the wait is over."""
    _not_ours(out, case)
    with contextlib.ExitStack() as stack:
        _take(stack, out, f"run_case {case} (reading its twin)", wait_s, lambda who: Busy(
            f"its folder {out} stayed in use by {who} for {wait_s:.0f} s, so its numbers may be half-written",
            "rerun this case once that run has ended"))
        yield
