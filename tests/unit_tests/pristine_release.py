"""The pinned release itself, unpatched, for tests that compare the fork with it.

A plain module with a unique name (not conftest), so that test files in any folder can import it.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def extract_pristine(dest: Path) -> Path:
    """The pinned release's megatron/ (no overlay, no patches) extracted under ``dest``, which is
    returned: put it first on PYTHONPATH to import the release. The release is the base HFSDP_BASE
    names, else the default, as for every verb of ``scripts/patchset``. The sdist is found as
    ``scripts/patchset`` finds it (MEGATRON_PATCHSET_SDIST, wheelhouses, the cache), never
    downloaded: materializing this checkout put it there."""
    from hfsdp.patchset.project import Project
    from hfsdp.patchset.source import locate_sdist
    from hfsdp.patchset.tree import extract_base

    pin = Project(REPO_ROOT).with_base(None).pin()
    extract_base(pin, locate_sdist(pin, env=dict(os.environ, MEGATRON_PATCHSET_OFFLINE="1")), dest)
    return dest
