"""Errors raised by the patch tooling.

Every error names the cause and the way out, because these messages surface inside
``pip install -e .`` output where users have nothing else to go on.
"""

from __future__ import annotations


class PatchsetError(Exception):
    """Base class: ``cause`` says what went wrong, ``fix`` says what to do about it."""

    exit_code = 2

    def __init__(self, cause: str, fix: str) -> None:
        self.cause = cause
        self.fix = fix
        super().__init__(f"{cause}\n  -> {fix}")


class HashMismatch(PatchsetError):
    """The sdist's sha256 differs from the pin; nothing was extracted."""


class WrongBaseVersion(PatchsetError):
    """The source given is not the pinned megatron-core release."""


class SourceUnavailable(PatchsetError):
    """No sdist could be found locally and downloading is impossible or failed."""


class PatchDoesNotApply(PatchsetError):
    """A patch in the series failed to apply; the materialized tree was left untouched."""

    def __init__(self, patch: str, files: list[str], detail: str) -> None:
        self.patch = patch
        self.files = files
        where = ", ".join(files) if files else "(git did not name a file)"
        super().__init__(
            f"patch {patch} does not apply without fuzz (file: {where}).\n{detail.strip()}",
            f"rebase it: `scripts/patchset queue --dir /tmp/pq`, fix the commit for {patch} there, "
            "then `scripts/patchset export --queue /tmp/pq`. The materialized tree was not changed.",
        )


class DirtyTree(PatchsetError):
    """The materialized tree has local edits that a rebuild would destroy."""


class ForeignTree(PatchsetError):
    """``megatron/`` exists but was not made by this tool (no stamp)."""


class StaleTree(PatchsetError):
    """The materialized tree does not match patches/series or the base pin."""


class SeriesError(PatchsetError):
    """patches/series or a patch file is malformed."""


class ToolMissing(PatchsetError):
    """A required external tool (git) is missing."""
