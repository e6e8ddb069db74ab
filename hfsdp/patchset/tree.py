"""Build a patched tree: extract the verified sdist, apply the series as queue commits, stamp it.

[Note: the queue] Every build is a throw-away git repository whose first commit is the
pristine upstream tree, whose second commit (subject ``overlay``) adds the overlay's files
([Note: the overlay] in overlay.py), and whose next commits are the patches, one each, in series
order (gbp-pq / Electron style). The overlay commit is there even when the overlay is empty, so
every queue has the same shape. Materializing copies its work tree; ``refresh`` and ``export``
edit its commits and write them back as the overlay, patch files and ``series``.
"""

from __future__ import annotations

import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import gitops
from .errors import WrongBaseVersion
from .overlay import OVERLAY_SUBJECT, Overlay, add_to_tree
from .pin import BasePin
from .series import Patch

BASE_SUBJECT = "base"


def _safe_member(member: tarfile.TarInfo, root: str, members: tuple[str, ...]) -> str | None:
    """Return the sdist-relative path of a member we extract, or None to skip it."""
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts or not path.parts or path.parts[0] != root:
        return None
    rel = PurePosixPath(*path.parts[1:])
    if not any(str(rel) == m or str(rel).startswith(m + "/") for m in members):
        return None
    if not (member.isfile() or member.isdir()):
        return None  # no links or devices from an archive
    return str(rel)


def read_sdist_version(pin: BasePin, sdist: Path) -> str:
    """Version from the sdist's PKG-INFO (read without extracting anything else)."""
    with tarfile.open(sdist, "r:gz") as tar:
        try:
            info = tar.extractfile(f"{pin.sdist_root}/PKG-INFO")
        except KeyError:
            info = None
        if info is None:
            raise WrongBaseVersion(f"{sdist} has no {pin.sdist_root}/PKG-INFO",
                                   f"use the {pin.filename} sdist from PyPI")
        for line in info.read().decode("utf-8", "replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    raise WrongBaseVersion(f"{sdist} PKG-INFO has no Version", f"use the {pin.filename} sdist from PyPI")


def extract_base(pin: BasePin, sdist: Path, dest: Path) -> None:
    """Extract only the pinned members (megatron/core, megatron/training) into dest."""
    version = read_sdist_version(pin, sdist)
    if version != pin.version:
        raise WrongBaseVersion(
            f"{sdist.name} contains {pin.distribution} {version}, pinned is {pin.version}",
            f"use the {pin.filename} sdist",
        )
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            rel = _safe_member(member, pin.sdist_root, pin.members)
            if rel is None:
                continue
            target = dest / rel
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None, f"regular member {member.name} has no data"
            with target.open("wb") as out:
                shutil.copyfileobj(source, out)
    missing = [m for m in pin.members if not (dest / m).exists()]
    if missing:
        raise WrongBaseVersion(f"{sdist.name} lacks {missing}", f"use the {pin.filename} sdist")


@dataclass
class Queue:
    """A built patch queue: the repo, its base commit, its overlay commit and one commit per applied patch."""

    repo: Path
    base: str
    overlay: str = ""  # the overlay commit (see the note)
    commits: list[tuple[str, str]] = field(default_factory=list)  # (patch name, commit id)


def base_message(pin: BasePin) -> str:
    return f"{BASE_SUBJECT}\n\nPristine {pin.filename} ({', '.join(pin.members)}), sha256 {pin.sha256}\n"


OVERLAY_MESSAGE = (f"{OVERLAY_SUBJECT}\n\nFiles upstream does not have (patches/overlay/), added to the base; "
                   "the patches follow.\n")


def start_queue(pin: BasePin, sdist: Path, overlay: Overlay, repo: Path) -> Queue:
    """A fresh repo at ``repo`` (an existing empty folder) holding the base commit and the overlay commit."""
    gitops.init_repo(repo)
    extract_base(pin, sdist, repo)
    base = gitops.commit_all(repo, base_message(pin))
    add_to_tree(repo, overlay, pin.filename)
    return Queue(repo, base, gitops.commit_all(repo, OVERLAY_MESSAGE))


def build_queue(pin: BasePin, sdist: Path, patches: list[Patch], repo: Path, overlay: Overlay) -> Queue:
    """Extract the base into a fresh repo at ``repo``, add the overlay and commit each patch on top."""
    repo.mkdir(parents=True, exist_ok=False)
    queue = start_queue(pin, sdist, overlay, repo)
    for patch in patches:
        gitops.apply_patch(repo, patch.name, patch.diff)
        body = patch.header_text.rstrip("\n")
        queue.commits.append((patch.name, gitops.commit_all(repo, f"{patch.stem}\n\n{body}\n")))
    return queue
