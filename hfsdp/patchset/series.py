"""``patches/series`` and the patch files it lists (DEP-3 header + git diff)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from hfsdp.usererror import not_a_regular_file, quoted

from .errors import SeriesError

_FIELD = re.compile(r"^(?P<key>[A-Za-z][A-Za-z0-9-]*):(?P<value>.*)$")
_DIFF_PATH = re.compile(r"^diff --git a/(?P<a>\S+) b/(?P<b>\S+)$")
HEADER_END = "---"
BOM = "\ufeff"  # a byte-order mark some editors put first; refused at the start of a patch (read_patch)

# [Note: patch names] One rule for every patch name, wherever one is taken or read: a series line,
# `refresh --new`/`--patch`, `export --drop`, a queue commit's subject (each given with or without
# ``.patch``: :func:`as_patch_name`). Lowercase letters, digits,
# '-' and '.', starting with a letter or digit, no '..', at most 100 characters before ``.patch``.
# Such a name cannot start a comment in ``series`` ('#'), leave ``patches/`` ('/', '..'), or need
# quoting in a shell, so what ``refresh``/``export`` write is always read back as the same patch.
# ``overlay.patch`` is reserved: ``overlay`` is the subject of every queue's overlay commit
# ([Note: the queue] in tree.py), which must never be read as a patch.
_PATCH_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{0,99}\.patch")
RESERVED_NAMES = ("overlay.patch",)
NAME_RULE = ("lowercase letters, digits, '-' and '.' (no '..'), starting with a letter or digit, "
             "not 'overlay'")


def is_patch_name(name: str) -> bool:
    """Whether ``name`` (a file name, ``.patch`` included) follows the note's rule; ``x.patch.patch``
    does not (a name given with its suffix once too often)."""
    return (_PATCH_NAME.fullmatch(name) is not None and ".." not in name and name not in RESERVED_NAMES
            and not name.removesuffix(".patch").endswith(".patch"))


def as_patch_name(text: str) -> str:
    """The file name that ``text`` (a command-line name or a queue commit's subject, with or without
    ``.patch``) stands for; whether it follows the rule is :func:`is_patch_name`'s to say."""
    text = text.strip()
    return text if text.endswith(".patch") else f"{text}.patch"


def _suggest(text: str) -> str:
    """A name that follows the rule, made from ``text`` (for error messages)."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower().removesuffix(".patch")).strip("-")[:100] or "my-change"
    return "my-overlay-change" if f"{name}.patch" in RESERVED_NAMES else name


def patch_name(text: str, option: str) -> str:
    """A patch named on the command line (``NAME`` or ``NAME.patch``) as its file name; refuses any
    other name (see the note) before anything is written."""
    name = as_patch_name(text)
    if not is_patch_name(name):
        raise SeriesError(f"{option} {text!r} is not a patch name; nothing was written",
                          f"name patches with {NAME_RULE}, e.g. {option} {_suggest(text)}")
    return name


@dataclass(frozen=True)
class Patch:
    """One patch file: its DEP-3 header fields, the raw header text and the diff."""

    name: str  # file name as listed in series
    path: Path
    header_text: str  # everything before the ``---`` separator, verbatim
    fields: dict[str, str]  # DEP-3 fields, continuation lines joined with "\n"
    diff: str  # ``diff --git ...`` onwards
    text: str = ""  # the whole file as read (once: the stamp records exactly what was applied)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def stem(self) -> str:
        return self.name.removesuffix(".patch")

    def touched_files(self) -> list[tuple[str, str]]:
        """(old path, new path) of each file the diff touches; /dev/null for creations."""
        out: list[tuple[str, str]] = []
        old = new = ""
        for line in self.diff.splitlines():
            if (m := _DIFF_PATH.match(line)) is not None:
                old, new = m["a"], m["b"]
                out.append((old, new))
            elif line.startswith("new file mode") and out:
                out[-1] = ("/dev/null", out[-1][1])
            elif line.startswith("deleted file mode") and out:
                out[-1] = (out[-1][0], "/dev/null")
        return out


_STRUCTURAL = ("diff --git ", "index ", "--- ", "+++ ", "new file mode", "deleted file mode")
_BARE_HUNK = re.compile(r"@@ -\d+(,\d+)? \+\d+(,\d+)? @@\r")


def crlf_line(text: str, header_lines: int = 0) -> int | None:
    """The first line (from 1) of a patch text saved with CRLF line endings, or None: one of its first
    ``header_lines`` lines (the DEP-3 header) or a line of the diff's own syntax ending in CR. The content
    lines of a file that itself has CRLF endings end in CR rightly, and are not counted."""
    for number, line in enumerate(text.split("\n"), start=1):
        if line.endswith("\r") and (number <= header_lines or line.startswith(_STRUCTURAL)
                                    or _BARE_HUNK.fullmatch(line)):
            return number
    return None


def parse_header(text: str) -> dict[str, str]:
    """Parse DEP-3 ``Key: value`` lines; indented lines continue the previous field."""
    fields: dict[str, str] = {}
    key: str | None = None
    for line in text.splitlines():
        if not line.strip():
            key = None
            continue
        if line[0] in " \t" and key is not None:
            fields[key] += "\n" + line.strip()
            continue
        match = _FIELD.match(line)
        if match is None:
            key = None  # free-form text is allowed in a DEP-3 header
            continue
        key = match["key"]
        fields[key] = match["value"].strip()
    return fields


def read_patch(path: Path, name: str | None = None) -> Patch:
    """Read a patch file once and split it into its header and its diff."""
    if (why := not_a_regular_file(path)) is not None:
        raise SeriesError(f"patch {path.name} is listed in patches/series but {path} {why}",
                          "restore the file or remove its line from patches/series")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SeriesError(f"patch {path} is not UTF-8 text ({exc})", "restore it from git") from exc
    if text.startswith(BOM):  # one answer for every verb: status, materialize, check, lint, queue, export
        raise SeriesError(f"patch {path} starts with a UTF-8 byte-order mark (BOM), which would hide the first "
                          "line of its header; nothing was changed", "remove the BOM: "
                          f"`sed -i '1s/^\\xEF\\xBB\\xBF//' {quoted(path)}` (or save it without one)")
    return parse_patch(name or path.name, text, path)


def parse_patch(name: str, text: str, path: Path) -> Patch:
    """Split patch ``text`` into its DEP-3 header and its diff."""
    header_lines: list[str] = []
    lines = text.splitlines(keepends=True)
    for index, line in enumerate(lines):
        if line.rstrip("\n") == HEADER_END or line.startswith("diff --git "):
            start = index + 1 if line.rstrip("\n") == HEADER_END else index
            diff = "".join(lines[start:])
            break
        header_lines.append(line)
    else:
        raise SeriesError(f"patch {name} has no diff", "a patch is a DEP-3 header, a '---' line, then a git diff")
    if "diff --git " not in diff:
        raise SeriesError(f"patch {name} has no 'diff --git' section", "regenerate it with scripts/patchset export")
    header_text = "".join(header_lines)
    return Patch(name, path, header_text, parse_header(header_text), diff, text)


def read_series_names(series_path: Path) -> list[str]:
    """Patch names in order; ``#`` comments and blank lines are ignored."""
    if (why := not_a_regular_file(series_path)) is not None:
        why = "is missing" if why == "does not exist" else why
        raise SeriesError(f"{series_path} {why}", "restore patches/series from git")
    try:
        raw = series_path.read_bytes().decode("utf-8-sig")  # a byte-order mark some editors add is not a name
    except UnicodeDecodeError as exc:
        raise SeriesError(f"{series_path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                          "restore patches/series from git, or save it as UTF-8 text") from exc
    names: list[str] = []
    for number, line in enumerate(raw.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        words = entry.split()
        if len(words) > 1 and is_patch_name(words[0]):
            extra = " ".join(words[1:])
            options = all(w.startswith("-") for w in words[1:])
            why = ("quilt's options are not read: every patch applies with -p1 (a/ and b/ prefixes)" if options
                   else "one patch name a line")
            raise SeriesError(f"{series_path}:{number}: {entry!r} has {extra!r} after the patch name; {why}",
                              f"leave only {words[0]} on that line"
                              + ("" if options else ", and put each other name on a line of its own"))
        if not is_patch_name(entry):
            comment = f" ('#' starts a comment, which leaves {entry!r})" if "#" in line else ""
            raise SeriesError(
                f"{series_path}:{number}: {line.strip()!r} is not a patch name{comment}",
                f"a patch name is {NAME_RULE}, then .patch: rename the patch file and its line to such a name "
                f"(e.g. {_suggest(line.strip())}.patch), or remove the line",
            )
        if entry in names:
            raise SeriesError(f"{series_path}:{number}: {entry} is listed twice", "remove the duplicate line")
        names.append(entry)
    return names


def unlisted_patches(patches_dir: Path, names: list[str]) -> list[str]:
    """Patch files in ``patches_dir`` that the series (``names``) does not list: a patch that is never applied."""
    return sorted(p.name for p in patches_dir.glob("*.patch") if p.name not in names)


def patch_path(base_dir: Path, name: str, shared: Path | None = None) -> Path:
    """Where the patch ``name`` of the series in ``base_dir`` is: that folder's own file, else (a base other
    than the default, [Note: bases] in project.py) the shared one in ``shared``."""
    own = base_dir / name
    return own if shared is None or own.exists() or not (shared / name).exists() else shared / name


def read_series(patches_dir: Path, shared: Path | None = None) -> list[Patch]:
    """Load every patch of the series in ``patches_dir``, in order (``shared``: see :func:`patch_path`)."""
    return [read_patch(patch_path(patches_dir, name, shared), name)
            for name in read_series_names(patches_dir / "series")]


def render_patch(header_text: str, diff: str) -> str:
    """Serialize a patch deterministically: header, separator, diff, one trailing newline."""
    header = header_text.rstrip("\n") + "\n"
    return f"{header}{HEADER_END}\n{diff.rstrip(chr(10))}\n"
