# hfsdp: identity of the patched megatron-core tree (added by the fork-identity patch).
"""Which fork, base release and patches this ``megatron`` tree was materialized from.

The tree is built by ``scripts/patchset materialize`` (or ``pip install -e .``), which writes its
stamp, ``megatron/.patchset-stamp.json``. This module reads that file and nothing else.

[Note: the import guard] Two checks keep a run on the reviewed fork, each where it can be made:
- ``import megatron.core`` calls :func:`verify_tree`: the tree is stamped, i.e. built by the
  tooling. It reads the tree's own stamp only, never the checkout around it, so a tree imports the
  same wherever it lies (a checkout, a copy, a prefix tree of ``scripts/patchset prefixes``).
- Our entry points call ``ensure_fork`` (``hfsdp/patchset/guard.py``) before any work:
  ``megatron.core`` is the checkout's own tree, and its stamp is current against the checkout's
  pin, series and overlay, of the base the tree was built from (``patches/`` or
  ``patches/bases/<version>/``). ``scripts/patchset status`` says why a tree is stale.
``HFSDP_SKIP_FORK_GUARD=1`` skips both, e.g. inside a patch queue.
"""

import json
import os
import shlex
from pathlib import Path

FORK_NAME = "hfsdp"
UNSTAMPED = "unstamped"  # what an unstamped tree reports instead of a version
_TREE = Path(__file__).resolve().parent.parent  # the materialized ``megatron/`` folder
_STAMP = _TREE / ".patchset-stamp.json"


class ForkTreeError(ImportError):
    """The megatron tree is not a stamped materialization of this fork."""


def _read_stamp() -> dict:
    """The stamp's object; ``{}`` when it is missing, not a regular file (a named pipe would block),
    unreadable or not a JSON object (``verify_tree`` then reports the tree as unstamped)."""
    try:
        stamp = json.loads(_STAMP.read_text(encoding="utf-8")) if _STAMP.is_file() else {}
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def _stamped(key: str) -> str | None:
    """The stamp's non-empty string ``key``, or None."""
    value = _read_stamp().get(key)
    return value if isinstance(value, str) and value else None


def fork_version() -> str:
    """PEP 440 version of the fork as stamped, e.g. ``0.18.2+hfsdp.1``; ``unstamped`` if unstamped."""
    return _stamped("fork_version") or UNSTAMPED


def base_version() -> str:
    """The upstream release the tree was built from, e.g. ``0.18.2``; ``unstamped`` if unstamped."""
    return _stamped("base_version") or UNSTAMPED


def local_label() -> str:
    """The PEP 440 local label (``hfsdp.1``); ``hfsdp.unstamped`` when the tree is unstamped."""
    version = _stamped("fork_version")
    return f"{FORK_NAME}.{UNSTAMPED}" if version is None else version.partition("+")[2] or FORK_NAME


def applied_patches() -> list:
    """Names of the patches applied to this tree, in series order."""
    patches = _read_stamp().get("patches")
    if not isinstance(patches, list):
        return []
    return [entry.get("name") for entry in patches if isinstance(entry, dict)]


def verify_tree() -> None:
    """Raise :class:`ForkTreeError` unless this tree's stamp is a JSON object naming its fork version."""
    if os.environ.get("HFSDP_SKIP_FORK_GUARD") == "1" or _stamped("fork_version") is not None:
        return
    checkout = _TREE.parent  # named in the way out only; nothing there is read
    fix = (f"run `{shlex.quote(str(checkout / 'scripts' / 'patchset'))} materialize` or "
           f"`pip install -e {shlex.quote(str(checkout))}`")
    if not os.path.lexists(_STAMP):
        raise ForkTreeError(f"{_TREE} has no {_STAMP.name}: it was not materialized by the hfsdp tooling; {fix}")
    raise ForkTreeError(f"{_STAMP} is not a readable JSON object naming the tree's fork_version; {fix}")
