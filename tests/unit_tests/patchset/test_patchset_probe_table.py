"""The bad-input probe of ``scripts/patchset``, as a table: what a new user might type, in what checkout.

Each row is one command (``argv`` after ``scripts/patchset --root ROOT``) on the fake checkout with an
overlay (patchset_fake.py), after ``setup``; it must exit with ``rc`` and print ``says`` (stdout and
stderr together), and never a traceback: no ``Traceback`` in stderr, and no exception out of
``main``, unless the row sets HFSDP_DEBUG=1. Rows run in this process (fast), except those marked
``process``, which run ``scripts/patchset`` itself (Ctrl-C, the shell wrapper) through kill_points.py.

In ``argv``, ``{root}``, ``{tmp}``, ``{sdist}`` and ``{store}`` (the folder holding the sdist) are
filled in (``{tmp}`` in ``says`` too); ``root`` replaces the checkout given with ``--root``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from patchset_fake import Env, set_pin

from hfsdp import usererror
from hfsdp.patchset.cli import main

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
QUIET = -1  # rc of a row whose output goes to a closed pipe: run_cli ends it quietly with status 141

Setup = Callable[[Env, Path], None]


def nothing(env: Env, tmp: Path) -> None:
    pass


@dataclass(frozen=True)
class Probe:
    id: str
    argv: tuple[str, ...]
    rc: int
    says: str
    setup: Setup = nothing
    env: dict[str, str | None] = field(default_factory=dict)  # None: unset it
    root: str = "{root}"
    process: bool = False  # run scripts/patchset as a program (see the module's docstring)
    interrupt_at: int = 0  # process rows: Ctrl-C right before this step (kill_points.py)
    closed_stdout: bool = False  # process rows: the reader of stdout is gone (`... | head -0`)


# --- setups -------------------------------------------------------------------------------------------------------

def materialized(env: Env, tmp: Path) -> None:
    assert main(["--root", str(env.project.root), "materialize"]) == 0


def then(*steps: Setup) -> Setup:
    def both(env: Env, tmp: Path) -> None:
        for step in steps:
            step(env, tmp)
    return both


def write(path: str, data: str | bytes) -> Setup:
    """Write ``data`` at ``path`` (relative to the checkout; ``{tmp}/...`` for a file outside it)."""
    def setup(env: Env, tmp: Path) -> None:
        target = Path(path.format(tmp=tmp)) if path.startswith("{tmp}") else env.project.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data if isinstance(data, bytes) else data.encode())
    return setup


def folder(path: str) -> Setup:
    """Put an (empty) folder at ``path`` of the checkout, in place of whatever is there."""
    def setup(env: Env, tmp: Path) -> None:
        target = env.project.root / path
        if target.is_file():
            target.unlink()
        target.mkdir(parents=True, exist_ok=True)
    return setup


def edit(path: str, old: str | bytes, new: str | bytes) -> Setup:
    def setup(env: Env, tmp: Path) -> None:
        target = env.project.root / path
        text = target.read_bytes()
        old_b, new_b = (old.encode(), new.encode()) if isinstance(old, str) else (old, new)
        assert isinstance(old_b, bytes) and isinstance(new_b, bytes) and old_b in text, (path, old)
        target.write_bytes(text.replace(old_b, new_b))
    return setup


def pin_line(key: str, value: str | None) -> Setup:
    """Set (None: remove) the line ``key = ...`` of patches/base.toml."""
    def setup(env: Env, tmp: Path) -> None:
        base = env.project.patches_dir / "base.toml"
        lines = base.read_text().splitlines()
        (index,) = [i for i, line in enumerate(lines) if line.startswith(f"{key} = ")]
        if value is None:
            del lines[index]
        else:
            lines[index] = f"{key} = {value}"
        base.write_text("\n".join(lines) + "\n")
    return setup


def stamp_value(key: str, value: object) -> Setup:
    def setup(env: Env, tmp: Path) -> None:
        stamp = env.project.megatron_dir / ".patchset-stamp.json"
        data = json.loads(stamp.read_text())
        data[key] = value
        stamp.write_text(json.dumps(data))
    return setup


def fifo(path: str) -> Setup:
    """A named pipe at ``path``, in place of the file there if any (reading it would block)."""
    def setup(env: Env, tmp: Path) -> None:
        (env.project.root / path).unlink(missing_ok=True)
        os.mkfifo(env.project.root / path)
    return setup


def link(path: str, to: str) -> Setup:
    """A symbolic link at ``path`` (in place of the file there if any) to ``to`` (``{tmp}`` filled in)."""
    def setup(env: Env, tmp: Path) -> None:
        (env.project.root / path).unlink(missing_ok=True)
        os.symlink(to.format(tmp=tmp), env.project.root / path)
    return setup


def odd(path: str, kind: str) -> Setup:
    """What a user may leave where a file is read: a named pipe, a link to /dev/null or to nothing, a folder
    (``path`` relative to the checkout, or ``{tmp}/...``)."""
    def setup(env: Env, tmp: Path) -> None:
        target = Path(path.format(tmp=tmp)) if path.startswith("{tmp}") else env.project.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        {"fifo": os.mkfifo, "devnull": lambda t: os.symlink(os.devnull, t),
         "dangling": lambda t: os.symlink(tmp / "nothing-here", t), "folder": os.mkdir}[kind](target)
    return setup


def move(path: str, to: str) -> Setup:
    def setup(env: Env, tmp: Path) -> None:
        os.rename(env.project.root / path, env.project.root / to)
    return setup


def queue_at(name: str) -> Setup:
    def setup(env: Env, tmp: Path) -> None:
        assert main(["--root", str(env.project.root), "queue", "--dir", str(tmp / name)]) == 0
    return setup


def queue_with_a_changed_patch(name: str) -> Setup:
    """A queue at ``{tmp}/name`` whose last patch commit changes its diff: export dates that patch anew."""
    def setup(env: Env, tmp: Path) -> None:
        queue_at(name)(env, tmp)
        repo = tmp / name
        train = repo / "megatron" / "training" / "train.py"
        train.write_text(train.read_text().replace("'fork'", "'fork, again'"))
        subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-a",
                        "--amend", "--no-edit"], check=True)
    return setup


def canonical(env: Env, tmp: Path) -> None:
    """Rewrite the fake's patches as export writes them (full index lines), as the real series is: an export or
    refresh then dates no patch of it (their diffs are unchanged)."""
    assert main(["--root", str(env.project.root), "queue", "--dir", str(tmp / "canonical")]) == 0
    assert main(["--root", str(env.project.root), "export", "--queue", str(tmp / "canonical")]) == 0


def queue_with_a_headerless_commit(name: str) -> Setup:
    """A queue at ``{tmp}/name`` with a new patch commit whose message is its subject alone (no DEP-3 header)."""
    def setup(env: Env, tmp: Path) -> None:
        queue_at(name)(env, tmp)
        repo = tmp / name
        init = repo / "megatron" / "core" / "__init__.py"
        init.write_text(init.read_text() + "EXTRA = 1\n")
        subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-a",
                        "-m", "extra"], check=True)
    return setup


def bom(path: str) -> Setup:
    """Put a UTF-8 byte-order mark before the file at ``path`` (as some editors save)."""
    def setup(env: Env, tmp: Path) -> None:
        target = env.project.root / path
        target.write_bytes(b"\xef\xbb\xbf" + target.read_bytes())
    return setup


def wrong_pin(env: Env, tmp: Path) -> None:
    set_pin(env, "0" * 64)


def crlf(env: Env, tmp: Path) -> None:
    patch = env.project.patches_dir / "alloc.patch"
    patch.write_bytes(patch.read_bytes().replace(b"\n", b"\r\n"))


APPLY, EDITOR = "a leftover of a failed or partial patch apply", "an editor's backup, swap or lock file"
STRAYS = (("enums.py.rej", APPLY), ("enums.py.orig", APPLY), (".enums.py.swp", EDITOR), (".enums.py.swo", EDITOR),
          ("enums.py~", EDITOR), ("#enums.py#", EDITOR), ("enums.py.bak", EDITOR))
OFFLINE: dict[str, str | None] = {"MEGATRON_PATCHSET_OFFLINE": "1"}
NO_SDIST: dict[str, str | None] = {"MEGATRON_PATCHSET_SDIST": None}
OVERLAY = "patches/overlay/megatron/core"

PROBES = [
    # 1. The pinned sdist's sha256 (with the index at hand: test_advice.py).
    Probe("sha256-wrong-offline", ("materialize",), 2, "Which one is wrong cannot be told here: offline", wrong_pin,
          OFFLINE),
    # 2. A patch saved with CRLF line endings.
    Probe("crlf-materialize", ("materialize",), 2, "saved with CRLF (Windows) line endings", crlf),
    Probe("crlf-check", ("check",), 2, "saved with CRLF (Windows) line endings", crlf),
    Probe("crlf-queue", ("queue", "--dir", "{tmp}/q"), 2, "saved with CRLF (Windows) line endings", crlf),
    Probe("crlf-lint", ("lint",), 1, "alloc.patch: has CRLF line endings (line 1)", crlf),
    # 3. --sdist: a folder, a missing file, and after the verb; --root after the verb.
    Probe("sdist-folder", ("--sdist", "{store}", "materialize"), 2, "is a folder, not an sdist file"),
    Probe("sdist-folder-after-verb", ("materialize", "--sdist", "{store}"), 2, "is a folder, not an sdist file"),
    Probe("sdist-missing", ("--sdist", "{tmp}/nowhere.tar.gz", "check"), 2, "nowhere.tar.gz does not exist"),
    Probe("sdist-after-verb", ("materialize", "--sdist", "{sdist}"), 0, "materialized megatron/", env=NO_SDIST),
    Probe("sdist-variable-folder", ("materialize",), 2, "MEGATRON_PATCHSET_SDIST", env={
        "MEGATRON_PATCHSET_SDIST": "{store}"}),
    Probe("root-after-verb", ("status", "--root", "{root}"), 1, "megatron/ not materialized", root="{tmp}"),
    # 4. A patch file the series does not list.
    Probe("unlisted-patch", ("status",), 1, "unlisted: patches/forgotten.patch is not in patches/series",
          then(materialized, write("patches/forgotten.patch", "Description: x\n"))),
    # 5. Stamp values of another type.
    Probe("stamp-schema-true", ("status",), 2, "schema True", then(materialized, stamp_value("schema", True))),
    Probe("stamp-schema-float", ("status",), 2, "schema 3.0", then(materialized, stamp_value("schema", 3.0))),
    Probe("stamp-path-outside", ("diff",), 2, "'files' must map megatron/ paths",
          then(materialized, stamp_value("files", {"megatron/../../x.py": "0" * 64}))),
    # 6. queue --continue / export on a folder that is no queue.
    Probe("continue-missing", ("queue", "--continue", "--dir", "{tmp}/nonexistent"), 2,
          "it does not exist, so it is not a patch queue"),
    Probe("continue-complete", ("queue", "--continue", "--dir", "{tmp}/q"), 2, "nothing to continue",
          queue_at("q")),
    Probe("export-file", ("export", "--queue", "{tmp}/f"), 2, "it is not a folder", write("{tmp}/f", "x")),
    Probe("export-no-git", ("export", "--queue", "{tmp}"), 2, "is not a git repository"),
    *[Probe(f"queue-state-{i}-{verb}", (verb, *rest), 2, "is not a queue state this tool wrote",
            then(queue_at("q"), write("{tmp}/q/.git/patchset-queue.json", state)))
      for i, state in enumerate(['{"series": 5}', '{"series": [["a.patch"]]}', '{"series": [], "stopped_at": 5}',
                                 '{"series": [], "pending": ["x.patch"]}', '[]', '{"series": [], "extra": 1}'])
      for verb, *rest in (("export", "--queue", "{tmp}/q"), ("queue", "--continue", "--dir", "{tmp}/q"))],
    # 7, 8. A killed run's leftovers.
    Probe("noop-materialize-cleans", ("materialize",), 0, "removed .patchset-tmp-x",
          then(materialized, folder(".patchset-tmp-x/queue"))),
    Probe("patches-parked-status", ("status",), 2, "patches/ is missing: a writing command moved it aside",
          move("patches", ".patchset-old-patches-1-2")),
    Probe("patches-parked-materialize", ("materialize",), 0, "restored patches/ from .patchset-old-patches-1-2",
          move("patches", ".patchset-old-patches-1-2")),
    # 9. patches/base.toml: fields of the wrong type or form, missing, the file itself.
    *[Probe(f"pin-{key}-{value}", ("status",), 2, says, pin_line(key, value)) for key, value, says in [
        ("members", "[]", "[base] members is [] (list)"),
        ("members", '"megatron/core"', "[base] members is 'megatron/core' (str)"),
        ("members", '["../x"]', "[base] members is ['../x']"),
        ("members", '["/etc"]', "[base] members is ['/etc']"),
        ("members", "[1]", "[base] members is [1]"),
        ("release", "-1", "[fork] release is -1 (int)"),
        ("release", '"7"', "[fork] release is '7' (str)"),
        ("release", "7.0", "[fork] release is 7.0 (float)"),
        ("release", "true", "[fork] release is True (bool)"),
        ("name", '""', "[fork] name is '' (str)"),
        ("name", '"a b"', "[fork] name is 'a b' (str)"),
        ("version", "1", "[base] version is 1 (int)"),
        ("url", "5", "[base] url is 5 (int)"),
        ("index_url", '"pypi.org"', "[base] index_url is 'pypi.org' (str)"),
        ("filename", '"megatron_core-0.18.2.zip"', "is not the sdist of megatron-core==0.18.2"),
        ("sha256", "true", "[base] sha256 is True (bool)"),
        ("distribution", None, "[base] distribution is missing"),
    ]],
    Probe("pin-no-fork-table", ("status",), 2, "[fork] is missing",
          then(pin_line("name", None), pin_line("release", None), edit("patches/base.toml", "[fork]\n", ""))),
    Probe("pin-folder", ("status",), 2, "base.toml is a folder, not a regular file", folder("patches/base.toml")),
    # Reading a named pipe would block; /dev/null would read as an empty pin.
    *[Probe(f"pin-{kind}-{verb}", (verb,), 2, f"base.toml {says}", odd("patches/base.toml", kind))
      for kind, says in (("fifo", "is a named pipe, not a regular file"), ("devnull", "is a character device"),
                         ("dangling", "is a symbolic link to nothing"))
      for verb in ("status", "overlay", "materialize")],
    Probe("pin-not-toml", ("status",), 2, "is not valid TOML", write("patches/base.toml", "[base\n")),
    Probe("pin-not-utf8", ("status",), 2, "is not UTF-8 text", write("patches/base.toml", b"\xff\n")),
    Probe("pin-bom", ("status",), 1, "megatron/ not materialized", edit("patches/base.toml", "[base]", "\ufeff[base]")),
    # 9. patches/series: odd lines, the file itself, what it lists.
    Probe("series-bom", ("status",), 0, "[applied] alloc.patch",
          then(write("patches/series", "\ufeffalloc.patch\ntrain.patch\n"), materialized)),
    Probe("series-crlf", ("status",), 0, "[applied] train.patch",
          then(write("patches/series", "alloc.patch\r\ntrain.patch\r\n"), materialized)),
    Probe("series-quilt-option", ("status",), 2, "quilt's options are not read",
          write("patches/series", "alloc.patch -p1\n")),
    Probe("series-two-names", ("status",), 2, "one patch name a line",
          write("patches/series", "alloc.patch train.patch\n")),
    Probe("series-bad-name", ("status",), 2, "is not a patch name", write("patches/series", "Alloc.patch\n")),
    Probe("series-twice", ("status",), 2, "is listed twice", write("patches/series", "alloc.patch\nalloc.patch\n")),
    Probe("series-not-utf8", ("status",), 2, "series is not UTF-8 text", write("patches/series", b"\xff\n")),
    Probe("series-folder", ("status",), 2, "series is a folder, not a regular file", folder("patches/series")),
    Probe("series-empty-lint", ("lint",), 1, "alloc.patch: is in patches/ but not listed",
          write("patches/series", "")),
    Probe("series-missing-patch", ("status",), 2, "does not exist", write("patches/series", "gone.patch\n")),
    Probe("series-patch-folder", ("status",), 2, "train.patch is a folder, not a regular file",
          folder("patches/train.patch")),
    Probe("patch-without-diff", ("status",), 2, "alloc.patch has no diff",
          write("patches/alloc.patch", "Description: x\n")),
    # lint lists a bad patch among its findings (1); the others stop at it (2). Reading a pipe would block.
    *[Probe(f"{what}-fifo-{verb}", (verb,), 1 if (what, verb) == ("patch", "lint") else 2, says,
            then(materialized, fifo(path)))
      for what, path, says in (("series", "patches/series", "series is a named pipe, not a regular file"),
                               ("patch", "patches/alloc.patch", "alloc.patch is a named pipe, not a regular file"))
      for verb in ("status", "materialize", "check", "lint")],
    # A reproducible date that is no date: refused before anything is written.
    *[Probe(f"source-date-{i}", ("refresh", "--new", "x"), 2, says,
            then(materialized, write("megatron/core/__init__.py", "V = 5\n")), env={"SOURCE_DATE_EPOCH": value})
      for i, (value, says) in enumerate((("soon", "SOURCE_DATE_EPOCH='soon': 'soon' is not a whole number"),
                                         ("99999999999999", "is past the last date a patch header can carry"),
                                         ("-1", "SOURCE_DATE_EPOCH='-1': must be >= 0, got -1"),
                                         ("1e9", "'1e9' is not a whole number"), ("é", "'é' is not a whole number")))],
    # The same through export, which dates a patch whose diff the queue changed (the shared today()).
    *[Probe(f"source-date-{i}-export", ("export", "--queue", "{tmp}/q"), 2, says, queue_with_a_changed_patch("q"),
            env={"SOURCE_DATE_EPOCH": value})
      for i, (value, says) in enumerate((("soon", "SOURCE_DATE_EPOCH='soon': 'soon' is not a whole number"),
                                         ("99999999999999", "is past the last date a patch header can carry")))],
    # ... and where no date is written: an overlay-only refresh, an export that refuses a headerless commit.
    Probe("source-date-overlay-refresh", ("refresh",), 2, "SOURCE_DATE_EPOCH='soon': 'soon' is not a whole number",
          then(canonical, materialized, write("megatron/core/maxpool_allocator.py", "POOL_LANES = 3\n")),
          env={"SOURCE_DATE_EPOCH": "soon"}),
    Probe("source-date-headerless-export", ("export", "--queue", "{tmp}/q"), 2,
          "SOURCE_DATE_EPOCH='soon': 'soon' is not a whole number",
          then(canonical, queue_with_a_headerless_commit("q")), env={"SOURCE_DATE_EPOCH": "soon"}),
    # A queue commit with no DEP-3 header is refused, not written as a patch lint then flags.
    Probe("headerless-export", ("export", "--queue", "{tmp}/q"), 2,
          "(extra.patch) has no valid DEP-3 header in its message (missing Description (or Subject)",
          queue_with_a_headerless_commit("q")),
    # A patch saved with a byte-order mark: refused by every verb that reads it, naming the BOM.
    *[Probe(f"bom-{verb[0]}", verb, 1 if verb == ("lint",) else 2,
            "alloc.patch starts with a UTF-8 byte-order mark (BOM)", then(*before, bom("patches/alloc.patch")))
      for verb, before in ((("status",), (materialized,)), (("materialize",), ()), (("check",), ()), (("lint",), ()),
                           (("queue", "--dir", "{tmp}/q"), ()), (("export", "--queue", "{tmp}/q"), (queue_at("q"),)),
                           (("diff", "--series"), ()))],
    Probe("bom-advice", ("materialize",), 2, "remove the BOM: `sed -i '1s/^\\xEF\\xBB\\xBF//' ",
          bom("patches/alloc.patch")),
    # A series that lost patches patches/ still holds: no tree stamped as the fork without them.
    *[Probe(f"series-lost-{when}", ("materialize",), 2,
            "patches/ holds 2 more it does not list (alloc.patch, train.patch)",
            then(*before, write("patches/series", "")))
      for when, before in (("unbuilt", ()), ("built", (materialized,)))],
    # 9. patches/overlay/: odd entries.
    Probe("overlay-fifo", ("status",), 2, "fifo.py is not a regular file", fifo(f"{OVERLAY}/fifo.py")),
    Probe("overlay-link", ("status",), 2, "link.py is a symbolic link", link(f"{OVERLAY}/link.py", "alloc.py")),
    Probe("overlay-not-utf8", ("status",), 2, "bin.py is not UTF-8 text", write(f"{OVERLAY}/bin.py", b"\xff")),
    Probe("overlay-outside", ("status",), 2, "NOTES.md is outside megatron/core",
          write("patches/overlay/NOTES.md", "x\n")),
    Probe("overlay-a-file", ("status",), 2, "patches/overlay is not a folder",
          then(move("patches/overlay", "overlay.away"), write("patches/overlay", "x\n"))),
    Probe("overlay-empty-folder", ("materialize",), 0, "+ 2 overlay files", folder(f"{OVERLAY}/empty")),
    # A loose .pyc, .pyo, .so, .o or .lock is refused by every verb, as the docs say; Python's own __pycache__ is
    # skipped.
    *[Probe(f"overlay-{name}-{verb}", (verb,), 1 if verb == "lint" else 2,
            f"{name} is a cache, a built object or a lock file, never an overlay file",
            write(f"{OVERLAY}/{name}", b"\0"))
      for name in ("x.cpython-312.pyc", "x.pyo", "ext.so", "ext.o", "build.lock")
      for verb in ("status", "lint", "materialize")],
    Probe("overlay-pycache", ("materialize",), 0, "+ 2 overlay files",
          write(f"{OVERLAY}/__pycache__/x.cpython-312.pyc", b"\0")),
    # Editor backups and swap files, and what a failed apply leaves, are never overlay files ([Note: stray files]
    # in scan.py), in patches/overlay/ as in megatron/ (where refresh would fold them into the overlay).
    *[Probe(f"overlay-stray-{i}-{verb}", (verb,), 1 if verb == "lint" else 2,
            f"{name} is {kind}, never an overlay file", write(f"{OVERLAY}/{name}", "x\n"))
      for i, (name, kind) in enumerate(STRAYS) for verb in ("status", "lint", "materialize")],
    Probe("overlay-stray-refresh", ("refresh",), 2, f"enums.py.rej is {APPLY}, never an overlay file",
          then(materialized, write("megatron/core/__init__.py", "V = 5\n"), write(f"{OVERLAY}/enums.py.rej", "x\n"))),
    *[Probe(f"tree-stray-{i}-{verb[0]}", verb, 2, f"megatron/core/{name} is {kind}: not a file of the fork",
            then(materialized, write(f"megatron/core/{name}", "x\n")))
      for i, (name, kind) in enumerate(STRAYS)
      for verb in ((("status",), ("refresh",), ("materialize",), ("diff",)) if i < 2 else (("status",),))],
    Probe("tree-stray-stale-materialize", ("materialize",), 2, f"megatron/core/enums.py.orig is {APPLY}",
          then(materialized, write("megatron/core/enums.py.orig", "x\n"),
               edit("patches/alloc.patch", "maxpool", "pool"))),
    Probe("overlay-space-lint", ("lint",), 1, "has a character a shell splits", write(f"{OVERLAY}/a b.py", "x = 1\n")),
    # 9. Wrong file types, missing or empty folders where a path is expected.
    Probe("tree-a-file-status", ("status",), 1, "megatron is a file, not a folder", write("megatron", "x")),
    Probe("tree-a-file-materialize", ("materialize",), 2, "megatron is a file, not a folder", write("megatron", "x")),
    Probe("tree-a-file-backup", ("materialize", "--backup"), 0, "previous tree kept at", write("megatron", "x")),
    Probe("tree-empty-folder", ("materialize",), 0, "materialized megatron/", folder("megatron")),
    Probe("root-a-file", ("status",), 2, "is not a checkout of this project", write("{tmp}/f", "x"), root="{tmp}/f"),
    Probe("root-missing", ("status",), 2, "is not a checkout of this project", root="{tmp}/nowhere"),
    Probe("root-patches-empty", ("status",), 2, "is not a checkout of this project",
          then(move("patches", "patches.away"), folder("patches"))),
    # patches itself no folder: named as what it is, not as a missing series.
    *[Probe(f"root-patches-{kind}", ("status",), 2, f"its patches is {says}, not a folder",
            then(move("patches", "patches.away"), odd("patches", kind)))
      for kind, says in (("fifo", "a named pipe"), ("devnull", "a character device"),
                         ("dangling", "a symbolic link to nothing"))],
    Probe("root-patches-a-file", ("status",), 2, "its patches is a file, not a folder",
          then(move("patches", "patches.away"), write("patches", "x\n"))),
    Probe("queue-dir-a-file", ("queue", "--dir", "{tmp}/f"), 2, "exists and is a file", write("{tmp}/f", "x")),
    Probe("queue-dir-below-a-file", ("queue", "--dir", "{tmp}/f/q"), 2, "/f, which is a file",
          write("{tmp}/f", "x")),
    Probe("queue-dir-not-empty", ("queue", "--dir", "{store}"), 2, "exists and is a folder that is not empty"),
    Probe("queue-dir-empty", ("queue", "--dir", "{tmp}/empty"), 0, "queue at",
          lambda env, tmp: (tmp / "empty").mkdir()),
    Probe("against-not-sdist", ("check", "--against", "{tmp}/f"), 2, "f is not an sdist of megatron-core",
          write("{tmp}/f", "x")),
    Probe("against-folder", ("check", "--against", "{store}"), 2, "is a folder; it takes a version"),
    Probe("against-garbage", ("check", "--against", "0.18.2; rm -rf /"), 2, "is neither an sdist file nor a version"),
    Probe("cache-a-file", ("materialize",), 2, "the download cache", write("{tmp}/cache", "x"),
          env={**NO_SDIST, "MEGATRON_PATCHSET_CACHE": "{tmp}/cache"}),
    # The cached sdist is no regular file: never read (a pipe blocks), never replaced by a download.
    *[Probe(f"cached-sdist-{kind}-{verb[-1]}", verb, 2, f"the cached sdist {{tmp}}/cache/{name} is {says}",
            odd(f"{{tmp}}/cache/{name}", kind), env={**NO_SDIST, **OFFLINE, "MEGATRON_PATCHSET_CACHE": "{tmp}/cache"})
      for kind, says in (("fifo", "a named pipe"), ("dangling", "a symbolic link to nothing"), ("folder", "a folder"))
      for verb, name in ((("materialize",), "megatron_core-0.18.2.tar.gz"),
                         (("check", "--against", "0.19.0"), "megatron_core-0.19.0.tar.gz"))],
    Probe("sdist-variable-devnull", ("materialize",), 2, "MEGATRON_PATCHSET_SDIST /dev/null is a character device",
          env={"MEGATRON_PATCHSET_SDIST": os.devnull}),
    # check --against a version: an index that does not answer, or a cache it cannot be downloaded into.
    Probe("against-index-down", ("check", "--against", "0.19.0"), 2,
          "http://127.0.0.1:9/simple did not answer for megatron_core-0.19.0.tar.gz",
          env={"MEGATRON_PATCHSET_CACHE": "{tmp}/cache"}),
    Probe("against-cache-a-file", ("check", "--against", "0.19.0"), 2, "the download cache {tmp}/cache is a file",
          write("{tmp}/cache", "x"), env={"MEGATRON_PATCHSET_CACHE": "{tmp}/cache"}),
    # A stamp that is no regular file is no stamp this tool wrote (a pipe would block the read).
    *[Probe(f"stamp-{kind}-{verb}", (verb,), 2, "so which files are yours cannot be told",
            then(materialized, odd("megatron/.patchset-stamp.json", kind)))
      for kind in ("fifo", "folder") for verb in ("status", "materialize")],
    # The checkout's lock: never taken through a link (it would be made where the link points), nor on a pipe.
    *[Probe(f"lock-{kind}-{verb[0]}", verb, 2, f".patchset.lock {says}",
            then(materialized, odd(".patchset.lock", kind)))
      for kind, says in (("fifo", "is a named pipe, not a regular file"), ("devnull", "is a symbolic link"),
                         ("dangling", "is a symbolic link"), ("folder", "is a folder"))
      for verb in (("materialize", "--backup"), ("refresh",))],
    # A named pipe in patches/: refresh and export copy patches/ whole; refused before anything is written.
    Probe("patches-fifo-export", ("export", "--queue", "{tmp}/q"), 2, "extra.patch is a named pipe",
          then(queue_at("q"), odd("patches/extra.patch", "fifo"))),
    Probe("patches-fifo-refresh", ("refresh", "--new", "x"), 2, "extra.patch is a named pipe",
          then(materialized, write("megatron/core/__init__.py", "V = 5\n"), odd("patches/extra.patch", "fifo"))),
    # Switches: a word that is neither on nor off is refused; pip's y/t for PIP_NO_INDEX mean on, as for pip.
    *[Probe(f"offline-{i}", ("materialize",), 2, says, env={**NO_SDIST, **variables})
      for i, (variables, says) in enumerate((
          ({"MEGATRON_PATCHSET_OFFLINE": "maybe"}, "MEGATRON_PATCHSET_OFFLINE='maybe' is neither on"),
          ({"MEGATRON_PATCHSET_OFFLINE": "é"}, "MEGATRON_PATCHSET_OFFLINE='é' is neither on"),
          ({"MEGATRON_PATCHSET_OFFLINE": "2"}, "MEGATRON_PATCHSET_OFFLINE='2' is neither on"),
          ({"PIP_NO_INDEX": "y"}, "offline (MEGATRON_PATCHSET_OFFLINE/PIP_NO_INDEX set)"),
          ({"MEGATRON_PATCHSET_OFFLINE": "Off", "PIP_NO_INDEX": "T"},
           "offline (MEGATRON_PATCHSET_OFFLINE/PIP_NO_INDEX")))],
    # The review verbs: a smoke command of another form, a job count that is no count, a rewrite chain.
    *[Probe(f"smoke-malformed-{verb[0]}", verb, 1 if verb == ("lint",) else 2,
            "alloc.patch: X-Smoke 'make check' is not a smoke command: it is none of",
            edit("patches/alloc.patch", "Last-Update:", "X-Smoke: make check\nLast-Update:"))
      for verb in (("lint",), ("prefixes",), ("prefixes", "--smoke"))],
    Probe("prefixes-jobs-zero", ("prefixes", "--jobs", "0"), 2, "argument --jobs: must be > 0, got 0"),
    Probe("prefixes-jobs-word", ("prefixes", "--jobs", "two"), 2, "argument --jobs: 'two' is not a whole number"),
    Probe("lint-chains", ("lint", "--chains"), 1, "lint: twice.patch: rewrites 1 line(s) that the earlier alloc.patch",
          then(write("patches/twice.patch", "Description: Maxpool off\nOrigin: vendor, hfsdp\nBug: none\n"
                     "Forwarded: no\nApplied-Upstream: no\nLast-Update: 2026-11-21\n---\n"
                     "diff --git a/megatron/core/alloc.py b/megatron/core/alloc.py\n--- a/megatron/core/alloc.py\n"
                     "+++ b/megatron/core/alloc.py\n@@ -21,3 +21,3 @@\n line_20 = 20\n-maxpool = True\n"
                     "+maxpool = False\n line_21 = 21\n"),
               edit("patches/series", "train.patch\n", "train.patch\ntwice.patch\n"))),
    # 9. Names and options.
    Probe("new-bad-name", ("refresh", "--new", "Bad Name"), 2, "--new 'Bad Name' is not a patch name", materialized),
    Probe("drop-bad-name", ("export", "--queue", "{tmp}", "--drop", "../x"), 2, "--drop '../x' is not a patch name"),
    Probe("patch-and-new", ("refresh", "--patch", "a", "--new", "b"), 2, "not allowed with argument"),
    Probe("unknown-verb", ("frobnicate",), 2, "invalid choice"),
    Probe("no-verb", (), 2, "required"),
    # 9. Ctrl-C, a closed pipe, and HFSDP_DEBUG=1 (through the program itself).
    Probe("ctrl-c-materialize", ("materialize",), 130, "patchset: interrupted", process=True, interrupt_at=8),
    Probe("ctrl-c-refresh", ("refresh", "--new", "x"), 130, "patchset: interrupted",
          then(materialized, write("megatron/core/__init__.py", "VALUE = 5\n")), process=True, interrupt_at=30),
    Probe("ctrl-c-queue", ("queue", "--dir", "{tmp}/q"), 130, "patchset: interrupted", process=True, interrupt_at=12),
    *[Probe(f"pipe-{verb[0]}", verb, QUIET, "", materialized, process=True, closed_stdout=True)
      for verb in (("status",), ("overlay",), ("lint",), ("diff", "--series"))],
    Probe("wrapper-python-missing", ("status",), 2, "PYTHON=/nonexistent is not a Python >= 3.11",
          env={"PYTHON": "/nonexistent"}, process=True),
    Probe("debug-traceback", ("status",), 2, "Traceback", root="{tmp}", env={"HFSDP_DEBUG": "1"}),
]


def _fill(text: str, env: Env, tmp: Path) -> str:
    return text.format(root=env.project.root, tmp=tmp, sdist=env.sdist, store=env.sdist.parent)


def _in_process(probe: Probe, root: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(["--root", root, *argv])
    except SystemExit as exc:  # argparse's refusals
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _as_program(probe: Probe, root: str, argv: list[str]) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{HERE}", "PATCHSET_INTERRUPT_AT": str(probe.interrupt_at)}
    if probe.interrupt_at:
        command = [sys.executable, str(HERE / "kill_points.py")]
    else:
        command = [str(REPO / "scripts" / "patchset")]
        if "PYTHON" not in probe.env:
            env["PYTHON"] = sys.executable
    proc = subprocess.Popen([*command, "--root", root, *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if probe.closed_stdout:
        assert proc.stdout is not None
        proc.stdout.close()  # before the program has written a line: every write finds the reader gone
        err = proc.stderr.read() if proc.stderr is not None else ""
        return proc.wait(timeout=300), "", err
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


@pytest.mark.parametrize("probe", PROBES, ids=[p.id for p in PROBES])
def test_probe(overlaid: Env, tmp_path: Path, probe: Probe, monkeypatch: pytest.MonkeyPatch,
               capsys: pytest.CaptureFixture[str]) -> None:
    tmp = tmp_path / "scratch"
    tmp.mkdir()
    monkeypatch.delenv("HFSDP_DEBUG", raising=False)
    probe.setup(overlaid, tmp)
    for key, value in probe.env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, _fill(value, overlaid, tmp))
    root, argv = _fill(probe.root, overlaid, tmp), [_fill(a, overlaid, tmp) for a in probe.argv]
    rc, out, err = (_as_program(probe, root, argv) if probe.process else _in_process(probe, root, argv, capsys))
    if probe.rc == QUIET:
        assert err == "" and rc == usererror.CLOSED_PIPE_EXIT, (rc, err)  # 141, as coreutils
        return
    assert rc == probe.rc, (rc, out, err)
    assert probe.says.replace("{tmp}", str(tmp)) in out + err, (out, err)
    assert ("Traceback" in err) is (probe.env.get("HFSDP_DEBUG") == "1"), err
    if probe.interrupt_at:  # Ctrl-C: nothing half-written is left, in the checkout or beside a queue
        left = [p.name for p in (*overlaid.project.root.iterdir(), *tmp.iterdir()) if ".patchset-" in p.name
                and p.name != ".patchset.lock"]
        assert left == [], left
