"""Ctrl-C or SIGTERM of the functional driver: its runs are ended first, then one sentence.

[Note: interrupting the driver] ``run_case`` starts torchrun in a session of its own
(hfsdp/proc.py), so neither a Ctrl-C in the terminal nor a SIGTERM (``timeout``, ``scancel``)
reaches the run's processes; and Python ends on SIGTERM without unwinding, which left torchrun and
its ranks running after the driver was gone. Under :func:`run_interruptible` both signals raise
:class:`hfsdp.proc.Interrupted` where the driver waits: ``run_group`` ends the run's process group on the way
out, and the driver prints ``<prog>: interrupted by SIGINT; <what became of the work>`` and exits
with 128 + the signal's number (130, 143), without a traceback. Once one signal arrived, further
ones are ignored, so that ending the run is not cut short. ``batch`` ends the ``run_case``
processes it started the same way (SIGTERM, then a wait) and starts no further case.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from hfsdp.proc import Interrupted, signals_interrupt


def run_interruptible(prog: str, main: Callable[[], int], after: Callable[[], str]) -> int:
    """``main()``, with SIGINT and SIGTERM raising :class:`~hfsdp.proc.Interrupted` (see the note);
    on one, print ``<prog>: interrupted by <signal>; <after()>`` and return 128 + the signal's number."""
    try:
        with signals_interrupt():
            return main()
    except Interrupted as exc:
        print(f"{prog}: interrupted by {exc.name}; {after()}", file=sys.stderr, flush=True)
        return 128 + exc.signum
