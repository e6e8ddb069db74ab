"""``check``: the series applies to a pristine base with no fuzz; against a newer upstream
release, report which patches are already upstream (they reverse-apply) and which conflict."""

from __future__ import annotations

import dataclasses
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import gitops
from .errors import PatchDoesNotApply, PatchsetError
from .pin import BasePin
from .project import Project
from .source import check_version, locate_sdist, sha256_file
from .tree import build_queue, extract_base

_VERSION = re.compile(r"^\d+\.\d+\.\d+\S*$")


@dataclass(frozen=True)
class CheckResult:
    patch: str
    state: str  # "applies" | "upstream" | "declared" | "conflicts"
    files: tuple[str, ...] = ()
    note: str = ""


def check_base(project: Project, sdist: Path | None = None) -> int:
    """Apply the whole series to a fresh pristine base; raise PatchDoesNotApply on failure."""
    pin = project.pin()
    patches = project.series()
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:  # not in the checkout: it may be read-only
        build_queue(pin, locate_sdist(pin, sdist), patches, Path(tmp) / "queue")
    return len(patches)


def _newer_pin(pin: BasePin, target: str) -> tuple[BasePin, Path | None]:
    """A pin for another release: ``target`` is a version (downloaded, hash from the index) or an sdist path."""
    path = Path(target)
    if path.is_file():
        version = re.sub(r"\.tar\.gz$", "", path.name).rsplit("-", 1)[-1]
        other = dataclasses.replace(pin, version=version, filename=path.name, sha256=sha256_file(path), url="")
        check_version(other, path)
        return other, path
    if not _VERSION.match(target):
        raise PatchsetError(f"{target!r} is neither an sdist file nor a version",
                            "pass e.g. 0.19.0 or a path to an sdist")
    name = f"{pin.distribution.replace('-', '_')}-{target}.tar.gz"
    return dataclasses.replace(pin, version=target, filename=name, sha256="", url=""), None


def check_against(project: Project, target: str) -> list[CheckResult]:
    """Each patch against another release: already upstream, still applies, or conflicts."""
    pin = project.pin()
    other, path = _newer_pin(pin, target)
    if path is None:
        path = _download_unpinned(other)
    results: list[CheckResult] = []
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        repo = Path(tmp) / "newer"
        repo.mkdir()
        gitops.init_repo(repo)
        extract_base(other, path, repo)
        gitops.commit_all(repo, "base\n")
        for patch in project.series():
            expected = patch.fields.get("Applied-Upstream", "no")
            try:
                gitops.apply_patch(repo, patch.name, patch.diff, reverse=True, check_only=True)
                results.append(CheckResult(patch.name, "upstream", note=f"Applied-Upstream: {expected}"))
                continue
            except PatchDoesNotApply:
                pass
            declared = _declared_upstream(expected, other.version)
            try:
                gitops.apply_patch(repo, patch.name, patch.diff)
                gitops.commit_all(repo, patch.stem + "\n")
                results.append(CheckResult(patch.name, "applies", note="declared upstream" if declared else ""))
            except PatchDoesNotApply as exc:
                if declared:
                    # A clean-room backport is a rewrite of the upstream change, so it rarely
                    # reverse-applies; its header says the release has it. Verify, then drop.
                    results.append(CheckResult(patch.name, "declared", tuple(exc.files),
                                               note=f"Applied-Upstream: {expected}"))
                else:
                    results.append(CheckResult(patch.name, "conflicts", tuple(exc.files)))
    return results


def _version_tuple(text: str) -> tuple[int, ...] | None:
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    return tuple(int(g or 0) for g in match.groups()) if match else None


def _declared_upstream(applied_upstream: str, target_version: str) -> bool:
    """True when the header's Applied-Upstream names a release at or before ``target_version``."""
    first = applied_upstream.split(",", 1)[0]
    have, target = _version_tuple(first), _version_tuple(target_version)
    return have is not None and target is not None and have <= target


def _download_unpinned(other: BasePin) -> Path:
    """Fetch another release's sdist; its sha256 comes from the index (no pin exists for it)."""
    import json
    import urllib.request

    from .source import cache_dir, is_offline

    cached = cache_dir() / other.filename
    if cached.is_file():
        return cached
    if is_offline():
        raise PatchsetError(f"offline and {cached} is missing",
                            f"download {other.filename} elsewhere and pass its path")
    req = urllib.request.Request(
        f"{other.index_url.rstrip('/')}/{other.distribution}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        files = json.load(resp).get("files", [])
    entry = next((f for f in files if f.get("filename") == other.filename), None)
    if entry is None:
        raise PatchsetError(f"{other.filename} is not on {other.index_url}", "check the version number")
    from .source import _download, verify

    _download(entry["url"], cached, 120)
    verify(dataclasses.replace(other, sha256=entry["hashes"]["sha256"]), cached)
    return cached
