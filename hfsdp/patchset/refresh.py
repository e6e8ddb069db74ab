"""``refresh``: fold local edits in ``megatron/`` back into a patch (quilt refresh).

The edits (scan.py's census against the stamp) are committed onto a throw-away queue of the
current series (into the owning patch with a fixup + autosquash, into the last patch, or as a
new patch), exported with the same all-or-nothing steps as ``export`` (export.py), and then the
stamp is rewritten to the refreshed series. The stamp records the files the new patches build
(the queue's), not the live tree, so an edit made while refresh ran still shows as an edit.
Patches are written before the stamp: a run killed in between leaves a stale stamp plus edits,
which ``status`` and ``diff`` show and nothing rebuilds over.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from . import gitops
from .errors import REBASE_EDITS_FIX, PatchsetError, SeriesError
from .export import plan_export, today, write_plan
from .lock import writing
from .materialize import live_census, require_real_tree
from .project import Project
from .scan import copy_edits, hash_files
from .series import Patch, patch_name
from .source import locate_sdist
from .stamp import make_stamp, read_stamp, write_stamp_file
from .tree import Queue, build_queue


def refresh(
    project: Project,
    patch: str | None = None,
    new: str | None = None,
    description: str | None = None,
    sdist: Path | None = None,
    log: Callable[[str], None] = print,
) -> str:
    """Fold local edits into a patch (existing or new); returns its name ('' when there were none).

    ``patch``/``new`` are ``NAME`` or ``NAME.patch``; a name that breaks the rule ([Note: patch names]
    in series.py) or a tree read through a symbolic link is refused before anything is touched."""
    patch = None if patch is None else patch_name(patch, "--patch")
    new = None if new is None else patch_name(new, "--new")
    require_real_tree(project)
    with writing(project, "refresh", log):
        return _refresh(project, patch, new, description, sdist, log)


def _refresh(project: Project, patch: str | None, new: str | None, description: str | None,
             sdist: Path | None, log: Callable[[str], None]) -> str:
    pin = project.pin()
    patches = project.series()
    stamp = read_stamp(project.root)
    if stamp is None:
        raise PatchsetError("megatron/ is not materialized, so there are no edits to refresh",
                            "run `scripts/patchset materialize`, edit megatron/, then refresh")
    found = live_census(project, stamp)
    if not stamp.matches(pin, patches):
        if found.edits:
            raise PatchsetError(
                f"megatron/ was built from other patches than patches/ holds now, and has "
                f"{len(found.edits)} edited file(s); refreshing would attribute them to the wrong patches",
                REBASE_EDITS_FIX,
            )
        raise PatchsetError("megatron/ was built from other patches than patches/ holds now, and has no edits",
                            "run `scripts/patchset materialize` to rebuild it")
    if not found.edits:
        log("patchset: no local edits; patches unchanged")
        return ""
    target = _choose_target(patches, found.edits, patch, new)
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        queue = build_queue(pin, locate_sdist(pin, sdist), patches, Path(tmp) / "queue")
        copy_edits(found.edits, project.root, queue.repo)
        if new is not None:
            stem = new.removesuffix(".patch")
            header = _new_header(description or f"{stem}: describe why this change exists")
            gitops.commit_all(queue.repo, f"{stem}\n\n{header}\n")
        elif target == queue.commits[-1][0]:
            gitops.git(["add", "-A", "."], cwd=queue.repo)
            gitops.git(["commit", "-q", "--amend", "--no-edit", "--no-verify"], cwd=queue.repo)
        else:
            _fixup_into(queue, target)
        plan = plan_export(project, queue.repo, sdist=sdist, check_state=False)
        files = hash_files(queue.repo, pin.members)
    write_plan(project, plan, "scripts/patchset refresh", log)
    write_stamp_file(project.root, make_stamp(pin, plan.patches(project.patches_dir), files))
    log(f"patchset: folded {len(found.edits)} edited file(s) into {target}")
    return target


def _choose_target(patches: list[Patch], edits: dict[str, str], patch: str | None, new: str | None) -> str:
    if new is not None:
        if any(p.name == new for p in patches):
            raise SeriesError(f"a patch named {new} already exists", "pick another name or use --patch")
        return new
    if not patches:
        raise SeriesError("the series is empty, so there is no patch to refresh into",
                          "`scripts/patchset refresh --new NAME` adds one")
    if patch is not None:
        if patch not in [p.name for p in patches]:
            raise SeriesError(f"{patch} is not in patches/series",
                              "pick a listed patch, or `scripts/patchset refresh --new NAME`")
        return patch
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
    proc = gitops.git(["rebase", "-q", "-i", "--autosquash", queue.base], cwd=queue.repo, check=False,
                      extra_env={"GIT_SEQUENCE_EDITOR": "true"})
    if proc.returncode != 0:
        gitops.git(["rebase", "--abort"], cwd=queue.repo, check=False)
        raise PatchsetError(
            f"moving the edits into {target} conflicts with a later patch: {proc.stderr.strip()}. Nothing was written",
            "`scripts/patchset refresh --new NAME` adds them as a new patch at the end instead",
        )
