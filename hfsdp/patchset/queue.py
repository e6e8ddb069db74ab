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

A killed run loses nothing: ``queue --dir`` works in its scratch folder (locked while it runs; the
next ``queue --dir`` beside it deletes one that nobody holds), and ``--continue``, which works in
DIR itself, records before each patch which patches are left and the commit they go onto; the next
``--continue`` goes on from there (or says how to drop the half-applied patch first), and ``export``
refuses the queue until then.

The state file also records the series and the overlay the queue was made from; ``export`` refuses
to write over patch or overlay files that changed after that (a pull, an edit), which it would
otherwise undo.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hfsdp.atomic import loads_strict, write_json_atomic
from hfsdp.usererror import UserError, output_folder, quoted

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
    pending: list[str] = field(default_factory=list)  # patches after stopped_at (or still to apply), in order
    texts: dict[str, str] = field(default_factory=dict)  # texts of stopped_at + pending
    resume_at: str | None = None  # `--continue` under way: HEAD on which pending[0] is being applied


class QueueStopped(PatchsetError):
    """The queue was made up to a patch that does not apply; the user finishes it by hand."""


def state_path(repo: Path) -> Path:
    return repo / ".git" / STATE_FILE


def require_queue_folder(dest: Path, option: str) -> None:
    """Refuse ``dest`` (given with ``option``) unless it is a git repository's folder, saying what it is."""
    if (dest / ".git").is_dir():
        return
    what = ("does not exist" if not os.path.lexists(dest) else "is not a folder" if not dest.is_dir()
            else "is not a git repository (no .git folder)")
    raise PatchsetError(f"{option} {dest}: it {what}, so it is not a patch queue",
                        "pass the folder that `scripts/patchset queue --dir DIR` made (its message names it), or "
                        "make a queue that way (DIR: a new folder)")


def read_state(repo: Path) -> QueueState | None:
    """The queue's state, or None for a queue without one (a clone, or made by an older tool). One that is not
    of the shape this tool writes is refused (never a traceback, never acted on)."""
    path = state_path(repo)
    if not path.is_file():
        return None
    try:
        state = QueueState(**loads_strict(path.read_text(encoding="utf-8")))
        if why := _state_problem(state):
            raise ValueError(why)
        return state
    except (ValueError, TypeError) as exc:
        raise PatchsetError(f"{path} is not a queue state this tool wrote: {exc}",
                            "make a new queue: `scripts/patchset queue --dir DIR` (DIR: a new folder)") from exc


def _state_problem(state: QueueState) -> str | None:
    """Why ``state`` is not one this tool writes, or None."""
    def pairs(value: object) -> bool:
        return isinstance(value, list) and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in value)

    def text(value: object) -> bool:
        return value is None or isinstance(value, str)

    if not pairs(state.series) or not (state.overlay is None or pairs(state.overlay)):
        return "'series' and 'overlay' must be lists of [name, sha256]"
    if not (text(state.stopped_at) and text(state.head_at_stop) and text(state.resume_at)):
        return "'stopped_at', 'head_at_stop' and 'resume_at' must be text or null"
    if not (isinstance(state.pending, list) and all(isinstance(n, str) for n in state.pending)
            and isinstance(state.texts, dict) and all(isinstance(v, str) for v in state.texts.values())):
        return "'pending' must be a list of patch names and 'texts' map them to text"
    left = [n for n in [state.stopped_at, *state.pending] if n is not None]
    if any(n not in state.texts for n in left):
        return "'texts' lacks a patch it is to apply"
    if state.pending and state.stopped_at is None and state.resume_at is None:
        return "patches are left to apply, but neither where it stopped nor where to go on is recorded"
    return None


def _write_state(repo: Path, state: QueueState) -> None:
    write_json_atomic(state_path(repo), asdict(state))


def _commit_patch(repo: Path, patch: Patch) -> str:
    return gitops.commit_all(repo, f"{patch.stem}\n\n{patch.header_text.rstrip(chr(10))}\n")


def _apply_from(repo: Path, patches: list[Patch], state: QueueState, queue: Queue, dest: Path,
                journal: bool = False) -> None:
    """Apply ``patches`` as commits; stop (state written, QueueStopped raised) at one that does not apply.
    ``journal`` (in the user's queue, not a scratch one): before each patch the state records it and the commit
    it goes onto, so a run killed at any moment is resumed by the next ``--continue`` (see the note)."""
    for index, patch in enumerate(patches):
        if journal:
            state.pending, state.texts = [p.name for p in patches[index:]], {p.name: p.text for p in patches[index:]}
            state.resume_at = gitops.git(["rev-parse", "HEAD"], cwd=repo).stdout.strip()
            _write_state(repo, state)
        try:
            gitops.apply_patch(repo, patch.name, patch.diff)
        except PatchDoesNotApply as exc:
            if exc.line_endings:
                raise  # no hand-made fix of its hunks helps; the patch file is fixed instead
            head = gitops.git(["rev-parse", "HEAD"], cwd=repo).stdout.strip()
            state.stopped_at, state.head_at_stop, state.resume_at = patch.name, head, None
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
                f"`scripts/patchset queue --continue --dir {quoted(dest)}`; when it completes, "
                f"`scripts/patchset export --queue {quoted(dest)}`",
            ) from None
        queue.commits.append((patch.name, _commit_patch(repo, patch)))
    if journal:
        state.pending, state.texts, state.resume_at = [], {}, None
        _write_state(repo, state)


def _resume(dest: Path, state: QueueState) -> Queue:
    """Go on with a ``--continue`` that was killed while applying ``state.pending`` (see the note)."""
    name, rerun = state.pending[0], f"`scripts/patchset queue --continue --dir {quoted(dest)}`"
    head = gitops.git(["rev-parse", "HEAD"], cwd=dest).stdout.strip()
    if head != state.resume_at:
        parent = gitops.git(["rev-parse", "--verify", "-q", f"{head}^"], cwd=dest, check=False).stdout.strip()
        subject = gitops.message(dest, head).partition("\n")[0].strip()
        if parent != state.resume_at or subject != name.removesuffix(".patch"):
            raise PatchsetError(
                f"queue {dest}: a `queue --continue` was killed while applying {name}, and HEAD has moved since "
                f"(it was {str(state.resume_at)[:12]}), so where to go on cannot be told; nothing was changed",
                f"put HEAD back (`git -C {quoted(dest)} reset --hard {state.resume_at}`), then {rerun}; or make a new "
                "queue: `scripts/patchset queue --dir DIR` (DIR: a new folder)")
        state.pending, state.resume_at = state.pending[1:], head  # it was committed; the state did not catch up
        state.texts.pop(name, None)
    elif not gitops.is_clean(dest, untracked=False):
        raise PatchsetError(
            f"queue {dest}: a `queue --continue` was killed while applying {name}; the work tree has that patch's "
            "changes, in part or whole, uncommitted (your fix of the patch before it is committed); nothing was "
            "changed",
            f"drop them, `git -C {quoted(dest)} reset -q --hard` (they are applied again), then {rerun}")
    patches = [parse_patch(n, state.texts[n], dest / n) for n in state.pending]
    queue = Queue(dest, gitops.git(["rev-parse", BASE_TAG], cwd=dest).stdout.strip())
    _apply_from(dest, patches, state, queue, dest, journal=True)
    return queue


def _scratch_prefix(dest: Path) -> str:
    return f".{dest.name}.patchset-tmp-"


def _remove_dead_scratch(dest: Path, log: Callable[[str], None]) -> None:
    """Delete the scratch folders of killed ``queue --dir DEST`` runs beside ``dest``: a live run holds a lock
    on its own (see :func:`_new_scratch`, which calls this), so one that can be locked has no owner; a copy
    only, never a queue."""
    for path in sorted(dest.parent.glob(_scratch_prefix(dest) + "*")):
        if path.is_symlink() or not path.is_dir():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a queue being made right now
        else:
            shutil.rmtree(path, ignore_errors=True)
            log(f"patchset: removed {path}, left by a killed `scripts/patchset queue`")
        finally:
            os.close(fd)


def _new_scratch(dest: Path, log: Callable[[str], None]) -> tuple[Path, int]:
    """A new scratch folder beside ``dest`` and a descriptor holding its lock, the dead ones removed first. This
    is done under a lock on the folder beside ``dest``, which every run takes for it: another run cleaning up
    never finds a scratch folder that is made but not locked yet (and deletes it as left over)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    beside = os.open(dest.parent, os.O_RDONLY)
    try:
        fcntl.flock(beside, fcntl.LOCK_EX)
        _remove_dead_scratch(dest, log)
        scratch = Path(tempfile.mkdtemp(prefix=_scratch_prefix(dest), dir=dest.parent))
        held = os.open(scratch, os.O_RDONLY)  # held until the end: a later run knows this scratch is not left over
        fcntl.flock(held, fcntl.LOCK_EX)
        return scratch, held
    finally:
        os.close(beside)  # releases the lock on the folder beside dest


def make_queue(project: Project, dest: Path, sdist: Path | None = None, log: Callable[[str], None] = print) -> Queue:
    """gbp-pq import: base + one commit per patch at ``dest`` (see the note)."""
    dest = dest.absolute()
    if os.path.lexists(dest) and (dest.is_symlink() or not dest.is_dir() or any(dest.iterdir())):
        what = ("a symbolic link" if dest.is_symlink() else "a file" if not dest.is_dir()
                else "a folder that is not empty")
        raise PatchsetError(f"--dir {dest} exists and is {what}; the queue goes in a new (or empty) folder",
                            "pick a new folder for the queue")
    fix = "pick a new folder for the queue, in a place you can write to"
    try:
        output_folder("--dir", dest)
    except UserError as exc:
        raise PatchsetError(exc.cause, fix) from None
    if dest.is_dir() and not os.access(dest.parent, os.W_OK | os.X_OK):  # replaced from beside it (the note)
        raise PatchsetError(f"--dir {dest}: {dest.parent} is not writable, and the queue replaces the empty "
                            "folder from there", fix)
    if project.root.resolve() in dest.resolve().parents:
        beside = project.root.parent / f"{project.root.name}-queue"
        raise PatchsetError(f"{dest} is inside the checkout {project.root}",
                            f"make the queue outside the checkout, e.g. "
                            f"`scripts/patchset queue --dir {quoted(beside)}`")
    pin = project.pin()
    patches = project.series()
    overlay = project.overlay()
    source = locate_sdist(pin, sdist)
    try:
        scratch, held = _new_scratch(dest, log)
    except OSError as exc:
        raise PatchsetError(f"--dir {dest}: cannot make a folder beside it ({exc.strerror}: {exc.filename}); "
                            "nothing was written", "pick a new folder in a place you can write") from exc
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
        os.close(held)
    if stopped is not None:
        raise stopped
    return queue


def continue_queue(project: Project, dest: Path) -> Queue:
    """Commit the fixed stopped patch and apply the rest (see the note)."""
    dest = dest.absolute()
    require_queue_folder(dest, "queue --continue --dir")
    state = read_state(dest)
    if state is None:
        raise PatchsetError(f"{dest} is a git repository without the state of a queue made by scripts/patchset, so "
                            "where it stopped is not known; there is nothing to continue",
                            "make a queue: `scripts/patchset queue --dir DIR` (DIR: a new folder)")
    if state.stopped_at is None and state.pending:
        return _resume(dest, state)
    if state.stopped_at is None:
        raise PatchsetError(f"the queue {dest} is not stopped at a patch: every patch is applied, so there is "
                            "nothing to continue", f"export it: `scripts/patchset export --queue {quoted(dest)}`")
    rejects = sorted(str(p.relative_to(dest)) for p in dest.rglob("*.rej") if ".git" not in p.parts)
    if rejects:
        raise PatchsetError(f"{dest} still has rejected hunks: {', '.join(rejects)}",
                            f"apply each by hand, delete the .rej files, then run "
                            f"`scripts/patchset queue --continue --dir {quoted(dest)}` again")
    patches = [parse_patch(n, state.texts[n], dest / n) for n in [state.stopped_at, *state.pending]]
    head = gitops.git(["rev-parse", "HEAD"], cwd=dest).stdout.strip()
    if head == state.head_at_stop and gitops.is_clean(dest):
        raise PatchsetError(f"{dest} has no changes for {state.stopped_at}; there is nothing to commit as that patch",
                            f"apply its rejected hunks by hand in {dest}, then run "
                            f"`scripts/patchset queue --continue --dir {quoted(dest)}` again")
    queue = Queue(dest, gitops.git(["rev-parse", BASE_TAG], cwd=dest).stdout.strip())
    if head == state.head_at_stop:  # else the user committed the fix themselves
        _commit_patch(dest, patches[0])
    state.stopped_at, state.head_at_stop = None, None
    _apply_from(dest, patches[1:], state, queue, dest, journal=True)
    return queue
