"""Fixtures: a synthetic upstream sdist and a throw-away project checkout around it.

The tooling is exercised end to end (tarball, sha256, git apply, stamp, swap) on a few-file
fake of megatron-core, so every error path runs in milliseconds without the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import json
import tarfile
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hfsdp.patchset.project import Project

BASE_FILES = {
    "megatron/core/__init__.py": "VALUE = 1\n",
    "megatron/core/alloc.py": "".join(f"line_{i} = {i}\n" for i in range(40)),
    "megatron/training/train.py": "def train():\n    return 'upstream'\n",
}


def make_sdist(folder: Path, version: str = "0.18.2", files: dict[str, str] | None = None,
               pkg_version: str | None = None, name: str | None = None) -> Path:
    """Write a megatron_core-<version>.tar.gz with PKG-INFO and the given files."""
    root = f"megatron_core-{version}"
    path = folder / (name or f"{root}.tar.gz")
    members = {"PKG-INFO": f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {pkg_version or version}\n"}
    members.update(files or BASE_FILES)
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in sorted(members.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{root}/{rel}")
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


HEADER = textwrap.dedent(
    """\
    Description: {desc}
     Why it exists, in more words.
    Origin: vendor, hfsdp
    Bug: none
    Forwarded: no
    Applied-Upstream: no
    Last-Update: 2026-11-21
    """
)


def patch_text(desc: str, diff: str) -> str:
    return HEADER.format(desc=desc) + "---\n" + diff


ALLOC_PATCH = textwrap.dedent(
    """\
    diff --git a/megatron/core/alloc.py b/megatron/core/alloc.py
    --- a/megatron/core/alloc.py
    +++ b/megatron/core/alloc.py
    @@ -19,4 +19,5 @@ line_18 = 18
     line_19 = 19
     line_20 = 20
    +maxpool = True
     line_21 = 21
     line_22 = 22
    """
)
TRAIN_PATCH = textwrap.dedent(
    """\
    diff --git a/megatron/training/train.py b/megatron/training/train.py
    --- a/megatron/training/train.py
    +++ b/megatron/training/train.py
    @@ -1,2 +1,2 @@
     def train():
    -    return 'upstream'
    +    return 'fork'
    """
)


# Whole files of the fork (patches/overlay/), at their megatron/ paths: a module in a package the base has,
# and one in a package of its own.
OVERLAY_FILES = {
    "megatron/core/maxpool_allocator.py": textwrap.dedent(
        """\
        import logging

        logger = logging.getLogger(__name__)
        POOL_LANES = 2


        class MaxPoolAllocator:
            def allocate(self, size):
                return bytearray(size)


        def _private_helper():
            return None
        """),
    "megatron/training/fork/teardown.py": "def tear_down():\n    return 'clean'\n",
}


@dataclass
class Env:
    project: Project
    sdist: Path
    env: dict[str, str]

    def write_series(self, patches: dict[str, str]) -> None:
        """The series becomes ``patches``; a patch it no longer lists goes, as a real drop's file does."""
        for gone in self.project.patches_dir.glob("*.patch"):
            if gone.name not in patches:
                gone.unlink()
        for name, text in patches.items():
            (self.project.patches_dir / name).write_text(text)
        (self.project.patches_dir / "series").write_text("# test series\n" + "".join(f"{n}\n" for n in patches))

    def write_overlay(self, files: dict[str, str]) -> None:
        """Add (or replace) files of patches/overlay/, keyed by their megatron/ path."""
        for path, text in files.items():
            target = self.project.overlay_dir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)

    def series_with(self, alloc: str = ALLOC_PATCH, desc: str = "Add maxpool flag") -> None:
        """The two-patch series with another alloc.patch (as a pull or an edit of it would make it)."""
        self.write_series({"alloc.patch": patch_text(desc, alloc),
                           "train.patch": patch_text("Fork training", TRAIN_PATCH)})


def save_during_build(monkeypatch: pytest.MonkeyPatch, path: Path, text: str) -> None:
    """Make the next materialize write ``text`` to ``path`` while it builds (an editor saving)."""
    from hfsdp.patchset import materialize as materialize_mod

    real = materialize_mod.build_queue

    def build(*args, **kwargs):
        path.write_text(text)
        monkeypatch.setattr(materialize_mod, "build_queue", real)
        return real(*args, **kwargs)

    monkeypatch.setattr(materialize_mod, "build_queue", build)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Env:
    """A project root with a pinned fake sdist (found through MEGATRON_PATCHSET_SDIST) and two patches."""
    store = tmp_path / "store"
    store.mkdir()
    sdist = make_sdist(store)
    root = tmp_path / "my chéckout"  # a space and non-ASCII: every command the tools suggest must survive them
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "base.toml").write_text(textwrap.dedent(f"""\
        [base]
        distribution = "megatron-core"
        version = "0.18.2"
        filename = "megatron_core-0.18.2.tar.gz"
        sha256 = "{sha256(sdist)}"
        url = "http://127.0.0.1:9/unreachable.tar.gz"
        index_url = "http://127.0.0.1:9/simple"
        members = ["megatron/core", "megatron/training"]
        [fork]
        name = "hfsdp"
        release = 7
        """))
    env = Env(Project(root), sdist, {})
    env.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                      "train.patch": patch_text("Fork training", TRAIN_PATCH)})
    for var in ("MEGATRON_PATCHSET_FIND_LINKS", "PIP_FIND_LINKS", "PIP_NO_INDEX", "MEGATRON_PATCHSET_OFFLINE",
                "HFSDP_BASE"):  # the fake has the default base only (test_bases.py adds another)
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MEGATRON_PATCHSET_SDIST", str(sdist))
    monkeypatch.setenv("MEGATRON_PATCHSET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1795000000")
    return env


@pytest.fixture
def overlaid(fake: Env) -> Env:
    """The fake project with an overlay of two files (OVERLAY_FILES)."""
    fake.write_overlay(OVERLAY_FILES)
    return fake


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root (stamp included) -> sha256, to prove a tree was left untouched."""
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def package_index(files: dict[str, bytes], yanked: dict[str, str] | None = None) -> Iterator[str]:
    """A local PEP 691 simple index for megatron-core serving ``files`` (name -> bytes) with their sha256,
    the names in ``yanked`` marked yanked with that reason; yields its base URL (``<url>/simple``,
    ``<url>/files/<name>``)."""
    marks = yanked or {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            host = f"http://127.0.0.1:{self.server.server_address[1]}"
            if self.path == "/simple/megatron-core/":
                entries = [{"filename": name, "url": f"{host}/files/{name}",
                            "hashes": {"sha256": hashlib.sha256(data).hexdigest()},
                            "yanked": marks.get(name, False)} for name, data in files.items()]
                body = json.dumps({"meta": {"api-version": "1.1"}, "files": entries}).encode()
            elif self.path.startswith("/files/") and self.path[7:] in files:
                body = files[self.path[7:]]
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def point_at_index(env: Env, url: str) -> None:
    """Make ``env``'s base.toml download from the index at ``url`` (no local sdist, an empty cache)."""
    base = env.project.patches_dir / "base.toml"
    base.write_text(base.read_text().replace("http://127.0.0.1:9/unreachable.tar.gz",
                                             f"{url}/files/megatron_core-0.18.2.tar.gz")
                    .replace("http://127.0.0.1:9/simple", f"{url}/simple"))


def set_pin(env: Env, sha256_hex: str) -> None:
    """Replace the sha256 pinned in ``env``'s base.toml."""
    base = env.project.patches_dir / "base.toml"
    base.write_text(base.read_text().replace(env.project.pin().sha256, sha256_hex))


OTHER = "0.19.2"  # the second base of the `two` fixture
TRAIN_OTHER = TRAIN_PATCH.replace("-    return 'upstream'", "-    return 'upstream, later'")


@pytest.fixture
def two(fake: Env, monkeypatch: pytest.MonkeyPatch) -> Env:
    """``fake`` with a second base, 0.19.2 (its own train.patch variant; the shared alloc.patch applies there two
    lines further down), both sdists in a wheelhouse folder."""
    store = fake.sdist.parent
    files = dict(BASE_FILES)
    files["megatron/training/train.py"] = "def train():\n    return 'upstream, later'\n"
    files["megatron/core/alloc.py"] = "# a later release\nlater = True\n" + BASE_FILES["megatron/core/alloc.py"]
    sdist = make_sdist(store, version=OTHER, files=files)
    folder = fake.project.patches_dir / "bases" / OTHER
    folder.mkdir(parents=True)
    pin = (fake.project.patches_dir / "base.toml").read_text()
    pin = pin.replace("0.18.2", OTHER).replace(sha256(fake.sdist), sha256(sdist)).replace("release = 7", "release = 1")
    (folder / "base.toml").write_text(pin)
    (folder / "train.patch").write_text(patch_text("Fork training, on the later release", TRAIN_OTHER))
    (folder / "series").write_text("# the later base\nalloc.patch\ntrain.patch\n")
    monkeypatch.delenv("MEGATRON_PATCHSET_SDIST")
    monkeypatch.setenv("MEGATRON_PATCHSET_FIND_LINKS", str(store))
    return fake
