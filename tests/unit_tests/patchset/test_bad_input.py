"""Bad input a new user meets, refused with a sentence that is right about the cause and the way out.

Driven through the command line (``hfsdp.patchset.cli.main``); the probe table
(test_patchset_probe_table.py) runs the same inputs as a user would, through ``scripts/patchset``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from patchset_fake import Env

from hfsdp.patchset.cli import main
from hfsdp.patchset.pin import is_digest, is_relative_path, is_tree_path
from hfsdp.patchset.series import crlf_line


def cli(env: Env, *args: str) -> int:
    return main(["--root", str(env.project.root), *args])


def test_crlf_line_counts_the_patch_syntax_not_the_content_of_a_crlf_file() -> None:
    of_a_crlf_file = ("diff --git a/megatron/core/w.py b/megatron/core/w.py\n--- a/megatron/core/w.py\n"
                      "+++ b/megatron/core/w.py\n@@ -1,2 +1,2 @@ def f():\r\n def f():\r\n-    return 1\r\n"
                      "+    return 2\r\n")
    assert crlf_line(of_a_crlf_file) is None
    assert crlf_line(of_a_crlf_file.replace("+++ b/megatron/core/w.py\n", "+++ b/megatron/core/w.py\r\n")) == 3
    assert crlf_line("@@ -1 +1 @@\r\n") == 1
    assert crlf_line("Description: x\r\n---\n", header_lines=1) == 1


@pytest.mark.parametrize("path", ["megatron", "megatron/", "/megatron/core", "megatron//core", "megatron/./core",
                                  "megatron/../core", "megatron/core/", "megatron/co\0re", "core/x.py", None, 3])
def test_a_path_outside_the_tree_is_never_a_tree_path(path: object) -> None:
    """One check for the pin's members, a stamp's paths and (below a member) overlay files."""
    assert not is_tree_path(path)
    assert is_tree_path("megatron/core") and is_tree_path("megatron/core/x.py")
    assert is_relative_path("core/x.py") and not is_relative_path("../x.py") and not is_relative_path("")


def test_a_digest_is_64_lowercase_hex_digits() -> None:
    assert is_digest("0" * 64) and not is_digest("A" * 64) and not is_digest("0" * 63) and not is_digest(None)


def test_sdist_a_folder_is_called_a_folder(fake: Env, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    assert cli(fake, "--sdist", str(fake.sdist.parent), "materialize") == 2
    err = capsys.readouterr().err
    assert f"--sdist {fake.sdist.parent} is a folder, not an sdist file" in err
    assert f"it holds {fake.sdist.name}: pass the sdist file itself, e.g. --sdist {fake.sdist}" in err
    assert not fake.project.megatron_dir.exists()
    assert cli(fake, "--sdist", str(tmp_path / "nowhere.tar.gz"), "check") == 2
    assert "nowhere.tar.gz does not exist" in capsys.readouterr().err


def test_sdist_and_root_are_taken_after_the_verb_too(fake: Env, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("MEGATRON_PATCHSET_SDIST")
    monkeypatch.setenv("MEGATRON_PATCHSET_OFFLINE", "1")
    root = str(fake.project.root)
    assert main(["materialize", "--sdist", str(fake.sdist), "--root", root]) == 0
    assert main(["status", "--root", root]) == 0
    capsys.readouterr()
    assert main(["lint", "--root", root, "--sdist", str(fake.sdist.parent)]) == 2  # checked there as well
    assert "is a folder, not an sdist file" in capsys.readouterr().err
    assert main(["--root", root, "queue", "--dir", str(tmp_path / "q"), "--sdist", str(fake.sdist)]) == 0


def test_status_names_a_patch_file_the_series_does_not_list(fake: Env, capsys) -> None:
    assert cli(fake, "materialize") == 0
    (fake.project.patches_dir / "forgotten.patch").write_text("Description: never applied\n")
    capsys.readouterr()
    assert cli(fake, "status") == 1  # up to date, but a patch of the checkout is not in the tree
    out = capsys.readouterr().out
    assert "unlisted: patches/forgotten.patch is not in patches/series, so it is never applied" in out
    assert "stamp:   up to date" in out
    (fake.project.patches_dir / "forgotten.patch").unlink()
    assert cli(fake, "status") == 0


@pytest.mark.parametrize(("field", "value"), [
    ("schema", True), ("schema", 3.0), ("schema", "3"), ("base_version", ""), ("sdist_sha256", "abc"),
    ("files", {"megatron/../../outside.py": "0" * 64}), ("files", {"/etc/passwd": "0" * 64}),
    ("files", {"megatron/core/__init__.py": 1}), ("patches", [{"name": "alloc.patch", "sha256": 7}]),
    ("overlay", [{"path": "../escape.py", "sha256": "0" * 64}]),
])
def test_a_stamp_value_of_another_type_is_not_one_this_tool_wrote(fake: Env, field: str, value: object,
                                                                   capsys) -> None:
    """Only what this tool writes is read: true is not schema 1, 3.0 not 3; no path outside megatron/ (diff and
    refresh write and delete the paths a stamp names)."""
    assert cli(fake, "materialize") == 0
    stamp = fake.project.megatron_dir / ".patchset-stamp.json"
    data = json.loads(stamp.read_text())
    data[field] = value
    stamp.write_text(json.dumps(data))
    capsys.readouterr()
    assert cli(fake, "status") == 2
    err = capsys.readouterr().err
    assert "is not one this tool wrote" in err and "Traceback" not in err


def test_a_full_disk_is_a_sentence_not_a_traceback(fake: Env, monkeypatch, capsys) -> None:
    """An error of the machine (no space, no permission, a read-only folder) is told as such, naming the path."""
    import errno

    from hfsdp.patchset import materialize as materialize_mod

    def full(*args: object, **kwargs: object) -> str:
        raise OSError(errno.ENOSPC, "No space left on device", str(fake.project.root))

    monkeypatch.setattr(materialize_mod.tempfile, "mkdtemp", full)
    capsys.readouterr()
    assert cli(fake, "materialize") == 2
    err = capsys.readouterr().err
    assert f"No space left on device ({fake.project.root}); nothing was left half-written" in err
    assert "Traceback" not in err and not fake.project.megatron_dir.exists()
    monkeypatch.setattr(materialize_mod.tempfile, "mkdtemp", lambda *a, **k: (_ for _ in ()).throw(KeyError("bug")))
    with pytest.raises(KeyError):  # anything else is a bug, and keeps its traceback
        cli(fake, "materialize")


def _no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    from hfsdp.patchset import source

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("downloaded although the cache was refused")

    monkeypatch.setattr(source, "_download", refuse)
    monkeypatch.setattr(source, "_index_url_for", refuse)


def test_a_download_cache_under_a_file_is_refused_before_any_download(fake: Env, tmp_path: Path,
                                                                       monkeypatch) -> None:
    from hfsdp.patchset.errors import SourceUnavailable
    from hfsdp.patchset.source import locate_sdist

    _no_download(monkeypatch)
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    for cache in (blocker, blocker / "cache"):
        with pytest.raises(SourceUnavailable) as info:
            locate_sdist(fake.project.pin(), env={"MEGATRON_PATCHSET_CACHE": str(cache)})
        assert info.value.cause.startswith(f"the download cache {cache} ") and str(blocker) in info.value.cause
        assert info.value.cause.endswith(f"so {fake.project.pin().filename} cannot be downloaded into it")
        assert "MEGATRON_PATCHSET_CACHE" in info.value.fix
    assert blocker.read_text() == "mine\n"


def test_a_download_cache_that_is_not_writable_is_refused_before_any_download(fake: Env, tmp_path: Path,
                                                                                monkeypatch, lock_folder) -> None:
    from hfsdp.patchset.errors import SourceUnavailable
    from hfsdp.patchset.source import locate_sdist

    _no_download(monkeypatch)
    locked = lock_folder(tmp_path / "locked")
    with pytest.raises(SourceUnavailable, match=f"{locked} is not writable, so"):
        locate_sdist(fake.project.pin(), env={"MEGATRON_PATCHSET_CACHE": str(locked / "cache")})


def _no_source(monkeypatch: pytest.MonkeyPatch) -> None:
    from hfsdp.patchset import queue

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("looked for the sdist although --dir was refused")

    monkeypatch.setattr(queue, "locate_sdist", refuse)


def test_a_queue_dir_under_a_file_or_a_dead_link_is_refused_before_anything_runs(fake: Env, tmp_path: Path,
                                                                                   monkeypatch) -> None:
    from hfsdp.patchset.errors import PatchsetError
    from hfsdp.patchset.queue import make_queue

    _no_source(monkeypatch)
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    with pytest.raises(PatchsetError) as info:
        make_queue(fake.project, blocker / "q")
    assert info.value.cause == f"--dir {blocker / 'q'} lies under {blocker}, which is a file"
    dead = tmp_path / "dead"
    dead.symlink_to(tmp_path / "nowhere")
    with pytest.raises(PatchsetError, match="which is a symbolic link to nothing"):
        make_queue(fake.project, dead / "q")
    assert blocker.read_text() == "mine\n" and not (tmp_path / "nowhere").exists()


def test_a_queue_dir_in_a_folder_that_is_not_writable_is_refused_before_anything_runs(
        fake: Env, tmp_path: Path, monkeypatch, lock_folder) -> None:
    from hfsdp.patchset.errors import PatchsetError
    from hfsdp.patchset.queue import make_queue

    _no_source(monkeypatch)
    (tmp_path / "locked" / "empty").mkdir(parents=True)
    locked = lock_folder(tmp_path / "locked")
    with pytest.raises(PatchsetError, match=f"--dir {locked / 'new'}: {locked} is not writable"):
        make_queue(fake.project, locked / "new")
    with pytest.raises(PatchsetError, match=f"--dir {locked / 'empty'}: {locked} is not writable"):
        make_queue(fake.project, locked / "empty")  # replaced from beside it
    assert sorted(p.name for p in locked.iterdir()) == ["empty"]


@pytest.mark.parametrize("kind", ["fifo", "dangling-link"])
def test_a_cached_sdist_that_is_no_file_is_never_replaced_by_a_download(
        fake: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        kind: str) -> None:
    """With the index answering, a download would rename a fresh copy over what the user put in the cache."""
    import os
    import stat

    from patchset_fake import package_index, point_at_index

    cache = tmp_path / "cache"
    cache.mkdir()
    cached = cache / "megatron_core-0.18.2.tar.gz"
    os.mkfifo(cached) if kind == "fifo" else os.symlink(tmp_path / "elsewhere.tar.gz", cached)
    monkeypatch.delenv("MEGATRON_PATCHSET_SDIST")
    with package_index({"megatron_core-0.18.2.tar.gz": fake.sdist.read_bytes()}) as url:
        point_at_index(fake, url)
        assert cli(fake, "materialize") == 2
    assert f"the cached sdist {cached} is a" in capsys.readouterr().err
    mode = os.lstat(cached).st_mode
    assert stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISLNK(mode)
    assert not (tmp_path / "elsewhere.tar.gz").exists() and not fake.project.megatron_dir.exists()


def test_a_repository_variable_of_the_caller_does_not_reach_the_queues_git(
        fake: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GIT_OBJECT_DIRECTORY (or GIT_DIR, ...) from a git hook must not send a queue's objects elsewhere: the
    queue would be unusable once the variable is gone."""
    import subprocess

    elsewhere = tmp_path / "objects"
    monkeypatch.setenv("GIT_OBJECT_DIRECTORY", str(elsewhere))
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS", "'core.autocrlf'='true'")
    assert cli(fake, "queue", "--dir", str(tmp_path / "q")) == 0
    assert not elsewhere.exists()
    monkeypatch.delenv("GIT_OBJECT_DIRECTORY")
    monkeypatch.delenv("GIT_CONFIG_PARAMETERS")
    log = subprocess.run(["git", "log", "--format=%s"], cwd=tmp_path / "q", capture_output=True, text=True)
    assert log.returncode == 0 and log.stdout.split() == ["train", "alloc", "overlay", "base"], log
