"""The error of a model that cannot be built in this environment.

Its own module because both sides raise it: spec selection (hfsdp/training/specs.py: an unknown
family, a spec this tree lacks) and the optional-package checks it relies on
(hfsdp/training/requirements.py: a package the flags need is missing), which specs imports.
"""

from __future__ import annotations


class SpecError(RuntimeError):
    """A requested model family or layer spec cannot be built in this environment."""
