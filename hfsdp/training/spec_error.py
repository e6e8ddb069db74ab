"""The error of a model that cannot be built in this environment.

Its own module because both sides raise it: spec selection (hfsdp/training/specs.py: an unknown
family, a spec this tree lacks) and the optional-package checks it relies on
(hfsdp/training/requirements.py: a package the flags need is missing), which specs imports.
"""

from __future__ import annotations

from hfsdp.usererror import UserError


class SpecError(RuntimeError):
    """A requested model family or layer spec cannot be built in this environment."""

    # Its own sentence and way out, where it has them (requirements.MissingPackage); else str(self).
    cause: str | None = None
    fix: str | None = None

    def user_error(self, fix: str) -> UserError:
        """This refusal as a tool says it: its message, and its own way out or ``fix``."""
        return UserError(self.cause or str(self), self.fix or fix)
