"""Where things live in a checkout of this project."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .pin import BasePin, load_pin
from .series import Patch, read_series


@dataclass(frozen=True)
class Project:
    """A checkout: ``patches/`` (series + base pin) and the materialized ``megatron/``."""

    root: Path

    @staticmethod
    def default() -> Project:
        # hfsdp/patchset/project.py -> repository root is two folders up from the package.
        return Project(Path(__file__).resolve().parents[2])

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def megatron_dir(self) -> Path:
        return self.root / "megatron"

    def pin(self) -> BasePin:
        return load_pin(self.patches_dir / "base.toml")

    def series(self) -> list[Patch]:
        return read_series(self.patches_dir)
