"""``export``: write a queue's commits back as ``patches/`` (gbp-pq export), all or nothing.

[Note: export writes all or nothing] Everything is checked before a byte is written:

1. the queue's root commit is the pristine base, the queue is not stopped at a patch, and
   every commit subject is a unique patch name;
2. no patch file changed after the queue was made (the queue's state records the series; a
   pull or an edit since would otherwise be undone);
3. every patch of the series is in the queue, or named with ``--drop`` (a queue that lacks
   patches once made ``export`` delete them);
4. the rendered patches, applied to a fresh pristine base, give exactly the queue's tree.

Then the new ``patches/`` (series included) is built beside the old one and swapped in with the
guarded swap (swap.py). The same export is byte-identical every time, so review diffs show only
real changes.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import gitops
from .errors import PatchsetError, SeriesError
from .project import Project
from .queue import BASE_TAG, read_state
from .scan import scan
from .series import NAME_RULE, Patch, is_patch_name, parse_header, parse_patch, patch_name, render_patch
from .source import locate_sdist
from .swap import TMP_PREFIX, swap_in
from .tree import BASE_SUBJECT, build_queue, extract_base

SERIES_HEADER = (
    "# Ordered patch series applied to the pinned megatron-core sdist (patches/base.toml).\n"
    "# One file name per line; '#' starts a comment. Maintained by `scripts/patchset export`.\n"
)


def today() -> str:
    """Last-Update date; SOURCE_DATE_EPOCH makes it reproducible."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = _dt.datetime.fromtimestamp(int(epoch), _dt.UTC) if epoch else _dt.datetime.now(_dt.UTC)
    return moment.strftime("%Y-%m-%d")


@dataclass
class ExportPlan:
    """What an export will write: patch texts in series order, and the patches it removes."""

    texts: dict[str, str]  # name -> file text, in order
    dropped: list[str]
    tree: str  # the queue's HEAD tree, which the texts must reproduce

    def patches(self, patches_dir: Path) -> list[Patch]:
        return [parse_patch(name, text, patches_dir / name) for name, text in self.texts.items()]


def _queue_base(repo: Path) -> str:
    """The queue's root commit (its pristine upstream tree)."""
    if not (repo / ".git").is_dir():
        raise PatchsetError(f"{repo} is not a patch queue (no git repository there)",
                            "make one with `scripts/patchset queue --dir DIR` (DIR: a new folder)")
    roots = gitops.git(["rev-list", "--max-parents=0", "HEAD"], cwd=repo).stdout.split()
    if len(roots) != 1:
        raise PatchsetError(f"queue {repo} has {len(roots)} root commits",
                            "a queue is one linear branch on the base commit")
    return roots[0]


def _pristine_tree_id(project: Project, sdist: Path | None) -> str:
    pin = project.pin()
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        repo = Path(tmp) / "base"
        repo.mkdir()
        gitops.init_repo(repo)
        extract_base(pin, locate_sdist(pin, sdist), repo)
        gitops.commit_all(repo, BASE_SUBJECT + "\n")
        return gitops.tree_of(repo, "HEAD")


def _patch_from_commit(repo: Path, commit: str, parent: str, previous: Patch | None, changed: bool) -> tuple[str, str]:
    """(file name, file text) for one queue commit. Subject = name; body = DEP-3 header."""
    text = gitops.message(repo, commit)
    subject, _, body = text.partition("\n")
    name = subject.strip()
    if not is_patch_name(f"{name}.patch"):
        raise SeriesError(
            f"queue commit {commit[:12]} has subject {subject!r}, which is not a patch name; the subject must be "
            "the patch name. Nothing was written",
            f"reword it to a lowercase-dashed name ({NAME_RULE}; `git -C {repo} rebase -i {BASE_TAG}`, then "
            f"`reword`), then `scripts/patchset export --queue {repo}` again",
        )
    header = body.strip("\n")
    if previous is not None and not header:
        header = previous.header_text.strip("\n")
    fields = parse_header(header)
    if changed and "Last-Update" in fields:
        header = "\n".join(
            f"Last-Update: {today()}" if line.startswith("Last-Update:") else line for line in header.splitlines()
        )
    diff = gitops.diff_commits(repo, parent, commit)
    if "diff --git " not in diff:
        raise SeriesError(f"queue commit {commit[:12]} ({name}) changes nothing. Nothing was written",
                          f"drop the commit (`git -C {repo} rebase -i {BASE_TAG}`) and pass `--drop {name}.patch` "
                          "if the patch is to go")
    return f"{name}.patch", render_patch(header, diff)


def plan_export(project: Project, repo: Path, drop: tuple[str, ...] = (), sdist: Path | None = None,
                check_state: bool = True) -> ExportPlan:
    """Steps 1-3 of the note: what ``repo`` exports to; raises before anything is written."""
    drop = tuple(patch_name(name, "--drop") for name in drop)
    repo = repo.absolute()
    base = _queue_base(repo)
    state = read_state(repo) if check_state else None
    if state is not None and state.stopped_at is not None:
        raise PatchsetError(f"queue {repo} is stopped at {state.stopped_at}, which does not apply yet; "
                            "nothing was written",
                            f"finish it: apply the rejected hunks, delete the *.rej files, "
                            f"`scripts/patchset queue --continue --dir {repo}`; then export again")
    if gitops.tree_of(repo, base) != _pristine_tree_id(project, sdist):
        raise PatchsetError(
            f"the root commit of {repo} is not the pristine {project.pin().filename} tree; nothing was written",
            "build queues with `scripts/patchset queue --dir DIR` (or from a clone of one)",
        )
    old = {p.name: p for p in project.series()}
    if state is not None:
        then = {name: sha256 for name, sha256 in state.series}
        changed_since = sorted(n for n in set(then) | set(old) if then.get(n) != (old[n].sha256 if n in old else None))
        if changed_since:
            raise PatchsetError(
                f"patches changed after the queue {repo} was made ({', '.join(changed_since)}); exporting it would "
                "undo those changes, so nothing was written",
                "make a fresh queue from the current patches (`scripts/patchset queue --dir DIR`, DIR: a new "
                "folder) and redo your queue changes there",
            )
    texts: dict[str, str] = {}
    parent = base
    for commit in gitops.rev_list(repo, base):
        name_guess = gitops.message(repo, commit).partition("\n")[0].strip() + ".patch"
        previous = old.get(name_guess)
        fresh = gitops.diff_commits(repo, parent, commit).rstrip("\n")
        changed = previous is None or previous.diff.rstrip("\n") != fresh
        name, text = _patch_from_commit(repo, commit, parent, previous, changed)
        if name in texts:
            raise SeriesError(f"two queue commits are both named {name}; nothing was written",
                              "give each patch commit a unique subject")
        texts[name] = text
        parent = commit
    unknown = sorted(set(drop) - set(old))
    if unknown:
        raise SeriesError(f"--drop {', '.join(unknown)}: not in patches/series; nothing was written",
                          "name patches listed in patches/series")
    kept_but_dropped = sorted(set(drop) & set(texts))
    if kept_but_dropped:
        raise SeriesError(f"--drop {', '.join(kept_but_dropped)}: the queue still has a commit for it; "
                          "nothing was written", "remove the commit from the queue, or do not --drop it")
    missing = [n for n in old if n not in texts and n not in drop]
    if missing:
        raise SeriesError(
            f"the queue {repo} has no commit for {', '.join(missing)} (in patches/series); exporting would "
            "delete them, so nothing was written",
            "if you removed them on purpose, say so: "
            + " ".join(f"`--drop {n}`" for n in missing)
            + "; otherwise the queue is incomplete: make a new one with `scripts/patchset queue --dir DIR`",
        )
    _refuse_overwriting_unlisted(project, [n for n in texts if n not in old])
    plan = ExportPlan(texts, sorted(drop), gitops.tree_of(repo, "HEAD"))
    validate(project, plan, sdist)
    return plan


def _refuse_overwriting_unlisted(project: Project, new_names: list[str]) -> None:
    """A new patch must not take the place of a file in patches/ that the series does not list (it may be
    someone's only copy of a change)."""
    taken = [n for n in new_names if os.path.lexists(project.patches_dir / n)]
    if taken:
        raise SeriesError(
            f"{', '.join(taken)} would be written as a new patch, but patches/ already has a file of that name that "
            "is not in patches/series; nothing was written",
            "move that file out of patches/ (it may be your only copy of a change), or give the new patch another name",
        )


def validate(project: Project, plan: ExportPlan, sdist: Path | None = None) -> None:
    """Step 4: the rendered patches rebuild exactly the queue's tree from a pristine base."""
    pin = project.pin()
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        rebuilt = build_queue(pin, locate_sdist(pin, sdist), plan.patches(Path(tmp)), Path(tmp) / "check")
        got = gitops.tree_of(rebuilt.repo, "HEAD")
    if got != plan.tree:
        raise PatchsetError("the exported patches would not rebuild the queue's tree (tree "
                            f"{got[:12]} != {plan.tree[:12]}); nothing was written",
                            "this is a bug in the tool; please report it with the queue")


def write_plan(project: Project, plan: ExportPlan, rerun: str, log: Callable[[str], None]) -> None:
    """Build the new patches/ beside the old one and swap it in (guarded)."""
    target = project.patches_dir
    snapshot = scan(target, prefix="patches")
    scratch = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=project.root))
    try:
        built = scratch / "patches"
        shutil.copytree(target, built, symlinks=True)
        for name in plan.dropped:
            (built / name).unlink(missing_ok=True)
        for name, text in plan.texts.items():
            (built / name).write_text(text, encoding="utf-8")
        (built / "series").write_text(SERIES_HEADER + "".join(f"{n}\n" for n in plan.texts), encoding="utf-8")
        swap_in(target, built, snapshot, lambda d: scan(d, prefix="patches"), rerun)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for name in plan.dropped:
        log(f"patchset: removed {name} (--drop)")


def export_queue(project: Project, repo: Path, sdist: Path | None = None, drop: tuple[str, ...] = (),
                 log: Callable[[str], None] = print) -> list[str]:
    """gbp-pq export (see the note); the caller holds the checkout lock."""
    plan = plan_export(project, repo, drop, sdist)
    write_plan(project, plan, f"scripts/patchset export --queue {repo.absolute()}", log)
    log(f"patchset: exported {len(plan.texts)} patches to {project.patches_dir}")
    return list(plan.texts)
