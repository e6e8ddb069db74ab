# hfsdp: identity of the patched megatron-core tree (added by the fork-identity patch).
"""Which fork, base release and patches this ``megatron`` tree was materialized from.

The tree is built by ``scripts/patchset materialize`` (or ``pip install -e .``), which writes
``megatron/.patchset-stamp.json``. Importing ``megatron.core`` calls :func:`verify_tree`, so a
tree that is not stamped, or that no longer matches ``patches/series`` in its checkout, fails
fast instead of running code nobody reviewed. Set ``HFSDP_SKIP_FORK_GUARD=1`` to bypass this
while working inside a patch queue.
"""

import json
import os
from pathlib import Path

FORK_NAME = "hfsdp"
BASE_VERSION = "0.18.2"
_TREE = Path(__file__).resolve().parent.parent  # the materialized ``megatron/`` folder
_STAMP = _TREE / ".patchset-stamp.json"


class ForkTreeError(ImportError):
    """The megatron tree is not a current, stamped materialization of this fork."""


def _read_stamp() -> dict:
    """The stamp's object; ``{}`` when it is missing, unreadable or not a JSON object
    (``verify_tree`` then reports the tree as unstamped, with the way out)."""
    try:
        stamp = json.loads(_STAMP.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def fork_version() -> str:
    """PEP 440 version of the fork, e.g. ``0.18.2+hfsdp.1`` (base version if unstamped)."""
    return str(_read_stamp().get("fork_version", BASE_VERSION))


def local_label() -> str:
    """The PEP 440 local label (``hfsdp.1``), or ``hfsdp`` when the tree is unstamped."""
    version = fork_version()
    return version.partition("+")[2] or FORK_NAME


def applied_patches() -> list:
    """Names of the patches applied to this tree, in series order."""
    return [entry["name"] for entry in _read_stamp().get("patches", [])]


def verify_tree() -> None:
    """Raise :class:`ForkTreeError` if this tree is unstamped or stale against its checkout."""
    if os.environ.get("HFSDP_SKIP_FORK_GUARD") == "1":
        return
    checkout = _TREE.parent
    fix = f"run `{checkout}/scripts/patchset materialize` or `pip install -e {checkout}`"
    if not _STAMP.is_file():
        raise ForkTreeError(f"{_TREE} has no {_STAMP.name}: it was not materialized by the hfsdp tooling; {fix}")
    try:
        from hfsdp.patchset.project import Project
        from hfsdp.patchset.tree import read_stamp
    except ImportError:
        return  # a tree copied out of its checkout: the stamp is all there is to check
    project = Project(checkout)
    if not project.patches_dir.is_dir():
        return
    stamp = read_stamp(checkout)
    if stamp is None or not stamp.matches(project.pin(), project.series()):
        raise ForkTreeError(f"{_TREE} is stale: patches/series or patches/base.toml changed since it was built; {fix}")
