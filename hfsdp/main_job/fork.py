"""The fork report ``scripts/run_main.sh`` prints first: which megatron-core, how many files and
patches of ours, and whether ``megatron/`` is materialized, stamped and unedited."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from hfsdp.main_job.logs import REPO_ROOT


def fork_report(root: Path = REPO_ROOT) -> tuple[int, list[str]]:
    """(exit status of ``scripts/patchset status``, what to print): two lines when the fork is
    materialized, stamped and unedited, else the tool's own full report with its advice."""
    from hfsdp.patchset import cli as patchset_cli
    from hfsdp.patchset.materialize import tree_status
    from hfsdp.patchset.project import Project

    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        rc = patchset_cli.main(["--root", str(root), "status"])
    if rc != 0:
        return rc, text.getvalue().splitlines()
    project = Project(root).with_base(None)  # the base status reported on (HFSDP_BASE, else the default)
    pin, st = project.pin(), tree_status(project)
    state = "up to date" if st.up_to_date else "STALE (`scripts/patchset materialize` rebuilds it)"
    edits = f"{len(st.edits)} local edit(s)" if st.edits else "no local edits"
    return 0, [f"fork {pin.fork_version}: {pin.distribution} {pin.version} + {st.overlay_files} files of "
               f"our own (patches/overlay/) + {len(st.applied)} patches (patches/series).",
               f"Its stamp is {state} and megatron/ has {edits}; `scripts/patchset status` lists "
               "each patch."]


def print_fork(root: Path = REPO_ROOT) -> int:
    """Print :func:`fork_report`; returns its exit status."""
    rc, lines = fork_report(root)
    print("\n".join(lines), flush=True)
    return rc
