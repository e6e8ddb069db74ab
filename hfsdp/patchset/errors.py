"""Errors raised by the patch tooling.

Every error names the cause and the way out, because these messages surface inside
``pip install -e .`` output where users have nothing else to go on. Every command a ``fix``
suggests is run by a test (tests/unit_tests/patchset/test_advice.py); ``DIR`` in a fix stands
for a new folder of the user's choice.
"""

from __future__ import annotations

from collections.abc import Callable

from hfsdp.usererror import UserError, quoted


class PatchsetError(UserError):
    """Base class: ``cause`` says what went wrong, ``fix`` says what to do about it (exit status 2)."""


class HashMismatch(PatchsetError):
    """The sdist's sha256 differs from the pin; nothing was extracted. ``pin_is_wrong``: the file has the sha256
    the index publishes for it, so the pin is what differs."""

    def __init__(self, cause: str, fix: str, pin_is_wrong: bool = False) -> None:
        super().__init__(cause, fix)
        self.pin_is_wrong = pin_is_wrong


class WrongBaseVersion(PatchsetError):
    """The source given is not the pinned megatron-core release."""


class SourceUnavailable(PatchsetError):
    """No sdist could be found locally and downloading is impossible or failed."""


class PatchDoesNotApply(PatchsetError):
    """A patch in the series failed to apply; the materialized tree was left untouched. ``line_endings``: the
    patch was saved with CRLF line endings (then no rebase helps: the file is fixed instead)."""

    def __init__(self, patch: str, files: list[str], detail: str, line_endings: bool = False,
                 command: Callable[[str], str] = lambda rest: f"scripts/patchset {rest}") -> None:
        self.patch = patch
        self.files = files
        self.detail = detail
        self.line_endings = line_endings
        where = ", ".join(files) if files else "(git did not name a file)"
        if line_endings:
            super().__init__(
                f"patch {patch} does not apply: it was saved with CRLF (Windows) line endings, so no line of it "
                f"matches (file: {where}). Nothing was changed",
                f"restore it with LF endings: `git checkout {quoted(f'patches/{patch}')}` (the committed copy), or "
                "save it with LF line endings in your editor; `scripts/patchset lint` names every such patch",
            )
            return
        super().__init__(
            f"patch {patch} does not apply without fuzz (file: {where}).\n{detail.strip()}",
            f"rebase it in a queue: `{command('queue --dir DIR')}` (DIR: a new folder) stops at {patch} "
            "with the hunks that fit applied and the others in .rej files; apply those by hand, delete the "
            f"*.rej files, run `{command('queue --continue --dir DIR')}`, then `{command('export --queue DIR')}`. "
            "The materialized tree was not changed.",
        )

    def naming(self, command: Callable[[str], str]) -> PatchDoesNotApply:
        """The same error, its commands spelled by ``command`` (``Project.command``: ``--base`` where needed)."""
        return PatchDoesNotApply(self.patch, self.files, self.detail, self.line_endings, command)


class DirtyTree(PatchsetError):
    """The materialized tree has local edits that a rebuild would destroy."""


class ForeignTree(PatchsetError):
    """``megatron/`` exists but was not made by this tool (no stamp)."""


class StaleTree(PatchsetError):
    """The materialized tree does not match patches/series or the base pin."""


class SeriesError(PatchsetError):
    """patches/series or a patch file is malformed."""


class LinkedTree(PatchsetError):
    """``megatron/``, or a folder of it, is a symbolic link; through it every file would look deleted."""


class ToolMissing(PatchsetError):
    """A required external tool (git) is missing."""


# The way out for a tree with local edits whose patches changed since it was built (a pull);
# the test suite runs each of these commands (tests/unit_tests/patchset/test_advice.py).
REBASE_EDITS_FIX = (
    "the edits were made on the tree of the previous patches, so they cannot be folded into the current "
    "ones directly. Carry them over: `scripts/patchset diff > my.patch` (exactly your edits, against the "
    "tree as it was built), `scripts/patchset materialize --backup` (rebuilds; the edited tree is kept as "
    "megatron.bak-*), `git apply --reject my.patch` (re-applies them; a hunk whose lines the new patches "
    "changed too is left in a .rej file beside its file: make that change by hand, then delete the .rej "
    "file), then fold them into a patch: `scripts/patchset refresh` (into the patch that owns the files) or "
    "`scripts/patchset refresh --new NAME` (a new patch at the end)."
)
