"""Where things live in a checkout of this project."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .overlay import OVERLAY_DIR_NAME, Overlay, read_overlay
from .pin import BasePin, load_pin
from .series import Patch, read_series


@dataclass(frozen=True)
class Project:
    """A checkout: ``patches/`` (series, base pin, overlay) and the materialized ``megatron/``."""

    root: Path

    @staticmethod
    def default() -> Project:
        # hfsdp/patchset/project.py -> repository root is two folders up from the package.
        return Project(Path(__file__).resolve().parents[2])

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def overlay_dir(self) -> Path:
        """``patches/overlay``: our whole files, at their ``megatron/`` paths ([Note: the overlay] in overlay.py)."""
        return self.patches_dir / OVERLAY_DIR_NAME

    @property
    def megatron_dir(self) -> Path:
        return self.root / "megatron"

    def pin(self) -> BasePin:
        return load_pin(self.patches_dir / "base.toml")

    def series(self) -> list[Patch]:
        return read_series(self.patches_dir)

    def overlay(self) -> Overlay:
        """The overlay's files and texts; an entry that cannot be an overlay file is refused (SeriesError)."""
        return read_overlay(self.overlay_dir, self.pin().members)

    def overlay_files(self) -> list[str]:
        """The overlay's files as ``megatron/...`` paths relative to the checkout, sorted: where each is
        materialized (e.g. for type checkers, which read the materialized copies)."""
        return self.overlay().paths
