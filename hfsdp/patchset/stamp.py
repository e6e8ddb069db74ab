"""The stamp of a materialized tree: what it was built from, and the text of every patch applied.

``megatron/.patchset-stamp.json`` (schema 4) holds the base pin, the fork version, the applied
patches (name + sha256, in order), the overlay's files (path + sha256, [Note: the overlay] in
overlay.py), the sha256 of every file the build wrote, and the full text of the applied patches and
of the overlay's files. The texts let ``diff`` rebuild the tree *as it was built*, so local edits
are always shown against that tree, even after ``patches/`` changed (a pull): a diff against the
new series or overlay would silently undo the pulled change. The tree itself reads only its
``fork_version``, ``base_version`` and ``patches`` ([Note: the import guard] in the overlay's
``megatron/core/fork_info.py``).

[Note: older stamps] Schema-1 stamps (no texts) and schema-2 stamps (no overlay) are still read.
The tools that wrote them never copied an overlay, so such a tree was built with none: it is read
as having an empty overlay, which is the truth. A checkout that has overlay files therefore finds
such a tree stale, and rebuilds it (``materialize``) or refuses over its edits, as for a changed
patch. A schema-4 stamp may also hold ``inputs_sha256`` (earlier tools wrote it; nothing reads it):
it is ignored. Any other schema is a :class:`CorruptStamp`.

A stamp that is not a JSON object of this shape is a :class:`CorruptStamp`, never a traceback.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from hfsdp.atomic import json_text, loads_strict, write_text_atomic
from hfsdp.usererror import not_a_regular_file

from .errors import PatchsetError
from .overlay import Overlay, text_sha256
from .pin import BasePin, is_digest, is_tree_path
from .scan import STAMP_NAME
from .series import Patch

STAMP_SCHEMA = 4
_READABLE_SCHEMAS = (1, 2, 3, 4)


class CorruptStamp(PatchsetError):
    """The stamp file exists but is not one this tool wrote."""


@dataclass(frozen=True)
class Stamp:
    """What a materialized tree was built from, and the hash of every file it got."""

    base_version: str
    sdist_sha256: str
    fork_version: str
    patches: tuple[tuple[str, str], ...]  # (name, sha256 of the patch file), in order
    files: dict[str, str]
    texts: dict[str, str] | None = None  # name -> patch text as applied (None: schema-1 stamp)
    overlay: tuple[tuple[str, str], ...] = ()  # (path, sha256) of each overlay file, in path order
    overlay_texts: dict[str, str] = field(default_factory=dict)  # path -> overlay file text as built
    checkout: Path | None = field(default=None, compare=False)  # the checkout it was read from, if known

    @staticmethod
    def expected_patches(patches: list[Patch]) -> tuple[tuple[str, str], ...]:
        return tuple((p.name, p.sha256) for p in patches)

    def matches(self, pin: BasePin, patches: list[Patch], overlay: Overlay) -> bool:
        """Whether the tree is what ``pin``, ``patches`` and ``overlay`` build."""
        return (
            self.base_version == pin.version
            and self.sdist_sha256 == pin.sha256
            and self.fork_version == pin.fork_version  # a new [fork] release restamps the tree
            and self.patches == self.expected_patches(patches)
            and self.overlay == overlay.digests()
        )

    def overlay_changes(self, overlay: Overlay) -> dict[str, str]:
        """Overlay files that differ between the tree as built and ``overlay``: path -> changed/new/removed."""
        built, now = dict(self.overlay), dict(overlay.digests())
        changes = {path: "changed" for path in built if path in now and now[path] != built[path]}
        changes.update({path: "new" for path in now if path not in built})
        changes.update({path: "removed" for path in built if path not in now})
        return dict(sorted(changes.items()))

    def built_overlay(self) -> Overlay:
        """The overlay the tree was built with (from the recorded texts; see [Note: older stamps])."""
        return Overlay.of(self.overlay_texts)

    def to_json(self) -> str:
        return json_text(
            {
                "schema": STAMP_SCHEMA,
                "base_version": self.base_version,
                "sdist_sha256": self.sdist_sha256,
                "fork_version": self.fork_version,
                "patches": [{"name": n, "sha256": h} for n, h in self.patches],
                "files": self.files,
                "patch_texts": self.texts or {},
                "overlay": [{"path": p, "sha256": h} for p, h in self.overlay],
                "overlay_texts": self.overlay_texts,
            },
            indent=1,
            sort_keys=True,
        )


def make_stamp(pin: BasePin, patches: list[Patch], overlay: Overlay, files: dict[str, str]) -> Stamp:
    return Stamp(pin.version, pin.sha256, pin.fork_version, Stamp.expected_patches(patches), files,
                 {p.name: p.text for p in patches}, overlay.digests(), dict(overlay.files))


def write_stamp_file(tree_root: Path, stamp: Stamp) -> None:
    """Write ``tree_root/megatron/<stamp>`` in one step."""
    write_text_atomic(tree_root / "megatron" / STAMP_NAME, stamp.to_json())


def _corrupt(path: Path, why: str) -> CorruptStamp:
    return CorruptStamp(
        f"stamp {path} is not one this tool wrote ({why}), so which files are yours cannot be told",
        "`scripts/patchset materialize --backup` moves the tree to megatron.bak-* (nothing is deleted) "
        "and builds a fresh one",
    )


def read_stamp(tree_root: Path) -> Stamp | None:
    """The stamp of ``tree_root/megatron``, or None if absent. A malformed stamp is a CorruptStamp."""
    return read_stamp_file(tree_root / "megatron" / STAMP_NAME, checkout=tree_root)


def read_stamp_file(path: Path, checkout: Path | None = None) -> Stamp | None:
    """A stamp file (also one inside a parked tree), or None if absent; ``checkout``: the checkout whose tree
    it stamps, if known (see :meth:`Stamp.matches`)."""
    if not os.path.lexists(path):
        return None
    if why := not_a_regular_file(path):  # a named pipe would block the read; nothing else is a stamp we wrote
        raise _corrupt(path, why)
    try:
        data = loads_strict(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _corrupt(path, f"not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a string", bool: "true/false", int: "a number", float: "a number"}
        raise _corrupt(path, f"JSON {kind.get(type(data), 'null')}, not an object")
    schema = data.get("schema")
    if type(schema) is not int or schema not in _READABLE_SCHEMAS:  # not true, not 2.0: the integers it writes
        raise _corrupt(path, f"schema {schema!r}, this tool reads {_READABLE_SCHEMAS}")
    strings = ("base_version", "sdist_sha256", "fork_version")
    if not all(isinstance(data.get(k), str) and data[k] for k in strings):
        raise _corrupt(path, f"{', '.join(strings)} must be non-empty strings")
    if not is_digest(data["sdist_sha256"]):
        raise _corrupt(path, "'sdist_sha256' must be a sha256 hex digest")
    patches, files, texts = data.get("patches"), data.get("files"), data.get("patch_texts")
    if not isinstance(patches, list) or not all(
        isinstance(p, dict) and isinstance(p.get("name"), str) and is_digest(p.get("sha256")) for p in patches
    ):
        raise _corrupt(path, "'patches' must be a list of {name, sha256}")
    if not isinstance(files, dict) or not all(is_tree_path(k) and is_digest(v) for k, v in files.items()):
        raise _corrupt(path, "'files' must map megatron/ paths to sha256 digests")
    if texts is not None and (not isinstance(texts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in texts.items())):
        raise _corrupt(path, "'patch_texts' must map patch names to text")
    pairs = tuple((p["name"], p["sha256"]) for p in patches)
    if texts is not None and data["schema"] >= 2:
        bad = [n for n, h in pairs if n not in texts or hashlib.sha256(texts[n].encode("utf-8")).hexdigest() != h]
        if bad:
            raise _corrupt(path, f"the recorded text of {', '.join(bad)} does not match its sha256")
    else:
        texts = None
    overlay, overlay_texts = _read_overlay(path, data)  # an 'inputs_sha256' is ignored ([Note: older stamps])
    return Stamp(data["base_version"], data["sdist_sha256"], data["fork_version"], pairs, dict(files), texts,
                 overlay, overlay_texts, checkout)


def _read_overlay(path: Path, data: dict) -> tuple[tuple[tuple[str, str], ...], dict[str, str]]:
    """The overlay a stamp records: (path, sha256) pairs and texts; none before schema 3 ([Note: older stamps])."""
    if data["schema"] < 3:
        return (), {}
    entries, texts = data.get("overlay"), data.get("overlay_texts")
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and is_tree_path(e.get("path")) and is_digest(e.get("sha256")) for e in entries):
        raise _corrupt(path, "'overlay' must be a list of {path, sha256} (megatron/ paths)")
    if not isinstance(texts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in texts.items()):
        raise _corrupt(path, "'overlay_texts' must map overlay paths to text")
    pairs = tuple((e["path"], e["sha256"]) for e in entries)
    if [p for p, _ in pairs] != sorted(texts) or any(text_sha256(texts[p]) != h for p, h in pairs):
        raise _corrupt(path, "the recorded overlay texts do not match the overlay's paths and sha256s")
    return pairs, texts
