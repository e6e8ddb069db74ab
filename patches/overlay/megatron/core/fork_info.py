# hfsdp: identity of the patched megatron-core tree (added by the fork-identity patch).
"""Which fork, base release and patches this ``megatron`` tree was materialized from.

The tree is built by ``scripts/patchset materialize`` (or ``pip install -e .``), which writes
``megatron/.patchset-stamp.json``. Importing ``megatron.core`` calls :func:`verify_tree`, so a
tree that is not stamped, or that no longer matches ``patches/`` in its checkout, fails fast
instead of running code nobody reviewed. Set ``HFSDP_SKIP_FORK_GUARD=1`` to bypass this while
working inside a patch queue.

[Note: the import guard] The stamp records :func:`inputs_digest` of the checkout as it was built
(the tooling calls this very function, from the tree it builds). The guard recomputes it: the
standard library only, no import of the tooling.
"""

import hashlib
import json
import os
import shlex
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


def inputs_digest(checkout: Path) -> str:
    """sha256 over what a tree is built from: ``patches/base.toml``, ``patches/series``, every
    ``patches/*.patch`` and every file under ``patches/overlay/`` (``__pycache__`` aside), each as
    its path and bytes, in path order. An entry that is not a regular file counts as such, unread
    (a named pipe would block)."""
    root = checkout / "patches"
    overlay = root / "overlay"
    paths = [root / "base.toml", root / "series", *sorted(root.glob("*.patch"))]
    if overlay.is_dir():
        paths += sorted(p for p in overlay.rglob("*") if "__pycache__" not in p.parts and not p.is_dir())
    digest = hashlib.sha256()
    for path in paths:
        name = path.relative_to(checkout).as_posix().encode("utf-8")
        if path.is_file():
            data = path.read_bytes()
        else:
            data = b"\0absent" if not os.path.lexists(path) else b"\0not a regular file"
        for part in (name, data):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
    return digest.hexdigest()


def verify_tree() -> None:
    """Raise :class:`ForkTreeError` if this tree is unstamped or stale against its checkout."""
    if os.environ.get("HFSDP_SKIP_FORK_GUARD") == "1":
        return
    checkout = _TREE.parent
    # Quoted for a shell: the checkout's path may hold spaces.
    fix = (f"run `{shlex.quote(str(checkout / 'scripts' / 'patchset'))} materialize` or "
           f"`pip install -e {shlex.quote(str(checkout))}`")
    if not _STAMP.is_file():
        raise ForkTreeError(f"{_TREE} has no {_STAMP.name}: it was not materialized by the hfsdp tooling; {fix}")
    if not (checkout / "patches").is_dir():
        return  # a tree copied out of its checkout: the stamp is all there is to check
    if _read_stamp().get("inputs_sha256") != inputs_digest(checkout):
        raise ForkTreeError(
            f"{_TREE} is stale: patches/ (series, base.toml, a patch or the overlay) changed since it was built; {fix}"
        )
