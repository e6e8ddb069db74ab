"""``refresh``: fold local edits in ``megatron/`` back into the overlay and the patches (quilt refresh).

[Note: where refresh puts an edit] The edits (scan.py's census against the stamp) are sorted in two:

* **overlay edits**: a changed or deleted file that the tree got from the overlay, and a new file
  under ``megatron/core`` or ``megatron/training``. They go to ``patches/overlay/`` at the same
  path (a deleted one leaves the overlay), whatever ``--patch``/``--new`` say: a file upstream does
  not have is never a patch. A new file at a path the base has (a patch deletes it) is refused:
  that is a change to the deleting patch, made in a queue;
* **upstream edits**: everything else (files of the base, and files a patch creates in a series
  not yet moved to the overlay). They go into the patch that owns them, ``--patch NAME``, or a new
  patch ``--new NAME``, as before.

Both are committed onto a throw-away queue of the current overlay and series: the overlay edits as
a fixup of the overlay commit, autosquashed first; then the upstream edits into the owning patch
(fixup + autosquash), into the last patch, or as a new patch. Later patches are rebased; a conflict
aborts with nothing written. The queue is exported with the same all-or-nothing steps as
``export`` (export.py: the new overlay and patches must rebuild it exactly), so ``patches/``, its
``series`` and ``patches/overlay/`` are swapped in together, and then the stamp is rewritten. A patch
whose diff the refresh did not change keeps its file byte for byte, and ``series`` is kept while it
lists the same patches: when only overlay files changed, no patch file is rewritten.

The stamp records the files the new overlay and patches build (the queue's), not the live tree, so
an edit made while refresh ran still shows as an edit. The new stamp is written beside the stamp
(``.patchset-stamp.next.json``), then ``patches/`` is swapped in, then the new stamp replaces the old
one: a run killed before the swap leaves ``patches/`` and the stamp as they were (the edits are still
edits), one killed after it leaves a new stamp that the next writer puts in place (leftovers.py).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from hfsdp.atomic import write_text_atomic

from . import gitops
from .errors import REBASE_EDITS_FIX, PatchsetError, SeriesError
from .export import plan_export, snapshot_patches, today, write_plan
from .lock import writing
from .materialize import live_census, overlay_edits, require_real_tree
from .project import Project
from .scan import NEXT_STAMP_NAME, STAMP_NAME, copy_edits, hash_files
from .series import Patch, patch_name
from .source import locate_sdist
from .stamp import make_stamp, read_stamp
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
    today()  # SOURCE_DATE_EPOCH is checked before anything, whichever edits there are (export.plan_export too)
    require_real_tree(project)
    with writing(project, "refresh", log):
        return _refresh(project, patch, new, description, sdist, log)


def _refresh(project: Project, patch: str | None, new: str | None, description: str | None,
             sdist: Path | None, log: Callable[[str], None]) -> str:
    snapshot = snapshot_patches(project)  # before patches/ is read: a save there meanwhile undoes the swap
    pin = project.pin()
    patches = project.series()
    overlay = project.overlay()
    stamp = read_stamp(project.root)
    if stamp is None:
        raise PatchsetError("megatron/ is not materialized, so there are no edits to refresh",
                            "run `scripts/patchset materialize`, edit megatron/, then refresh")
    found = live_census(project, stamp)
    if not stamp.matches(pin, patches, overlay):
        if found.edits:
            raise PatchsetError(
                f"megatron/ was built from other patches or overlay files than patches/ holds now, and has "
                f"{len(found.edits)} edited file(s); refreshing would attribute them to the wrong patches",
                REBASE_EDITS_FIX,
            )
        raise PatchsetError("megatron/ was built from other patches or overlay files than patches/ holds now, and "
                            "has no edits", "run `scripts/patchset materialize` to rebuild it")
    if not found.edits:
        log("patchset: no local edits; patches and overlay unchanged")
        return ""
    in_overlay = set(overlay_edits(found.edits, stamp))
    to_overlay = {p: k for p, k in found.edits.items() if p in in_overlay}
    upstream = {p: k for p, k in found.edits.items() if p not in in_overlay}
    if to_overlay and project.base is not None:  # [Note: bases] in project.py: one overlay for every base
        default = Project(project.root).pin().version
        raise SeriesError(
            f"{', '.join(sorted(to_overlay))} would go to the overlay, which every base shares, but this tree is of "
            f"base {project.base}; nothing was written",
            f"make the overlay change on the default base: `scripts/patchset --base {default} materialize --backup` "
            "(your tree is kept whole as megatron.bak-*), redo the edit there, then "
            f"`scripts/patchset --base {default} refresh`")
    _refuse_binary(project, to_overlay)
    target = _choose_target(patches, upstream, patch, new) if upstream else ""
    if not upstream and (patch or new):
        log(f"patchset: every edit is of an overlay file; {'--new' if new else '--patch'} was not needed")
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        queue = build_queue(pin, locate_sdist(pin, sdist), patches, Path(tmp) / "queue", overlay)
        as_built = _patch_diffs(queue)
        if to_overlay:
            _refuse_restored_base_files(queue, to_overlay, pin.filename)
            copy_edits(to_overlay, project.root, queue.repo)
            _stage(queue.repo, to_overlay)
            gitops.git(["commit", "-q", "--no-verify", f"--fixup={queue.overlay}"], cwd=queue.repo)
            _autosquash(queue, "the overlay", "a patch of the series changes one of those overlay files "
                        "(`scripts/patchset lint` names it), so the edit cannot go under it: first fold that "
                        "patch's change into the overlay file, in a queue (`scripts/patchset queue --dir DIR`, "
                        "then `scripts/patchset export --queue DIR`)")
        if upstream:
            copy_edits(upstream, project.root, queue.repo)
            _commit_upstream(queue, upstream, target, new, description)
        plan = plan_export(project, queue.repo, sdist=sdist, check_state=False, keep=as_built)
        files = hash_files(queue.repo, pin.members)
    # The new stamp is written first, beside the stamp; it becomes the stamp once patches/ is in place. A run
    # killed in between leaves it for the next writer, which finishes or drops it (leftovers.py).
    pending = project.megatron_dir / NEXT_STAMP_NAME
    write_text_atomic(pending, make_stamp(pin, plan.patches(project.patches_dir), plan.overlay, files).to_json())
    try:
        write_plan(project, plan, snapshot, project.command("refresh"), log)
    except BaseException:
        pending.unlink(missing_ok=True)
        raise
    os.replace(pending, project.megatron_dir / STAMP_NAME)
    if upstream:
        log(f"patchset: folded {len(upstream)} edited file(s) into {target}")
    return target


def _patch_diffs(queue: Queue) -> dict[str, str]:
    """Each patch commit's diff as built: a patch whose diff is the same after the refresh keeps its file's
    bytes (export.plan_export's ``keep``), so folding edits elsewhere rewrites no other patch."""
    diffs: dict[str, str] = {}
    parent = queue.overlay
    for name, commit in queue.commits:
        diffs[name] = gitops.diff_commits(queue.repo, parent, commit).rstrip("\n")
        parent = commit
    return diffs


def _refuse_binary(project: Project, edits: dict[str, str]) -> None:
    """The overlay holds UTF-8 text ([Note: the overlay] in overlay.py): refuse a new or changed file that is not."""
    binary = []
    for path, kind in edits.items():
        if kind != "deleted":
            try:
                (project.root / path).read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                binary.append(path)
    if binary:
        raise PatchsetError(f"{', '.join(binary)} would go to the overlay, which holds UTF-8 text files only, but "
                            "is not UTF-8 text; nothing was written",
                            "move the file out of megatron/ (or save it as UTF-8), then run "
                            "`scripts/patchset refresh` again")


def _refuse_restored_base_files(queue: Queue, edits: dict[str, str], base_name: str) -> None:
    """A new file at a path of the base (one a patch deletes) is not an overlay file (see the note)."""
    restored = [path for path, kind in edits.items() if kind == "added" and gitops.git(
        ["cat-file", "-e", f"{queue.base}:{path}"], cwd=queue.repo, check=False).returncode == 0]
    if restored:
        raise SeriesError(
            f"{', '.join(restored)} is new in megatron/, but the {base_name} sdist has it (a patch deletes it), so "
            "it is not an overlay file and refresh cannot tell which patch to change; nothing was written",
            "restore it in the patch that deletes it, in a queue: `scripts/patchset queue --dir DIR`, change that "
            "patch's commit there, then `scripts/patchset export --queue DIR`",
        )


def _stage(repo: Path, edits: dict[str, str]) -> None:
    """Stage exactly these paths (added, changed or deleted), whatever characters they hold."""
    gitops.git(["--literal-pathspecs", "add", "-A", "--", *edits], cwd=repo)


def _commit_upstream(queue: Queue, edits: dict[str, str], target: str, new: str | None,
                     description: str | None) -> None:
    """Commit the upstream edits (already in the work tree) into ``target``: a new patch, the last one, or an
    earlier one (fixup + autosquash; later patches are rebased)."""
    _stage(queue.repo, edits)
    if new is not None:
        stem = new.removesuffix(".patch")
        header = _new_header(description or f"{stem}: describe why this change exists")
        gitops.git(["commit", "-q", "--no-verify", "-F", "-"], cwd=queue.repo, input_text=f"{stem}\n\n{header}\n")
    elif target == queue.commits[-1][0]:
        gitops.git(["commit", "-q", "--amend", "--no-edit", "--no-verify"], cwd=queue.repo)
    else:
        gitops.git(["commit", "-q", "--no-verify", f"--fixup={dict(queue.commits)[target]}"], cwd=queue.repo)
        _autosquash(queue, target, "`scripts/patchset refresh --new NAME` adds them as a new patch at the end instead")


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
            raise SeriesError(f"{patch} is not in the series",
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


def _autosquash(queue: Queue, target: str, way_out: str) -> None:
    """Squash the fixup commit on top into ``target`` (an earlier commit); later commits are rebased."""
    proc = gitops.git(["rebase", "-q", "-i", "--autosquash", queue.base], cwd=queue.repo, check=False,
                      extra_env={"GIT_SEQUENCE_EDITOR": "true"})
    if proc.returncode != 0:
        gitops.git(["rebase", "--abort"], cwd=queue.repo, check=False)
        raise PatchsetError(
            f"moving the edits into {target} conflicts with a later patch: {proc.stderr.strip()}. Nothing was written",
            way_out,
        )
