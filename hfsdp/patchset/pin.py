"""The base pin (``patches/base.toml``): which upstream release the series applies to."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfsdp.usererror import not_a_regular_file

from .errors import SeriesError


@dataclass(frozen=True)
class BasePin:
    """The pinned upstream sdist plus the fork's identity."""

    distribution: str  # PyPI project name, e.g. "megatron-core"
    version: str  # upstream release the series targets, e.g. "0.18.2"
    filename: str  # sdist file name, e.g. "megatron_core-0.18.2.tar.gz"
    sha256: str  # checked before anything is extracted
    url: str  # direct download URL of the sdist
    index_url: str  # PEP 691 simple index used when url is unreachable
    members: tuple[str, ...]  # sdist-relative paths that are materialized
    fork_name: str  # local-version label, e.g. "hfsdp"
    fork_release: int  # bumped when the series changes in a user-visible way

    @property
    def fork_version(self) -> str:
        """PEP 440 version with a local label, e.g. ``0.18.2+hfsdp.1``."""
        return f"{self.version}+{self.fork_name}.{self.fork_release}"

    @property
    def sdist_root(self) -> str:
        """Top-level directory inside the sdist tarball."""
        return self.filename.removesuffix(".tar.gz")


_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")  # a PyPI project name (PEP 508)
_VERSION = re.compile(r"[0-9][0-9A-Za-z.!+_-]*")  # a release, as it appears in the sdist's file name
_LABEL = re.compile(r"[a-z][a-z0-9]*")  # a local-version label that PEP 440 keeps as it is
_URL = re.compile(r"(https?|file)://\S+")
_FIX = "fix patches/base.toml (or restore it from git)"
_MISSING = object()


def _bad(path: Path, field: str, value: object, want: str) -> SeriesError:
    shown = "missing" if value is _MISSING else f"{value!r} ({type(value).__name__})"
    return SeriesError(f"base pin {path}: {field} is {shown}; it must be {want}", _FIX)


def _table(path: Path, data: dict, name: str) -> dict:
    table = data.get(name, _MISSING)
    if not isinstance(table, dict):
        raise _bad(path, f"[{name}]", table, "a table")
    return table


def _field(path: Path, table: dict, section: str, key: str, want: str, ok: Callable[[object], bool],
           default: object = _MISSING) -> Any:
    value = table.get(key, default)
    if value is _MISSING or not ok(value):
        raise _bad(path, f"[{section}] {key}", value, want)
    return value


def _text(pattern: re.Pattern[str] | None = None) -> Callable[[object], bool]:
    return lambda v: isinstance(v, str) and bool(v) and (pattern is None or pattern.fullmatch(v) is not None)


def is_relative_path(value: object) -> bool:
    """A relative posix path that stays where it is put: no empty, ``.`` or ``..`` part (so no leading, doubled
    or trailing ``/``), no NUL."""
    return isinstance(value, str) and "\0" not in value and all(p not in ("", ".", "..") for p in value.split("/"))


def is_tree_path(value: object) -> bool:
    """A path of the tree as this tool writes it: ``megatron/<something>``, a relative path (see above). A pinned
    member, and every path a stamp names, is one (a stamp naming a path outside the tree is never read: diff
    and refresh write and delete the paths it names); an overlay file is one below a member."""
    return isinstance(value, str) and value.startswith("megatron/") and is_relative_path(value)


def is_digest(value: object) -> bool:
    """A sha256 as this tool writes it: 64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def load_pin(path: Path) -> BasePin:
    """Read and validate ``patches/base.toml``: every field of the type and form this tool relies on."""
    if (why := not_a_regular_file(path)) is not None:  # a named pipe would block the read, /dev/null read as empty
        why = "is missing" if why == "does not exist" else why
        raise SeriesError(f"base pin {path} {why}", "restore patches/base.toml from git")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise SeriesError(f"base pin {path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                          "restore patches/base.toml from git") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SeriesError(f"base pin {path} is not valid TOML: {exc}", "fix the syntax") from exc
    base, fork = _table(path, data, "base"), _table(path, data, "fork")
    url = "an http(s) or file URL"
    members = _field(path, base, "base", "members", "a non-empty list of folders of the sdist under megatron/, "
                     "e.g. [\"megatron/core\", \"megatron/training\"]",
                     lambda v: isinstance(v, list) and bool(v) and all(is_tree_path(m) for m in v)
                     and len(set(v)) == len(v))
    pin = BasePin(
        distribution=_field(path, base, "base", "distribution", "a PyPI project name, e.g. \"megatron-core\"",
                            _text(_NAME)),
        version=_field(path, base, "base", "version", "a release as a string, e.g. \"0.18.2\"", _text(_VERSION)),
        filename=_field(path, base, "base", "filename", "the sdist's file name, e.g. \"megatron_core-0.18.2.tar.gz\"",
                        _text()),
        sha256=_field(path, base, "base", "sha256", "the sdist's sha256: 64 hex digits, as a string",
                      lambda v: isinstance(v, str) and is_digest(v.lower())).lower(),  # upper case is read too
        url=_field(path, base, "base", "url", url, _text(_URL)),
        index_url=_field(path, base, "base", "index_url", url, _text(_URL), default="https://pypi.org/simple"),
        members=tuple(members),
        fork_name=_field(path, fork, "fork", "name", "a lowercase label (letters and digits, starting with a "
                         "letter), e.g. \"hfsdp\"", _text(_LABEL)),
        fork_release=_field(path, fork, "fork", "release", "a whole number >= 0, e.g. 2 (not \"2\", 2.0 or true)",
                            lambda v: type(v) is int and v >= 0),
    )
    expected = f"{pin.distribution.replace('-', '_')}-{pin.version}.tar.gz"
    if pin.filename != expected:
        raise SeriesError(f"base pin {path}: [base] filename {pin.filename!r} is not the sdist of "
                          f"{pin.distribution}=={pin.version}, which is named {expected!r}", _FIX)
    return pin
