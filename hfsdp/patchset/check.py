"""``check``: the overlay and the series apply to a pristine base with no fuzz; against another upstream
release, report which patches are already upstream (they reverse-apply) and which conflict, and which
overlay files the release would clash with.

[Note: what each verdict promises] Against another release, each patch of the series gets one verdict,
in series order, on a queue of that release plus the overlay plus the patches that applied before it:

* ``upstream``: the patch reverse-applies (``git apply --reverse``, exact context): the release has it;
* ``declared``: it neither reverse-applies nor applies, and its ``Applied-Upstream`` names a release at or
  before this one *and* an upstream commit (``commit:<id>`` or a URL of a commit): a rewrite of that commit
  whose text differs, to verify and drop. A header naming only a release is not evidence: ``conflicts``,
  with a note saying so;
* ``applies``: ``git apply`` with exact context (no fuzz) succeeded, and the patch is committed for the next;
* ``conflicts``: none of the above.

[Note: the overlay against another release] An overlay file conflicts with a release when

* the release has a file at its path (the overlay only adds files), or
* it is a Python module that defines, at its top level, a name (class, function, or assignment in the
  module's own body) that a module of the same package (folder) of the release also defines at its
  top level. That is how a backport meets its upstream original under another file name: the fork's
  ``maxpool_allocator.py`` defines ``MaxPoolAllocator`` and a later release defines its own
  ``MaxPoolAllocator`` in ``param_and_grad_buffer.py`` beside it; both would be imported by the same
  code, and only one can be meant.

Names with a leading underscore (private, dunders) and the per-module logger names in
``PER_MODULE_NAMES`` are not compared: every module has its own, and sharing them means nothing.
Names bound only inside ``if``/``try`` blocks are not compared either. A release module that this
Python cannot parse is named in a note, never silently counted as clean.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import tempfile
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import gitops
from .errors import HashMismatch, PatchDoesNotApply, PatchsetError, SeriesError, SourceUnavailable
from .overlay import Overlay, source_name, taken_paths, write_files
from .pin import BasePin
from .project import Project
from .series import Patch
from .source import (
    _download,
    cache_dir,
    cached_file,
    check_version,
    index_files,
    is_offline,
    locate_sdist,
    require_cache_folder,
    sha256_file,
    verify,
    yank_note,
)
from .tree import OVERLAY_MESSAGE, build_queue, extract_base

_VERSION = re.compile(r"^\d+\.\d+\.\d+\S*$")
PER_MODULE_NAMES = frozenset({"logger", "log"})


@dataclass(frozen=True)
class CheckResult:
    patch: str
    state: str  # "applies" | "upstream" | "declared" | "conflicts"
    files: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class OverlayConflict:
    """An overlay file that clashes with another release (see the note)."""

    path: str  # the overlay file, as its megatron/ path
    reason: str  # what clashes, as a sentence fragment
    files: tuple[str, ...]  # the release's files involved


@dataclass
class AgainstReport:
    """What ``check --against`` found."""

    version: str
    patches: list[CheckResult] = field(default_factory=list)
    overlay: list[OverlayConflict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. the release is yanked

    @property
    def conflicts(self) -> int:
        return sum(r.state == "conflicts" for r in self.patches) + len(self.overlay)


def check_base(project: Project, sdist: Path | None = None) -> int:
    """Add the overlay and apply the whole series to a fresh pristine base; raise on failure. Returns the number
    of patches."""
    pin = project.pin()
    patches = project.series()
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:  # not in the checkout: it may be read-only
        build_queue(pin, locate_sdist(pin, sdist), patches, Path(tmp) / "queue", project.overlay())
    return len(patches)


def _newer_pin(pin: BasePin, target: str) -> tuple[BasePin, Path | None]:
    """A pin for another release: ``target`` is a version (downloaded, hash from the index) or an sdist path."""
    path = Path(target)
    stem = pin.distribution.replace("-", "_")
    if path.is_dir():
        raise PatchsetError(f"--against {target} is a folder; it takes a version or an sdist file",
                            f"pass e.g. 0.19.0, or the {stem}-<version>.tar.gz file inside it")
    if path.is_file():
        if not re.fullmatch(rf"{re.escape(stem)}-[0-9][^/]*\.tar\.gz", path.name):
            raise PatchsetError(f"--against {target}: {path.name} is not an sdist of {pin.distribution} (named "
                                f"{stem}-<version>.tar.gz)", "pass e.g. 0.19.0, or such an sdist file")
        version = re.sub(r"\.tar\.gz$", "", path.name).rsplit("-", 1)[-1]
        other = dataclasses.replace(pin, version=version, filename=path.name, sha256=sha256_file(path), url="")
        check_version(other, path)
        return other, path
    if not _VERSION.match(target):
        raise PatchsetError(f"{target!r} is neither an sdist file nor a version",
                            "pass e.g. 0.19.0 or a path to an sdist")
    name = f"{pin.distribution.replace('-', '_')}-{target}.tar.gz"
    return dataclasses.replace(pin, version=target, filename=name, sha256="", url=""), None


def check_against(project: Project, target: str) -> AgainstReport:
    """The overlay and each patch against another release: already upstream, still applies, or conflicts."""
    pin = project.pin()
    overlay = project.overlay()
    patches = project.series()
    other, path = _newer_pin(pin, target)
    if path is None:
        path = _download_unpinned(other)
    report = AgainstReport(other.version)
    if (note := yank_note(other, other.filename)) is not None:
        report.notes.append(note)
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        repo = Path(tmp) / "newer"
        repo.mkdir()
        gitops.init_repo(repo)
        extract_base(other, path, repo)
        gitops.commit_all(repo, "base\n")
        taken = taken_paths(repo, overlay.paths)
        report.overlay = [OverlayConflict(p, f"{other.version} has a file at this path", (p,)) for p in taken]
        report.overlay += _same_package_names(overlay, repo, other.version, report.notes)
        write_files(repo, {p: text for p, text in overlay.files.items() if p not in taken})
        gitops.commit_all(repo, OVERLAY_MESSAGE)
        report.patches = [_check_patch(repo, patch, other.version) for patch in patches]
    return report


def _check_patch(repo: Path, patch: Patch, version: str) -> CheckResult:
    """One patch on the release's queue at ``repo``: upstream (reverse-applies), applies (committed), declared
    upstream by its header, or conflicts."""
    expected = patch.fields.get("Applied-Upstream", "no")
    try:
        gitops.apply_patch(repo, patch.name, patch.diff, reverse=True, check_only=True)
        return CheckResult(patch.name, "upstream", note=f"Applied-Upstream: {expected}")
    except PatchDoesNotApply:
        pass
    declared = _declared_upstream(expected, version)
    try:
        gitops.apply_patch(repo, patch.name, patch.diff)
        gitops.commit_all(repo, patch.stem + "\n")
        return CheckResult(patch.name, "applies", note="declared upstream" if declared else "")
    except PatchDoesNotApply as exc:
        if exc.line_endings:
            raise  # not a conflict with the release: the patch file itself is broken
        if declared and upstream_commits(expected):
            # A clean-room backport is a rewrite of the upstream change, so it rarely
            # reverse-applies; its header names the release and the commit that has it. Verify, then drop.
            return CheckResult(patch.name, "declared", tuple(exc.files), note=f"Applied-Upstream: {expected}")
        if declared:
            return CheckResult(patch.name, "conflicts", tuple(exc.files),
                               note=f"Applied-Upstream: {expected} names no upstream commit, and the patch does "
                                    "not reverse-apply: name the commit (a URL .../commit/<id> or commit:<id>) or "
                                    "rebase it")
        return CheckResult(patch.name, "conflicts", tuple(exc.files))


def top_level_names(source: str) -> set[str]:
    """Names a module defines in its own body: classes, functions, assignment targets (see the note for
    which are compared)."""
    names: set[str] = set()

    def bind(target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Tuple | ast.List):
            for item in target.elts:
                bind(item)
        elif isinstance(target, ast.Starred):
            bind(target.value)

    type_alias = getattr(ast, "TypeAlias", None)  # `type X = ...` (Python >= 3.12)
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                bind(target)
        elif isinstance(node, ast.AnnAssign):
            bind(node.target)
        elif type_alias is not None and isinstance(node, type_alias):
            bind(node.name)
    return {n for n in names if not n.startswith("_") and n not in PER_MODULE_NAMES}


def _same_package_names(overlay: Overlay, release: Path, version: str, notes: list[str]) -> list[OverlayConflict]:
    """Overlay modules defining a name that a module of the same package of the release at ``release`` also
    defines (see the note); modules of the release this Python cannot parse are named in ``notes``."""
    out: list[OverlayConflict] = []
    unparsed: set[str] = set()
    for path, text in overlay.files.items():
        package = release / PurePosixPath(path).parent
        if not path.endswith(".py") or not package.is_dir():
            continue
        try:
            ours = top_level_names(text)
        except SyntaxError as exc:
            raise SeriesError(f"{source_name(path)} is not valid Python (line {exc.lineno}: {exc.msg}), so the "
                              "names it defines cannot be compared with the release's",
                              "fix the file, then check again") from exc
        for sibling in sorted(package.glob("*.py")):
            rel = sibling.relative_to(release).as_posix()
            if rel == path or not sibling.is_file():
                continue
            try:
                theirs = top_level_names(sibling.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                unparsed.add(rel)
                continue
            if common := sorted(ours & theirs):
                out.append(OverlayConflict(
                    path, f"defines {', '.join(common)}, which {version} also defines in {rel} (the same package)",
                    (rel,)))
    notes.extend(f"{rel} of {version} does not parse with this Python; the names it defines were not compared "
                 "with the overlay's" for rel in sorted(unparsed))
    return out


def _version_tuple(text: str) -> tuple[int, ...] | None:
    match = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    return tuple(int(g or 0) for g in match.groups()) if match else None


def _declared_upstream(applied_upstream: str, target_version: str) -> bool:
    """True when the header's Applied-Upstream names a release at or before ``target_version``."""
    first = applied_upstream.split(",", 1)[0]
    have, target = _version_tuple(first), _version_tuple(target_version)
    return have is not None and target is not None and have <= target


_COMMIT = re.compile(r"^(commit:\S+|https?://\S+/commits?/[0-9a-fA-F]{7,40}/?)$")


def upstream_commits(applied_upstream: str) -> list[str]:
    """The upstream commits an ``Applied-Upstream`` value names (``commit:<id>``, or a URL of a commit)."""
    return [part.strip() for part in applied_upstream.split(",") if _COMMIT.match(part.strip())]


def _download_unpinned(other: BasePin) -> Path:
    """Fetch another release's sdist; its sha256 comes from the index (no pin exists for it)."""
    cached = cache_dir() / other.filename
    by_path = f"download {other.filename} elsewhere and pass its path: --against PATH"
    if cached_file(cached, by_path) is not None:
        return cached
    if is_offline():
        raise PatchsetError(f"offline and {cached} is missing", by_path)
    require_cache_folder(cached, by_path)
    where = other.index_url.rstrip("/")
    try:
        entry = next((f for f in index_files(other, 120) if f.get("filename") == other.filename), None)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise SourceUnavailable(f"{where} did not answer for {other.filename} ({exc})",
                                f"check network access to the package index, or {by_path}") from None
    if entry is None:
        raise PatchsetError(f"{other.filename} is not on {other.index_url}", "check the version number")
    hashes = entry.get("hashes")
    digest = hashes.get("sha256") if isinstance(hashes, dict) else None
    if not isinstance(digest, str) or not isinstance(entry.get("url"), str):
        raise SourceUnavailable(f"{where} lists no sha256 or URL for {other.filename}", by_path)
    try:
        _download(entry["url"], cached, 120)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise SourceUnavailable(f"could not download {other.filename}: {exc}",
                                f"check network access to the package index, or {by_path}") from None
    try:
        verify(dataclasses.replace(other, sha256=digest.lower()), cached)
    except HashMismatch:
        cached.unlink(missing_ok=True)  # a damaged download is not kept as the release
        raise
    return cached
