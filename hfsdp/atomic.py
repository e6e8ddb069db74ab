"""Write a file in one step: a reader (or a crash) sees the old content or the new, never half.

[Note: strict JSON] Every JSON file this project writes goes through :func:`write_json_atomic`
(or :func:`json_text`): ``allow_nan=False``, so no file holds the bare ``NaN`` / ``Infinity``
tokens Python's ``json`` writes by default, which are not JSON and which other readers (``jq``,
browsers, most languages) refuse. A non-finite number is refused with :class:`NonFiniteJSON`,
which names where it sits (``$.runs[0].step_times_s[2]``); whoever produces the document keeps
such values out (the benchmark counts a run with a non-finite step time or loss as failed).
Files we wrote are read back with :func:`loads_strict`, which holds them to the same rule and to
one value per key: a ``NaN`` token or a key given twice in one object is a ``ValueError``, never
a value silently taken (``json`` would read ``NaN`` as a float and keep the last of two keys).

Standard library only (``hfsdp.patchset`` uses it inside pip's build environment).
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any


def _mode_for(path: Path) -> int:
    """The file's current permissions, or what a plain ``open()`` would give a new one."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` in one step (:func:`write_bytes_atomic`)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: Path | str, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, flush it to disk, then rename it over.

    The result has the permissions the file had (or a new file would get), not mkstemp's 0600.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class NonFiniteJSON(ValueError):
    """A document holds NaN or an infinity, which strict JSON cannot write ([Note: strict JSON])."""


def _non_finite(obj: object, where: str = "$") -> tuple[str, float] | None:
    """Where the first NaN or infinity in ``obj`` sits (a JSONPath-like string), and its value."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where, obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            found = _non_finite(value, f"{where}.{key}")
            if found is not None:
                return found
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            found = _non_finite(value, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def json_text(obj: object, *, indent: int | None = 1, sort_keys: bool = True) -> str:
    """``obj`` as strict JSON text ending in a newline; a NaN or infinity raises
    :class:`NonFiniteJSON` naming where it is ([Note: strict JSON])."""
    try:
        return json.dumps(obj, indent=indent, sort_keys=sort_keys, allow_nan=False) + "\n"
    except ValueError:
        found = _non_finite(obj)
        if found is None:
            raise
        where, value = found
        raise NonFiniteJSON(f"{where} is {value!r}, which JSON cannot hold") from None


def write_json_atomic(path: Path | str, obj: object, *, indent: int | None = 1, sort_keys: bool = True) -> None:
    """Write ``obj`` to ``path`` as strict JSON (:func:`json_text`), in one step
    (:func:`write_text_atomic`). A document that is not strict JSON leaves ``path`` untouched and
    raises :class:`NonFiniteJSON` naming the file and the value."""
    try:
        text = json_text(obj, indent=indent, sort_keys=sort_keys)
    except NonFiniteJSON as exc:
        raise NonFiniteJSON(f"not writing {path}: {exc}") from None
    write_text_atomic(Path(path), text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook: a key given twice is an error (JSON would keep the last)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} is given twice in one object, and JSON would keep only the last")
        seen[key] = value
    return seen


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (strict JSON: this project never writes it)")


def loads_strict(text: str | bytes) -> Any:
    """``text`` as strict JSON ([Note: strict JSON]): ``NaN``, ``Infinity`` or a key given twice in
    one object raises ``ValueError``, as a syntax error does."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
