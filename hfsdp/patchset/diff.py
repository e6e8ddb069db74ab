"""``diff``: local edits in ``megatron/`` as a patch, against the tree *as it was built*.

The tree as built is rebuilt from the patch and overlay texts its stamp records (stamp.py), not
from ``patches/``: after a pull changed a patch or an overlay file, a diff against the new series
would contain a hunk that silently undoes the pulled change. Edits of overlay files are in the diff
like any other edit. Kept entries (scan.py) are not edits and are not in the diff. Read-only: the
scratch queue lives in the system's temporary folder, so ``diff`` works on a read-only checkout.

``diff --series`` shows the overlay as added files (the overlay commit against the base), then the
series (the patch commits against the overlay commit).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from . import gitops
from .errors import PatchsetError
from .materialize import live_census, require_real_tree
from .overlay import Overlay
from .project import Project
from .scan import copy_edits
from .series import Patch, parse_patch
from .source import locate_sdist
from .stamp import read_stamp
from .tree import build_queue


def as_built(project: Project) -> tuple[list[Patch], Overlay]:
    """The patches (in order) and the overlay megatron/ was built from (from the stamp; from patches/ if a
    schema-1 stamp, which records no texts, still matches them)."""
    pin = project.pin()
    stamp = read_stamp(project.root)
    if stamp is None:
        raise PatchsetError("megatron/ is not materialized, so it has no local edits",
                            "run `scripts/patchset materialize`")
    if stamp.texts is not None:
        texts = stamp.texts
        return ([parse_patch(name, texts[name], project.base_dir / name) for name, _ in stamp.patches],
                stamp.built_overlay())
    patches = project.series()
    if not stamp.matches(pin, patches, project.overlay()):
        raise PatchsetError(
            "megatron/ was built by an older version of this tool from patches that have changed since, and "
            "its stamp does not record them, so its edits cannot be separated from the patch changes",
            "restore the patches it was built from (e.g. `git stash` your patch changes), run "
            "`scripts/patchset diff > my.patch`, then bring the patch changes back",
        )
    return patches, stamp.built_overlay()


def local_diff(project: Project, sdist: Path | None = None) -> str:
    """The edits of megatron/ against its as-built tree, as a git diff (empty if none). A tree read through a
    symbolic link is refused ([Note: a tree behind a symbolic link] in materialize.py)."""
    require_real_tree(project)
    stamp = read_stamp(project.root)
    if stamp is not None:  # the tree as built is of the base it was built from ([Note: bases] in project.py)
        project = project.for_stamp(stamp.base_version, stamp.sdist_sha256) or project
    pin = project.pin()
    patches, overlay = as_built(project)
    if stamp is None:
        raise PatchsetError("megatron/ is not materialized, so it has no local edits",
                            "run `scripts/patchset materialize`")
    edits = live_census(project, stamp).edits
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        queue = build_queue(pin, locate_sdist(pin, sdist), patches, Path(tmp) / "q", overlay)
        copy_edits(edits, project.root, queue.repo)
        gitops.git(["add", "-A", "."], cwd=queue.repo)
        return gitops.git(["diff", "--cached", "--no-color", "--no-renames", "--full-index", "HEAD"],
                          cwd=queue.repo).stdout


def series_diff(project: Project, sdist: Path | None = None) -> str:
    """The overlay as added files, then the series, each as one diff (see the module's docstring)."""
    pin = project.pin()
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        queue = build_queue(pin, locate_sdist(pin, sdist), project.series(), Path(tmp) / "q", project.overlay())
        return (gitops.diff_commits(queue.repo, queue.base, queue.overlay)
                + gitops.diff_commits(queue.repo, queue.overlay, "HEAD"))
