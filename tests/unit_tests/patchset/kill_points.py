"""Run ``scripts/patchset`` and SIGKILL it (or Ctrl-C it) at its N-th step that changes something.

``python kill_points.py ARGS...`` runs ``hfsdp.patchset.cli.main(ARGS)``. Every call that writes,
renames, deletes or runs a program (``os.rename``/``replace``/``unlink``/``rmdir``/``mkdir``/``symlink``,
``os.fsync``, ``shutil.rmtree``/``copytree``/``copy2``, ``Path.write_text``/``write_bytes``,
``subprocess.run``) is a step. Right before step ``PATCHSET_KILL_AT`` (0: never) the process kills
itself with SIGKILL, as ``kill -9`` at that moment would: none of the tool's own cleanup
(``finally``, ``except``) runs, exactly what a killed run leaves. Right before step
``PATCHSET_INTERRUPT_AT`` it raises KeyboardInterrupt instead, as Ctrl-C would. With
``PATCHSET_KILL_TRACE`` set, one line per step is written there: its number, what it calls, and on
what (to pick kill points from).
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

_steps = 0
_KILL_AT = int(os.environ.get("PATCHSET_KILL_AT", "0"))
_INTERRUPT_AT = int(os.environ.get("PATCHSET_INTERRUPT_AT", "0"))


_TRACE = os.environ.get("PATCHSET_KILL_TRACE")  # a file: one line per step (its call), to see where they are


def _step(name: str, args: tuple[Any, ...], cwd: object = None) -> None:
    global _steps
    _steps += 1
    if _TRACE:
        with open(_TRACE, "a") as out:  # not counted: plain open()
            where = " ".join(str(a) for a in args[:1 if name.startswith("write_") else 2]).replace("\n", " ")
            where += f" (in {cwd})" if cwd is not None else ""
            out.write(f"{_steps} {name} {where}\n")
    if _steps == _KILL_AT:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if _steps == _INTERRUPT_AT:
        raise KeyboardInterrupt  # what Ctrl-C raises at that moment


def _counted(owner: Any, name: str) -> None:
    real: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _step(name, args, kwargs.get("cwd"))
        return real(*args, **kwargs)

    setattr(owner, name, wrapper)


def arm() -> None:
    for name in ("rename", "replace", "unlink", "rmdir", "mkdir", "symlink", "fsync"):
        _counted(os, name)
    for name in ("rmtree", "copytree", "copy2"):
        _counted(shutil, name)
    for name in ("write_text", "write_bytes"):
        _counted(pathlib.Path, name)
    _counted(subprocess, "run")


def main() -> int:
    arm()
    from hfsdp.patchset.cli import main as cli

    return cli(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
