"""Patch-queue round trips: build a queue for editing, export it back, refresh from megatron/.

``export`` is deterministic: the same queue always yields byte-identical patch files, so
review diffs show only real changes.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import tempfile
from pathlib import Path

from . import gitops
from .errors import PatchsetError, SeriesError
from .project import Project
from .series import Patch, parse_header, render_patch
from .source import locate_sdist
from .tree import BASE_SUBJECT, Queue, build_queue, extract_base, local_edits, read_stamp, write_stamp

SERIES_HEADER = (
    "# Ordered patch series applied to the pinned megatron-core sdist (patches/base.toml).\n"
    "# One file name per line; '#' starts a comment. Maintained by `scripts/patchset export`.\n"
)


def today() -> str:
    """Last-Update date; SOURCE_DATE_EPOCH makes it reproducible."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = _dt.datetime.fromtimestamp(int(epoch), _dt.UTC) if epoch else _dt.datetime.now(_dt.UTC)
    return moment.strftime("%Y-%m-%d")


def make_queue(project: Project, dest: Path, sdist: Path | None = None) -> Queue:
    """gbp-pq import: base + one commit per patch at ``dest``, for editing with plain git."""
    if dest.exists() and any(dest.iterdir()):
        raise PatchsetError(f"{dest} exists and is not empty", "pick a new folder for the queue")
    if dest.exists():
        dest.rmdir()
    pin = project.pin()
    queue = build_queue(pin, locate_sdist(pin, sdist), project.series(), dest)
    gitops.git(["tag", "patchset/base", queue.base], cwd=dest)
    return queue


def _queue_base(repo: Path) -> str:
    """The queue's root commit (its pristine upstream tree)."""
    roots = gitops.git(["rev-list", "--max-parents=0", "HEAD"], cwd=repo).stdout.split()
    if len(roots) != 1:
        raise PatchsetError(f"queue {repo} has {len(roots)} root commits", "a queue is one linear branch on the base commit")
    return roots[0]


def _pristine_tree_id(project: Project, sdist: Path | None) -> str:
    pin = project.pin()
    with tempfile.TemporaryDirectory(prefix=".patchset-tmp-", dir=project.root) as tmp:
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
    if not name or " " in name or "/" in name:
        raise SeriesError(
            f"queue commit {commit[:12]} has subject {subject!r}; the subject must be the patch name",
            "reword it to a lowercase-dashed name, e.g. `mfsdp-prefetch-gating`",
        )
    header = body.strip("\n")
    if previous is not None and not header:
        header = previous.header_text.strip("\n")
    fields = parse_header(header)
    if changed and "Last-Update" in fields:
        header = "\n".join(
            f"Last-Update: {today()}" if line.startswith("Last-Update:") else line for line in header.splitlines()
        )
    return f"{name}.patch", render_patch(header, gitops.diff_commits(repo, parent, commit))


def export_queue(project: Project, repo: Path, sdist: Path | None = None, log=print) -> list[str]:
    """gbp-pq export: rewrite patches/ and patches/series from the queue's commits."""
    base = _queue_base(repo)
    if gitops.tree_of(repo, base) != _pristine_tree_id(project, sdist):
        raise PatchsetError(
            f"the root commit of {repo} is not the pristine {project.pin().filename} tree",
            "build queues with `scripts/patchset queue --dir DIR` (or from a clone of one)",
        )
    old = {p.name: p for p in project.series()}
    written: list[str] = []
    parent = base
    for commit in gitops.rev_list(repo, base):
        name_guess = gitops.message(repo, commit).partition("\n")[0].strip() + ".patch"
        previous = old.get(name_guess)
        new_diff = gitops.diff_commits(repo, parent, commit)
        changed = previous is None or previous.diff.rstrip("\n") != new_diff.rstrip("\n")
        name, text = _patch_from_commit(repo, commit, parent, previous, changed)
        if name in written:
            raise SeriesError(f"two queue commits are both named {name}", "give each patch commit a unique subject")
        path = project.patches_dir / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
        written.append(name)
        parent = commit
    for stale in set(old) - set(written):
        (project.patches_dir / stale).unlink()
        log(f"patchset: removed {stale} (no longer in the queue)")
    series = SERIES_HEADER + "".join(f"{n}\n" for n in written)
    (project.patches_dir / "series").write_text(series, encoding="utf-8")
    log(f"patchset: exported {len(written)} patches to {project.patches_dir}")
    return written


def _sync_tree(src_root: Path, dst_root: Path, members: tuple[str, ...]) -> None:
    """Make dst's members mirror src's (ignoring caches and built objects)."""
    from .tree import hash_tree

    src_files = hash_tree(src_root, members)
    dst_files = hash_tree(dst_root, members)
    for rel in set(dst_files) - set(src_files):
        (dst_root / rel).unlink()
    for rel, digest in src_files.items():
        if dst_files.get(rel) != digest:
            (dst_root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src_root / rel, dst_root / rel)


def refresh(
    project: Project,
    patch: str | None = None,
    new: str | None = None,
    description: str | None = None,
    sdist: Path | None = None,
    log=print,
) -> str:
    """Fold local edits in megatron/ into a patch (existing or new) and re-export the series."""
    pin = project.pin()
    patches = project.series()
    stamp = read_stamp(project.root)
    if stamp is None or not stamp.matches(pin, patches):
        raise PatchsetError(
            "megatron/ is missing or was built from another series; edits cannot be attributed",
            "run `scripts/patchset status` to see why; re-materialize before editing",
        )
    edits = local_edits(project.root, pin, stamp)
    if not edits:
        log("patchset: no local edits; patches unchanged")
        return ""
    with tempfile.TemporaryDirectory(prefix=".patchset-tmp-", dir=project.root) as tmp:
        queue = build_queue(pin, locate_sdist(pin, sdist), patches, Path(tmp) / "queue")
        _sync_tree(project.root, queue.repo, pin.members)
        target = _choose_target(patches, edits, patch, new)
        if new is not None:
            header = _new_header(description or f"{new}: describe why this change exists")
            gitops.commit_all(queue.repo, f"{new}\n\n{header}\n")
        elif target == queue.commits[-1][0]:
            gitops.git(["add", "-A", "."], cwd=queue.repo)
            gitops.git(["commit", "-q", "--amend", "--no-edit", "--no-verify"], cwd=queue.repo)
        else:
            _fixup_into(queue, target)
        export_queue(project, queue.repo, sdist, log=lambda *_: None)
    write_stamp(project.root, pin, project.series())
    name = f"{new}.patch" if new is not None else target
    log(f"patchset: folded {len(edits)} edited file(s) into {name}")
    return name


def _choose_target(patches: list[Patch], edits: dict[str, str], patch: str | None, new: str | None) -> str:
    if new is not None:
        if any(p.stem == new for p in patches):
            raise SeriesError(f"a patch named {new}.patch already exists", "pick another name or use --patch")
        return f"{new}.patch"
    if not patches:
        raise SeriesError("the series is empty, so there is no patch to refresh into", "use --new NAME")
    if patch is not None:
        name = patch if patch.endswith(".patch") else f"{patch}.patch"
        if name not in [p.name for p in patches]:
            raise SeriesError(f"{name} is not in patches/series", "pick a listed patch or use --new NAME")
        return name
    owners: dict[str, str] = {}
    for path in edits:
        for p in reversed(patches):
            if any(path in pair for pair in p.touched_files()):
                owners[path] = p.name
                break
    targets = set(owners.values())
    if len(owners) == len(edits) and len(targets) == 1:
        return targets.pop()
    detail = ", ".join(f"{f} -> {owners.get(f, 'no patch')}" for f in edits)
    raise SeriesError(
        f"cannot tell which patch owns these edits ({detail})",
        "name it: `scripts/patchset refresh --patch NAME` or `scripts/patchset refresh --new NAME`",
    )


def _new_header(description: str) -> str:
    return (
        f"Description: {description}\nOrigin: vendor, hfsdp\nBug: none\nForwarded: no\n"
        f"Applied-Upstream: no\nLast-Update: {today()}"
    )


def _fixup_into(queue: Queue, target: str) -> None:
    """Commit the edits as a fixup of ``target`` and autosquash; later patches are rebased."""
    target_commit = dict(queue.commits)[target]
    gitops.git(["add", "-A", "."], cwd=queue.repo)
    gitops.git(["commit", "-q", "--no-verify", f"--fixup={target_commit}"], cwd=queue.repo)
    env_editor = os.environ.get("GIT_SEQUENCE_EDITOR")
    os.environ["GIT_SEQUENCE_EDITOR"] = "true"
    try:
        proc = gitops.git(["rebase", "-q", "-i", "--autosquash", queue.base], cwd=queue.repo, check=False)
    finally:
        if env_editor is None:
            os.environ.pop("GIT_SEQUENCE_EDITOR", None)
        else:
            os.environ["GIT_SEQUENCE_EDITOR"] = env_editor
    if proc.returncode != 0:
        gitops.git(["rebase", "--abort"], cwd=queue.repo, check=False)
        raise PatchsetError(
            f"moving the edits into {target} conflicts with a later patch: {proc.stderr.strip()}",
            "use `--new NAME` to add them as a new patch at the end, or edit the queue by hand "
            "(`scripts/patchset queue --dir DIR`, then `export --queue DIR`). Nothing was written.",
        )
