"""``lint``: DEP-3 headers are present and valid; patches change only files the sdist has; the overlay
only adds files, under the pinned members ([Note: the overlay] in overlay.py).

A patch that creates a file, or touches a file of the overlay, is refused: a file upstream does not
have is kept whole in ``patches/overlay/``, and edited there, never as a diff (or a diff of a diff).
"""

from __future__ import annotations

import datetime as _dt
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .chains import rewrite_chains
from .errors import PatchsetError
from .overlay import Overlay, scan_overlay, source_name
from .pin import BasePin
from .prefixes import SMOKE_FIELD, parse_smoke
from .project import Project
from .series import Patch, crlf_line, patch_path, read_patch, read_series_names
from .source import locate_sdist

REQUIRED = ("Description", "Origin", "Bug", "Forwarded", "Applied-Upstream", "Last-Update")
ORIGIN_CATEGORIES = ("upstream", "backport", "vendor", "other")
_URL = r"https?://\S+"
_FORWARDED = re.compile(rf"^(no|not-needed|yes|{_URL})$")
_BUG = re.compile(rf"^(none|{_URL})$")
# A change, not a report: what fixed a bug upstream belongs in Applied-Upstream or the description.
_CHANGE_URL = re.compile(r"/(pull|pulls|merge_requests|commit|commits)/")
_APPLIED = re.compile(rf"^(no|(\d+\.\d+(\.\d+)?|{_URL}|commit:\S+)(,\s*({_URL}|commit:\S+))*)$")
_ORIGIN = re.compile(rf"^(?:(?P<cat>[a-z]+),\s*)?(?P<ref>{_URL}|commit:\S+|\S.*)$")
SUMMARY_MAX = 80


@dataclass(frozen=True)
class LintProblem:
    patch: str
    message: str

    def __str__(self) -> str:
        return f"{self.patch}: {self.message}"


def lint_header(patch: Patch) -> list[LintProblem]:
    """Check one patch's DEP-3 header."""
    f = patch.fields
    out: list[LintProblem] = []

    def bad(msg: str) -> None:
        out.append(LintProblem(patch.name, msg))

    description = f.get("Description") or f.get("Subject")
    if not description:
        bad("missing Description (or Subject): say what the patch does and why")
    elif len(description.splitlines()[0]) > SUMMARY_MAX:
        bad(f"Description summary line is {len(description.splitlines()[0])} chars; keep it <= {SUMMARY_MAX}")
    for key in REQUIRED[1:]:
        if not f.get(key) and not (key == "Origin" and f.get("Author")):
            bad(f"missing {key}")
    origin = f.get("Origin")
    if origin:
        m = _ORIGIN.match(origin)
        if m is None or (m["cat"] is not None and m["cat"] not in ORIGIN_CATEGORIES):
            bad(f"Origin {origin!r}: category must be one of {', '.join(ORIGIN_CATEGORIES)}")
        elif m["cat"] in ("upstream", "backport") and not re.match(rf"^({_URL}|commit:\S+)$", m["ref"]):
            bad(f"Origin {origin!r}: an upstream/backport origin needs a URL or commit:<id>")
    if f.get("Bug") and not _BUG.match(f["Bug"]):
        bad(f"Bug {f['Bug']!r}: expected a URL or 'none'")
    elif f.get("Bug") and _CHANGE_URL.search(f["Bug"]):
        bad(f"Bug {f['Bug']!r} is a change, not a bug report: name the issue the patch fixes (or "
            "'none'); an upstream fix goes in Applied-Upstream or the description")
    if f.get("Forwarded") and not _FORWARDED.match(f["Forwarded"]):
        bad(f"Forwarded {f['Forwarded']!r}: expected no, not-needed, yes or a URL")
    if f.get("Applied-Upstream") and not _APPLIED.match(f["Applied-Upstream"]):
        bad(f"Applied-Upstream {f['Applied-Upstream']!r}: expected a version, URL, commit:<id> or 'no'")
    if f.get("Last-Update"):
        try:
            _dt.date.fromisoformat(f["Last-Update"])
        except ValueError:
            bad(f"Last-Update {f['Last-Update']!r}: expected YYYY-MM-DD")
    if SMOKE_FIELD in f:
        try:
            parse_smoke(f[SMOKE_FIELD])
        except ValueError as exc:
            bad(f"{SMOKE_FIELD} {f[SMOKE_FIELD]!r} is not a smoke command: {exc}")
    return out


def sdist_paths(pin: BasePin, sdist: Path) -> set[str]:
    """Files under the pinned members in the sdist (sdist-relative posix paths)."""
    prefix = pin.sdist_root + "/"
    with tarfile.open(sdist, "r:gz") as tar:
        return {
            m.name[len(prefix):]
            for m in tar.getmembers()
            if m.isfile() and m.name.startswith(prefix)
            and any(m.name[len(prefix):].startswith(member + "/") for member in pin.members)
        }


def lint_paths(pin: BasePin, patches: list[Patch], base_files: set[str], overlay: Overlay) -> list[LintProblem]:
    """Each patch may only modify files the sdist has; new files belong in the overlay, and overlay files are
    edited there, not by patches."""
    out: list[LintProblem] = []
    present = set(base_files)
    in_overlay = set(overlay.paths) - base_files  # an overlay copy of a base file is reported by lint_overlay
    for patch in patches:
        for old, new in patch.touched_files():
            path = new if old == "/dev/null" else old
            if not any(path.startswith(m + "/") for m in pin.members):
                out.append(LintProblem(patch.name, f"touches {path}, outside {', '.join(pin.members)}"))
                continue
            if path in in_overlay:
                out.append(LintProblem(patch.name, f"touches {path}, a file of the overlay: change "
                                                   f"{source_name(path)} itself and drop it from the patch"))
                continue
            if old == "/dev/null":
                out.append(LintProblem(patch.name, f"creates {new}; a file upstream does not have belongs in "
                                                   f"the overlay: move it to {source_name(new)} and drop it from "
                                                   "the patch"))
                present.add(new)
            elif old not in present:
                out.append(LintProblem(patch.name, f"modifies {old}, which does not exist in the {pin.filename} sdist"))
            elif new == "/dev/null":
                present.discard(old)
    return out


_PLAIN_PATH = re.compile(r"[A-Za-z0-9_.+/-]+")


def lint_overlay(pin: BasePin, overlay: Overlay, base_files: set[str]) -> list[LintProblem]:
    """The overlay only adds files: none may be a file of the sdist. Its paths need no quoting in a shell:
    ``scripts/patchset overlay`` prints them one a line for ``mypy hfsdp $(scripts/patchset overlay)``."""
    problems = [LintProblem("overlay", f"{source_name(path)} is a file of the {pin.filename} sdist; the overlay "
                                       "only adds files: make the change to it a patch and delete the overlay copy")
                for path in overlay.paths if path in base_files]
    problems += [LintProblem("overlay", f"{source_name(path)!r} has a character a shell splits or expands in its "
                                        "path (`$(scripts/patchset overlay)` would pass it wrong): rename it with "
                                        "letters, digits, '.', '_', '-' and '+' only")
                 for path in overlay.paths if _PLAIN_PATH.fullmatch(path) is None]
    return problems


def lint_line_endings(patch: Patch) -> list[LintProblem]:
    """A patch saved with CRLF line endings (its header or diff lines, not the content of a CRLF file)."""
    number = crlf_line(patch.text, patch.header_text.count("\n"))
    return [] if number is None else [LintProblem(patch.name, f"has CRLF line endings (line {number}); save it "
                                                              "with LF endings")]


def lint(project: Project, sdist: Path | None = None, chains: bool = False) -> list[LintProblem]:
    """All problems in the series and the overlay; an empty list means clean. ``chains``: also the rewrite
    chains ([Note: rewrite chains] in chains.py), which builds the series."""
    pin = project.pin()
    where = project.base_label
    names = read_series_names(project.base_dir / "series")
    problems: list[LintProblem] = []
    for name in project.unlisted(names):
        problems.append(LintProblem(name, f"is in {where} but not listed in {where}series"))
    shared = None if project.base is None else project.patches_dir
    patches: list[Patch] = []
    for name in names:
        try:
            patches.append(read_patch(patch_path(project.base_dir, name, shared), name))
        except PatchsetError as exc:
            problems.append(LintProblem(name, exc.cause))
    for patch in patches:
        problems.extend(lint_header(patch))
        problems.extend(lint_line_endings(patch))
    overlay, overlay_problems = scan_overlay(project.overlay_dir, pin.members)
    problems.extend(LintProblem("overlay", message) for message in overlay_problems)
    source = locate_sdist(pin, sdist)
    base_files = sdist_paths(pin, source)
    problems.extend(lint_overlay(pin, overlay, base_files))
    problems.extend(lint_paths(pin, patches, base_files, overlay))
    if chains and (len(patches) < len(names) or overlay_problems):
        problems.append(LintProblem("series", "rewrite chains were not checked: the series cannot be built until "
                                              "the problems above are fixed"))
    elif chains:
        problems.extend(LintProblem(name, message) for name, message in rewrite_chains(pin, source, patches, overlay))
    return problems
