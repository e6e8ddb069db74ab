"""Local-run helper for patch-queue checkouts, shared by the conftests that import Megatron-FSDP.

`python -m pytest` puts the cwd (the repo root, holding the materialized `megatron/`)
ahead of PYTHONPATH. When a developer points PYTHONPATH at a patch-queue checkout
(`PYTHONPATH=<queue dir>:<checkout>`), its `megatron/` must win, otherwise the tests
run against the unpatched tree. Without PYTHONPATH (CI) this is a no-op.
A plain module with a unique name (not conftest), so that conftests in any folder can import it.
"""

from __future__ import annotations

import os
import sys


def put_queue_trees_first() -> None:
    """Move every PYTHONPATH entry that holds a ``megatron/core`` to the front of sys.path, unless
    Megatron Core is imported already."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    trees = [p for p in entries if os.path.isdir(os.path.join(p, "megatron", "core"))]
    if trees and "megatron.core" not in sys.modules:
        for path in reversed(trees):
            while path in sys.path:
                sys.path.remove(path)
            sys.path.insert(0, path)
