"""Which Python runs the project's tools: the environment the set-up made, said in one sentence when it is another.

[Note: the project's environment] The README's two set-up commands (``bash scripts/run_main.sh``,
``bash scripts/run_tests.sh``) make ``.venv/`` in the checkout, with torch and the fork installed;
every command the README shows runs in it (``. .venv/bin/activate`` first, or ``.venv/bin/python``).
A tool started by another Python (the system's ``python3``, a fresh virtual environment) would end
in an ImportError deep in its imports; instead each entry point calls :func:`require_environment`
before its first import that needs torch, and a Python that is older than 3.12 or cannot import
torch is one sentence naming that Python and the way into the project's environment, exit status 2.
Where torch is importable the check costs one ``find_spec``, no import.

Standard library only, and syntax every Python 3 parses: it must run under the wrong Python.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys

MIN_PYTHON = (3, 12)
NEEDED = ("torch",)  # what the set-up installs and our tools import first
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(REPO_ROOT, ".venv")


def environment_problem() -> str | None:
    """Why this Python is not one the project's tools run in (None when it is)."""
    if sys.version_info < MIN_PYTHON:
        return f"this Python ({sys.executable}, {sys.version.split()[0]}) is older than 3.12"
    for name in NEEDED:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"this Python ({sys.executable}) cannot import {name}"
    return None


def way_in() -> str:
    """How to enter the project's environment, with this checkout's paths (quoted for a shell)."""
    venv = os.path.relpath(VENV)
    venv = VENV if venv.startswith("..") else venv  # a short path from inside the checkout only
    activate = shlex.quote(os.path.join(venv, "bin", "activate"))
    python = shlex.quote(os.path.join(venv, "bin", "python"))
    if not os.path.isfile(os.path.join(VENV, "bin", "python")):
        return (f"make it with the README's set-up commands (scripts/run_tests.sh makes {venv}), then enter it with "
                f"`. {activate}` or start the command with `{python}`")
    return (f"run it in the project's environment: `. {activate}` first, or start it with `{python}`; in an "
            "environment of your own, install torch and then this checkout (README, Set-up)")


def require_environment(prog: str) -> None:
    """Exit with status 2 and one sentence (see the note) unless this Python runs the project's tools."""
    problem = environment_problem()
    if problem is None:
        return
    print(f"{prog}: error: {problem}, so it is not the project's environment\n  -> {way_in()}",
          file=sys.stderr, flush=True)
    sys.exit(2)
