"""``queue``: the overlay and the series as a git repository (gbp-pq import), for editing: the base
commit (tag ``patchset/base``), the overlay commit (subject ``overlay``: it adds the overlay's files,
[Note: the queue] in tree.py), then one commit per patch.

[Note: a queue that stops] ``queue --dir DIR`` builds the queue in a temporary folder beside
DIR and renames it into place, so DIR is either complete or absent. When a patch does not
apply (the situation in which ``materialize`` suggests a queue), the queue does not fail
halfway: it stops at that patch like ``git am`` does, with the hunks that fit applied and the
others in ``<file>.rej``, and records where it stopped in ``DIR/.git/patchset-queue.json``.
``queue --continue --dir DIR`` commits the fixed files as that patch and applies the rest,
stopping again at the next patch that does not apply. ``export`` refuses a stopped queue.

The state file also records the series and the overlay the queue was made from; ``export`` refuses
to write over patch or overlay files that changed after that (a pull, an edit), which it would
otherwise undo.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hfsdp.atomic import write_json_atomic

from . import gitops
from .errors import PatchDoesNotApply, PatchsetError
from .project import Project
from .series import Patch, parse_patch
from .source import locate_sdist
from .tree import Queue, start_queue

STATE_FILE = "patchset-queue.json"
BASE_TAG = "patchset/base"


@dataclass
class QueueState:
    """Kept in ``DIR/.git``: the series the queue was made from, and where it stopped, if it did."""

    series: list[list[str]]  # [name, sha256] of each patch file the queue was made from
    overlay: list[list[str]] | None = None  # [path, sha256] of each overlay file (None: made by an older tool)
    stopped_at: str | None = None
    head_at_stop: str | None = None  # HEAD when it stopped (the commit before the stopped patch)
    pending: list[str] = field(default_factory=list)  # patches after stopped_at, in order
    texts: dict[str, str] = field(default_factory=dict)  # texts of stopped_at + pending


class QueueStopped(PatchsetError):
    """The queue was made up to a patch that does not apply; the user finishes it by hand."""


def state_path(repo: Path) -> Path:
    return repo / ".git" / STATE_FILE


def read_state(repo: Path) -> QueueState | None:
    """The queue's state, or None for a queue without one (a clone, or made by an older tool)."""
    path = state_path(repo)
    if not path.is_file():
        return None
    try:
        return QueueState(**json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as exc:
        raise PatchsetError(f"{path} is not a queue state this tool wrote: {exc}",
                            "make a new queue: `scripts/patchset queue --dir DIR` (DIR: a new folder)") from exc


def _write_state(repo: Path, state: QueueState) -> None:
    write_json_atomic(state_path(repo), asdict(state))


def _commit_patch(repo: Path, patch: Patch) -> str:
    return gitops.commit_all(repo, f"{patch.stem}\n\n{patch.header_text.rstrip(chr(10))}\n")


def _apply_from(repo: Path, patches: list[Patch], state: QueueState, queue: Queue, dest: Path) -> None:
    """Apply ``patches`` as commits; stop (state written, QueueStopped raised) at one that does not apply."""
    for index, patch in enumerate(patches):
        try:
            gitops.apply_patch(repo, patch.name, patch.diff)
        except PatchDoesNotApply as exc:
            head = gitops.git(["rev-parse", "HEAD"], cwd=repo).stdout.strip()
            state.stopped_at, state.head_at_stop = patch.name, head
            state.pending = [p.name for p in patches[index + 1:]]
            state.texts = {p.name: p.text for p in patches[index:]}
            report = gitops.apply_with_rejects(repo, patch.diff)
            _write_state(repo, state)
            rejects = sorted(str(p.relative_to(repo)) for p in repo.rglob("*.rej") if ".git" not in p.parts)
            raise QueueStopped(
                f"queue {dest}: {patch.name} does not apply to the patches before it (file: "
                f"{', '.join(exc.files) or 'see below'}); the queue stops there with the hunks that fit applied"
                + (f" and the others in {', '.join(rejects)}" if rejects else "") + f".\n{report.strip()}",
                f"in {dest}, apply the rejected hunks by hand and delete the *.rej files, then "
                f"`scripts/patchset queue --continue --dir {dest}`; when it completes, "
                f"`scripts/patchset export --queue {dest}`",
            ) from None
        queue.commits.append((patch.name, _commit_patch(repo, patch)))


def make_queue(project: Project, dest: Path, sdist: Path | None = None) -> Queue:
    """gbp-pq import: base + one commit per patch at ``dest`` (see the note)."""
    dest = dest.absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise PatchsetError(f"{dest} exists and is not an empty folder", "pick a new folder for the queue")
    if project.root.resolve() in dest.resolve().parents:
        raise PatchsetError(f"{dest} is inside the checkout {project.root}",
                            "make the queue outside the checkout, e.g. "
                            f"`scripts/patchset queue --dir {project.root.parent / (project.root.name + '-queue')}`")
    pin = project.pin()
    patches = project.series()
    overlay = project.overlay()
    source = locate_sdist(pin, sdist)
    dest.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{dest.name}.patchset-tmp-", dir=dest.parent))
    repo = scratch / "queue"
    stopped: QueueStopped | None = None
    try:
        repo.mkdir()
        started = start_queue(pin, source, overlay, repo)
        queue = Queue(dest, started.base, started.overlay)
        gitops.git(["tag", BASE_TAG, queue.base], cwd=repo)
        state = QueueState(series=[[p.name, p.sha256] for p in patches],
                           overlay=[[path, digest] for path, digest in overlay.digests()])
        _write_state(repo, state)
        try:
            _apply_from(repo, patches, state, queue, dest)
        except QueueStopped as exc:
            stopped = exc
        if dest.exists():
            dest.rmdir()  # empty (checked above); rename needs the name free
        os.rename(repo, dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if stopped is not None:
        raise stopped
    return queue


def continue_queue(project: Project, dest: Path) -> Queue:
    """Commit the fixed stopped patch and apply the rest (see the note)."""
    dest = dest.absolute()
    state = read_state(dest) if (dest / ".git").is_dir() else None
    if state is None or state.stopped_at is None:
        raise PatchsetError(f"{dest} is not a queue stopped at a patch; there is nothing to continue",
                            f"export it with `scripts/patchset export --queue {dest}`, or make a queue with "
                            "`scripts/patchset queue --dir DIR`")
    rejects = sorted(str(p.relative_to(dest)) for p in dest.rglob("*.rej") if ".git" not in p.parts)
    if rejects:
        raise PatchsetError(f"{dest} still has rejected hunks: {', '.join(rejects)}",
                            f"apply each by hand, delete the .rej files, then run "
                            f"`scripts/patchset queue --continue --dir {dest}` again")
    patches = [parse_patch(n, state.texts[n], dest / n) for n in [state.stopped_at, *state.pending]]
    head = gitops.git(["rev-parse", "HEAD"], cwd=dest).stdout.strip()
    if head == state.head_at_stop and gitops.is_clean(dest):
        raise PatchsetError(f"{dest} has no changes for {state.stopped_at}; there is nothing to commit as that patch",
                            f"apply its rejected hunks by hand in {dest}, then run "
                            f"`scripts/patchset queue --continue --dir {dest}` again")
    queue = Queue(dest, gitops.git(["rev-parse", BASE_TAG], cwd=dest).stdout.strip())
    if head == state.head_at_stop:  # else the user committed the fix themselves
        _commit_patch(dest, patches[0])
    rest = patches[1:]
    state.stopped_at, state.head_at_stop, state.pending, state.texts = None, None, [], {}
    _write_state(dest, state)
    _apply_from(dest, rest, state, queue, dest)
    return queue
