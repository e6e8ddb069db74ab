"""Build a patched tree: extract the verified sdist, apply the series as queue commits, stamp it.

[Note: the queue] Every build is a throw-away git repository whose first commit is the
pristine upstream tree and whose next commits are the patches, one each, in series order
(gbp-pq / Electron style). Materializing copies its work tree; ``refresh`` and ``export``
edit its commits and write them back as patch files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import gitops
from .errors import PatchsetError, WrongBaseVersion
from .pin import BasePin
from .series import Patch

STAMP_NAME = ".patchset-stamp.json"
STAMP_SCHEMA = 1
BASE_SUBJECT = "base"
# Files that appear in a materialized tree at run time and are not edits.
_IGNORED_DIRS = {"__pycache__", ".pytest_cache"}
_IGNORED_SUFFIXES = (".pyc", ".pyo", ".so", ".o", ".lock")


def _is_ignored(rel: PurePosixPath) -> bool:
    return any(part in _IGNORED_DIRS for part in rel.parts) or rel.name.endswith(_IGNORED_SUFFIXES)


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
            raise WrongBaseVersion(f"{sdist} has no {pin.sdist_root}/PKG-INFO", f"use the {pin.filename} sdist from PyPI")
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
    """A built patch queue: the repo, its base commit and one commit per applied patch."""

    repo: Path
    base: str
    commits: list[tuple[str, str]] = field(default_factory=list)  # (patch name, commit id)


def base_message(pin: BasePin) -> str:
    return f"{BASE_SUBJECT}\n\nPristine {pin.filename} ({', '.join(pin.members)}), sha256 {pin.sha256}\n"


def build_queue(pin: BasePin, sdist: Path, patches: list[Patch], repo: Path) -> Queue:
    """Extract the base into a fresh repo at ``repo`` and commit each patch on top."""
    repo.mkdir(parents=True, exist_ok=False)
    gitops.init_repo(repo)
    extract_base(pin, sdist, repo)
    queue = Queue(repo, gitops.commit_all(repo, base_message(pin)))
    for patch in patches:
        gitops.apply_patch(repo, patch.name, patch.diff)
        body = patch.header_text.rstrip("\n")
        queue.commits.append((patch.name, gitops.commit_all(repo, f"{patch.stem}\n\n{body}\n")))
    return queue


def hash_tree(root: Path, members: tuple[str, ...]) -> dict[str, str]:
    """sha256 of every non-ignored file under the materialized members, keyed by posix path."""
    manifest: dict[str, str] = {}
    for member in members:
        top = root / member
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d not in _IGNORED_DIRS)
            for name in sorted(filenames):
                path = Path(dirpath) / name
                rel = PurePosixPath(path.relative_to(root).as_posix())
                if _is_ignored(rel) or path.is_symlink():
                    continue
                manifest[str(rel)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return manifest


@dataclass(frozen=True)
class Stamp:
    """What a materialized tree was built from, and the hash of every file it got."""

    base_version: str
    sdist_sha256: str
    fork_version: str
    patches: tuple[tuple[str, str], ...]  # (name, sha256 of the patch file), in order
    files: dict[str, str]

    @staticmethod
    def expected_patches(patches: list[Patch]) -> tuple[tuple[str, str], ...]:
        return tuple((p.name, p.sha256) for p in patches)

    def matches(self, pin: BasePin, patches: list[Patch]) -> bool:
        return (
            self.base_version == pin.version
            and self.sdist_sha256 == pin.sha256
            and self.patches == self.expected_patches(patches)
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "schema": STAMP_SCHEMA,
                "base_version": self.base_version,
                "sdist_sha256": self.sdist_sha256,
                "fork_version": self.fork_version,
                "patches": [{"name": n, "sha256": h} for n, h in self.patches],
                "files": self.files,
            },
            indent=1,
            sort_keys=True,
        ) + "\n"


def write_stamp(tree_root: Path, pin: BasePin, patches: list[Patch]) -> Stamp:
    """Stamp the tree at ``tree_root`` (the folder that holds core/ and training/'s parent)."""
    stamp = Stamp(pin.version, pin.sha256, pin.fork_version, Stamp.expected_patches(patches), hash_tree(tree_root, pin.members))
    (tree_root / "megatron" / STAMP_NAME).write_text(stamp.to_json(), encoding="utf-8")
    return stamp


def read_stamp(tree_root: Path) -> Stamp | None:
    """The stamp of a materialized tree, or None if absent. A corrupt stamp is an error."""
    path = tree_root / "megatron" / STAMP_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("schema") != STAMP_SCHEMA:
            return None
        return Stamp(
            data["base_version"],
            data["sdist_sha256"],
            data["fork_version"],
            tuple((p["name"], p["sha256"]) for p in data["patches"]),
            dict(data["files"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise PatchsetError(f"stamp {path} is corrupt: {exc}", "move megatron/ away and run `scripts/patchset materialize`") from exc


def local_edits(tree_root: Path, pin: BasePin, stamp: Stamp) -> dict[str, str]:
    """Files that differ from the stamp: path -> 'modified' | 'added' | 'deleted'."""
    current = hash_tree(tree_root, pin.members)
    edits: dict[str, str] = {}
    for path, digest in current.items():
        if path not in stamp.files:
            edits[path] = "added"
        elif stamp.files[path] != digest:
            edits[path] = "modified"
    for path in stamp.files:
        if path not in current:
            edits[path] = "deleted"
    return dict(sorted(edits.items()))
