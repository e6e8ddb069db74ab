"""The base pin (``patches/base.toml``): which upstream release the series applies to."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

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


def load_pin(path: Path) -> BasePin:
    """Read and validate ``patches/base.toml``."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SeriesError(f"base pin {path} is missing", "restore patches/base.toml from git") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SeriesError(f"base pin {path} is not valid TOML: {exc}", "fix the syntax") from exc
    try:
        base, fork = data["base"], data["fork"]
        pin = BasePin(
            distribution=str(base["distribution"]),
            version=str(base["version"]),
            filename=str(base["filename"]),
            sha256=str(base["sha256"]).lower(),
            url=str(base["url"]),
            index_url=str(base.get("index_url", "https://pypi.org/simple")),
            members=tuple(str(m) for m in base["members"]),
            fork_name=str(fork["name"]),
            fork_release=int(fork["release"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SeriesError(
            f"base pin {path} lacks or mistypes a field: {exc}",
            "it needs [base] distribution/version/filename/sha256/url/members and [fork] name/release",
        ) from exc
    if len(pin.sha256) != 64 or any(c not in "0123456789abcdef" for c in pin.sha256):
        raise SeriesError(f"base pin sha256 {pin.sha256!r} is not a sha256 hex digest", "fix patches/base.toml")
    if not pin.filename.startswith(pin.distribution.replace("-", "_") + "-" + pin.version):
        raise SeriesError(
            f"base pin filename {pin.filename!r} does not match {pin.distribution}=={pin.version}",
            "fix patches/base.toml",
        )
    return pin
