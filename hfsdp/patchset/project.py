"""Where things live in a checkout of this project, for one of its bases.

[Note: bases] A checkout serves several upstream releases ("bases"). The default base is
``patches/base.toml`` with ``patches/series``; every other base is a folder
``patches/bases/<version>/`` holding its own ``base.toml`` and ``series``, and only the patch files
that differ for that base (a variant of a shared patch, under the same name, or a patch no other
base has). A name in a base's series is read from the base's folder first, then from ``patches/``.
The overlay (``patches/overlay/``) is shared by all bases. So ``ls patches/bases/<version>/`` shows
what is different for a base, and each ``series`` what applies to it.

One base is chosen per command: ``--base VERSION`` of ``scripts/patchset``, else the environment
variable ``HFSDP_BASE`` (which ``pip install -e .`` reads too), else the default. The tree's stamp
records the base it was built from; a tree of another base is rebuilt like a stale one (refused
while it has edits), so switching bases never loses an edit. ``refresh`` and ``export`` on a base
other than the default write its folder only: its series, a new patch, a variant for a shared patch
they change; they refuse overlay changes, which would reach every base.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import SeriesError
from .overlay import OVERLAY_DIR_NAME, Overlay, read_overlay
from .pin import BasePin, load_pin
from .series import Patch, read_series, unlisted_patches

BASES_DIR_NAME = "bases"  # patches/bases/<version>/: the bases other than the default (see the note)
BASE_ENV = "HFSDP_BASE"  # the install-time switch
_BASE_NAME = re.compile(r"[0-9][0-9A-Za-z.+_-]{0,63}")  # a release, as a folder name: no '/', no leading '.'


@dataclass(frozen=True)
class Project:
    """A checkout: ``patches/`` (pins, series, overlay) and the materialized ``megatron/``, seen through one
    base (``base`` None: the default, ``patches/base.toml``)."""

    root: Path
    base: str | None = None

    @staticmethod
    def default() -> Project:
        # hfsdp/patchset/project.py -> repository root is two folders up from the package.
        return Project(Path(__file__).resolve().parents[2])

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def base_dir(self) -> Path:
        """Where this base's ``base.toml``, ``series`` and own patch files are (see the note)."""
        return self.patches_dir if self.base is None else self.patches_dir / BASES_DIR_NAME / self.base

    @property
    def base_label(self) -> str:
        """``patches/`` or ``patches/bases/<version>/``, for messages."""
        return self.base_dir.relative_to(self.root).as_posix() + "/"

    @property
    def overlay_dir(self) -> Path:
        """``patches/overlay``: our whole files, at their ``megatron/`` paths ([Note: the overlay] in overlay.py)."""
        return self.patches_dir / OVERLAY_DIR_NAME

    @property
    def megatron_dir(self) -> Path:
        return self.root / "megatron"

    def pin(self) -> BasePin:
        return load_pin(self.base_dir / "base.toml")

    def series(self) -> list[Patch]:
        return read_series(self.base_dir, shared=None if self.base is None else self.patches_dir)

    def unlisted(self, names: list[str]) -> list[str]:
        """Patch files of this base's folder that its series (``names``) does not list: never applied."""
        return unlisted_patches(self.base_dir, names)

    def overlay(self) -> Overlay:
        """The overlay's files and texts; an entry that cannot be an overlay file is refused (SeriesError)."""
        return read_overlay(self.overlay_dir, self.pin().members)

    def overlay_files(self) -> list[str]:
        """The overlay's files as ``megatron/...`` paths relative to the checkout, sorted: where each is
        materialized (e.g. for type checkers, which read the materialized copies)."""
        return self.overlay().paths

    def bases(self) -> list[str]:
        """The versions of every base of the checkout, the default first."""
        others = self.patches_dir / BASES_DIR_NAME
        found = sorted(p.name for p in others.iterdir() if (p / "base.toml").is_file()) if others.is_dir() else []
        return [Project(self.root).pin().version, *found]

    def with_base(self, version: str | None) -> Project:
        """This checkout seen through the base ``version`` (None: ``HFSDP_BASE``, else the default)."""
        chosen = version if version is not None else os.environ.get(BASE_ENV, "").strip() or None
        if chosen is None:
            return dataclasses.replace(self, base=None)
        where = "--base" if version is not None else BASE_ENV
        default = Project(self.root)
        if (default.patches_dir / "base.toml").is_file() and chosen == default.pin().version:
            return dataclasses.replace(self, base=None)
        folder = self.patches_dir / BASES_DIR_NAME / chosen
        if _BASE_NAME.fullmatch(chosen) is None or not (folder / "base.toml").is_file():
            raise SeriesError(f"{where} {chosen!r} is not a base of this checkout (its bases: "
                              f"{', '.join(self.bases())})",
                              f"choose one of those ({where}=VERSION), or add the base as "
                              f"patches/{BASES_DIR_NAME}/<version>/base.toml and series")
        return dataclasses.replace(self, base=chosen)

    def command(self, rest: str) -> str:
        """``scripts/patchset REST`` as a user reruns it on this base (``--base`` named for any but the default)."""
        return f"scripts/patchset{'' if self.base is None else f' --base {self.base}'} {rest}"

    def for_stamp(self, version: str, sha256: str) -> Project | None:
        """The base of this checkout pinned to ``version`` with sdist ``sha256`` (a tree's stamp), or None."""
        for name in self.bases():
            candidate = self.with_base(name)
            pin = candidate.pin()
            if pin.version == version and pin.sha256 == sha256:
                return candidate
        return None
