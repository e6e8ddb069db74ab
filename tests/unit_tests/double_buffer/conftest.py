"""The double-buffer tests' local-run helper for patch-queue checkouts, and the GPU tests' process group.

`python -m pytest` puts the cwd (the repo root, holding the materialized `megatron/`)
ahead of PYTHONPATH. When a developer points PYTHONPATH at a patch-queue checkout
(`PYTHONPATH=<queue dir>:<checkout>`), its `megatron/` must win, otherwise the tests
run against the unpatched tree. Without PYTHONPATH (CI) this is a no-op.

The GPU tests (marker ``gpu``) share maxpool_gpu_harness.py's module-scoped ``dist_env`` fixture,
imported here after the path is set.
"""

import os
import sys

_entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
_trees = [p for p in _entries if os.path.isdir(os.path.join(p, "megatron", "core"))]
if _trees and "megatron.core" not in sys.modules:
    for path in reversed(_trees):
        while path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)

from maxpool_gpu_harness import dist_env  # noqa: E402, F401
