"""Materialization: hash and version checks, offline errors, atomicity, dirty and foreign trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from patchset_fake import ALLOC_PATCH, Env, make_sdist, patch_text, tree_digest

from hfsdp.patchset.errors import (
    DirtyTree,
    ForeignTree,
    HashMismatch,
    PatchDoesNotApply,
    SourceUnavailable,
    WrongBaseVersion,
)
from hfsdp.patchset.materialize import materialize, tree_status
from hfsdp.patchset.stamp import read_stamp


def quiet(*_: object) -> None:
    pass


def leftovers(env: Env) -> list[str]:
    return sorted(p.name for p in env.project.root.iterdir() if p.name.startswith(".patchset-"))


def test_materialize_applies_series_and_stamps(fake: Env) -> None:
    assert materialize(fake.project, log=quiet) is True
    tree = fake.project.megatron_dir
    assert "maxpool = True" in (tree / "core" / "alloc.py").read_text()
    assert "'fork'" in (tree / "training" / "train.py").read_text()
    stamp = read_stamp(fake.project.root)
    assert stamp is not None
    assert [n for n, _ in stamp.patches] == ["alloc.patch", "train.patch"]
    assert stamp.fork_version == "0.18.2+hfsdp.7"
    assert stamp.sdist_sha256 == fake.project.pin().sha256
    assert set(stamp.files) == {"megatron/core/__init__.py", "megatron/core/alloc.py", "megatron/training/train.py"}
    assert leftovers(fake) == []


def test_reinstall_with_current_stamp_is_a_noop(fake: Env) -> None:
    materialize(fake.project, log=quiet)
    before = tree_digest(fake.project.megatron_dir)
    inode = fake.project.megatron_dir.stat().st_ino
    lines: list[str] = []
    assert materialize(fake.project, log=lines.append) is False
    assert "up to date" in lines[0]
    assert fake.project.megatron_dir.stat().st_ino == inode  # not even swapped
    assert tree_digest(fake.project.megatron_dir) == before


def test_new_fork_release_restamps_the_tree(fake: Env) -> None:
    """Bumping ``[fork] release`` makes the tree stale, so the installed version follows it."""
    materialize(fake.project, log=quiet)
    assert read_stamp(fake.project.root).fork_version == "0.18.2+hfsdp.7"
    base = fake.project.root / "patches" / "base.toml"
    base.write_text(base.read_text().replace("release = 7", "release = 8"))
    stale = tree_status(fake.project)
    assert not stale.up_to_date
    assert stale.fork_mismatch == ("tree stamped 0.18.2+hfsdp.7, patches/base.toml says 0.18.2+hfsdp.8 "
                                   "([fork] release changed)")
    assert materialize(fake.project, log=quiet) is True
    assert read_stamp(fake.project.root).fork_version == "0.18.2+hfsdp.8"
    assert tree_status(fake.project).up_to_date and tree_status(fake.project).fork_mismatch is None


def test_hash_mismatch_is_refused_and_nothing_is_extracted(fake: Env, tmp_path: Path, monkeypatch) -> None:
    evil = make_sdist(tmp_path, files={"megatron/core/__init__.py": "EVIL = 1\n", "megatron/training/x.py": ""})
    monkeypatch.setenv("MEGATRON_PATCHSET_SDIST", str(evil))
    with pytest.raises(HashMismatch) as info:
        materialize(fake.project, log=quiet)
    assert "sha256" in info.value.cause and "nothing was extracted" in info.value.cause
    assert "pip download" in info.value.fix
    assert not fake.project.megatron_dir.exists()
    assert leftovers(fake) == []


def test_wrong_base_version_by_file_name(fake: Env, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEGATRON_PATCHSET_SDIST", str(make_sdist(tmp_path, version="0.19.0")))
    with pytest.raises(WrongBaseVersion) as info:
        materialize(fake.project, log=quiet)
    assert "0.19.0" in info.value.cause and "0.18.2" in info.value.cause
    assert "check --against" in info.value.fix
    assert not fake.project.megatron_dir.exists()


def test_wrong_base_version_inside_a_renamed_sdist(fake: Env, tmp_path: Path, monkeypatch) -> None:
    # A 0.19.0 tarball renamed to the pinned name still fails: first on the hash, and with a
    # matching pin, on PKG-INFO.
    other = make_sdist(tmp_path, version="0.18.2", pkg_version="0.19.0")
    monkeypatch.setenv("MEGATRON_PATCHSET_SDIST", str(other))
    with pytest.raises(HashMismatch):
        materialize(fake.project, log=quiet)
    base = fake.project.patches_dir / "base.toml"
    from patchset_fake import sha256

    base.write_text(base.read_text().replace(fake.project.pin().sha256, sha256(other)))
    with pytest.raises(WrongBaseVersion) as info:
        materialize(fake.project, log=quiet)
    assert "contains megatron-core 0.19.0" in info.value.cause
    assert not fake.project.megatron_dir.exists()


def test_offline_with_no_source_says_how_to_install_offline(fake: Env, monkeypatch) -> None:
    monkeypatch.delenv("MEGATRON_PATCHSET_SDIST")
    monkeypatch.setenv("MEGATRON_PATCHSET_OFFLINE", "1")
    with pytest.raises(SourceUnavailable) as info:
        materialize(fake.project, log=quiet)
    assert "offline" in info.value.cause and "megatron_core-0.18.2.tar.gz" in info.value.cause
    assert "pip download --no-deps --no-binary :all: megatron-core==0.18.2" in info.value.fix
    assert "MEGATRON_PATCHSET_SDIST" in info.value.fix


def test_wheelhouse_and_cache_are_searched_offline(fake: Env, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MEGATRON_PATCHSET_SDIST")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    house = tmp_path / "wheelhouse"
    house.mkdir()
    os.link(fake.sdist, house / fake.sdist.name)
    monkeypatch.setenv("PIP_FIND_LINKS", f"file://{house}")
    assert materialize(fake.project, log=quiet) is True


def test_download_failure_names_the_network(fake: Env, monkeypatch) -> None:
    monkeypatch.delenv("MEGATRON_PATCHSET_SDIST")
    with pytest.raises(SourceUnavailable) as info:
        materialize(fake.project, log=quiet)
    assert "could not download" in info.value.cause
    assert "MEGATRON_PATCHSET_SDIST" in info.value.fix


def test_patch_that_does_not_apply_names_patch_and_file_and_keeps_tree(fake: Env) -> None:
    materialize(fake.project, log=quiet)
    before = tree_digest(fake.project.megatron_dir)
    broken = ALLOC_PATCH.replace(" line_20 = 20\n", " line_20 = 2000\n")
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", broken)})
    with pytest.raises(PatchDoesNotApply) as info:
        materialize(fake.project, log=quiet)
    assert info.value.patch == "alloc.patch"
    assert info.value.files == ["megatron/core/alloc.py"]
    assert "alloc.patch" in str(info.value) and "megatron/core/alloc.py" in str(info.value)
    assert "not changed" in info.value.fix
    assert tree_digest(fake.project.megatron_dir) == before
    assert leftovers(fake) == []


def test_dirty_tree_is_refused_and_edits_stay(fake: Env) -> None:
    materialize(fake.project, log=quiet)
    edited = fake.project.megatron_dir / "core" / "__init__.py"
    edited.write_text("VALUE = 2  # my experiment\n")
    (fake.project.megatron_dir / "core" / "new_module.py").write_text("X = 1\n")
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH)})  # stale: forces a rebuild
    with pytest.raises(DirtyTree) as info:
        materialize(fake.project, log=quiet)
    assert "modified megatron/core/__init__.py" in info.value.cause.replace("  ", " ").replace("  ", " ")
    assert "megatron/core/new_module.py" in info.value.cause
    assert "scripts/patchset refresh" in info.value.fix and "diff > my.patch" in info.value.fix
    assert edited.read_text() == "VALUE = 2  # my experiment\n"
    assert (fake.project.megatron_dir / "core" / "new_module.py").exists()


def test_backup_keeps_the_edited_tree(fake: Env) -> None:
    materialize(fake.project, log=quiet)
    (fake.project.megatron_dir / "core" / "__init__.py").write_text("VALUE = 3\n")
    assert materialize(fake.project, backup=True, log=quiet) is True
    backups = list(fake.project.root.glob("megatron.bak-*"))
    assert len(backups) == 1 and (backups[0] / "core" / "__init__.py").read_text() == "VALUE = 3\n"
    assert (fake.project.megatron_dir / "core" / "__init__.py").read_text() == "VALUE = 1\n"


def test_foreign_tree_is_refused(fake: Env) -> None:
    (fake.project.megatron_dir / "core").mkdir(parents=True)
    (fake.project.megatron_dir / "core" / "mine.py").write_text("precious = True\n")
    with pytest.raises(ForeignTree) as info:
        materialize(fake.project, log=quiet)
    assert "no .patchset-stamp.json" in info.value.cause and "mv " in info.value.fix
    assert (fake.project.megatron_dir / "core" / "mine.py").read_text() == "precious = True\n"


def test_status_reports_stale_and_edits(fake: Env) -> None:
    assert tree_status(fake.project).exists is False
    materialize(fake.project, log=quiet)
    st = tree_status(fake.project)
    assert st.up_to_date and st.edits == {} and st.applied == ["alloc.patch", "train.patch"]
    (fake.project.megatron_dir / "training" / "train.py").write_text("changed\n")
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag, reworded", ALLOC_PATCH)})
    st = tree_status(fake.project)
    assert not st.up_to_date
    assert st.changed_patches == ["alloc.patch"]
    assert st.edits == {"megatron/training/train.py": "modified"}


def test_caches_and_built_objects_are_not_edits(fake: Env) -> None:
    materialize(fake.project, log=quiet)
    cache = fake.project.megatron_dir / "core" / "__pycache__"
    cache.mkdir()
    (cache / "alloc.cpython-312.pyc").write_bytes(b"\0")
    (fake.project.megatron_dir / "core" / "helpers_cpp.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\0")
    assert tree_status(fake.project).edits == {}
    assert materialize(fake.project, log=quiet) is False
