"""Write a file in one step: a reader (or a crash) sees the old content or the new, never half.

Standard library only (``hfsdp.patchset`` uses it inside pip's build environment).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _mode_for(path: Path) -> int:
    """The file's current permissions, or what a plain ``open()`` would give a new one."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, flush it to disk, then rename it over.

    The result has the permissions the file had (or a new file would get), not mkstemp's 0600.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
