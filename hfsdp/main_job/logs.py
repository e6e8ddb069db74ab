"""The main job's logs: a new folder per job, this process's stderr into it, and a failed step
on the console (its error sentence, or the end of its output, and where the rest is)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from hfsdp.usererror import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
OUT_ENV = "HFSDP_MAIN_JOB_OUT"
OUT_FIX = f"set {OUT_ENV} to a folder you can write (the job makes a new folder inside it)"
# Megatron's warnings and log lines from this process's own work (argument checks, planning).
IN_PROCESS_LOG = "main_job.log"
FAILED_TAIL_LINES = 15  # of a failed step's output, shown on the console
USER_ERROR = re.compile(r"^\S+: error: ")  # hfsdp/usererror.py: "<prog>: error: <cause>", then "  -> <fix>"


@contextlib.contextmanager
def stderr_into(path: str | os.PathLike[str]) -> Iterator[None]:
    """Inside the block, this process's stderr goes to the end of ``path``.

    What the job does in its own process (Megatron's argument checks, the planner's model build)
    makes Megatron print import warnings and log lines that say nothing to a user; they belong in
    the job's log. The redirect is of file descriptor 2, not of ``sys.stderr``, so a logging
    handler made inside the block keeps writing to the console after it."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "a") as log:
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def job_folder(kind: str, environ: Mapping[str, str] | None = None) -> Path:
    """A new folder for this job's logs under ``$HFSDP_MAIN_JOB_OUT`` (default ``out/main_job``).

    Its name is new (``<kind>-<date>-<time>-<random>``), so nothing that exists is overwritten,
    and nothing deletes it: the logs stay for the user to read.
    """
    root = Path((os.environ if environ is None else environ).get(OUT_ENV) or REPO_ROOT / "out" / "main_job")
    try:
        root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-", dir=root))
    except OSError as exc:
        raise UserError(f"cannot make the job's log folder in {root} ({exc.strerror or exc})", OUT_FIX) from exc


def shown(path: Path) -> str:
    """``path`` as the user should read it: relative to the working folder when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def failed_lines(what: str, rc: int, lines: Sequence[str], log_path: Path) -> list[str]:
    """A failed step on the console: its exit status, then the sentence a tool of ours gave for
    refused input (:mod:`hfsdp.usererror`), else the end of its output; where the rest is."""
    said = next((i for i, line in enumerate(lines) if USER_ERROR.match(line)), None)
    shown_lines = lines[said:said + 2] if said is not None else lines[-FAILED_TAIL_LINES:]
    which = "its error" if said is not None else "the last lines of its output"
    return [f"{what} failed (exit status {rc}); {which} ({shown(log_path)} has all):",
            *(f"  | {line}" for line in shown_lines)]
