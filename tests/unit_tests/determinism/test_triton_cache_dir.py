"""One Triton cache folder for the whole life of every process ([Note: one Triton cache directory per
process life] in hfsdp/autotune_cache.py). CPU only: the folders Triton and Inductor would use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfsdp import autotune_cache

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_unset_it_becomes_tritons_own_default(monkeypatch, tmp_path: Path) -> None:
    triton = pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    expected = triton.knobs.cache.dir  # what Triton uses when nobody sets the variable
    env: dict[str, str] = {"TRITON_HOME": str(tmp_path)}
    assert autotune_cache.pin_cache_dir(env) == expected == env["TRITON_CACHE_DIR"]
    assert expected == str(tmp_path / ".triton" / "cache")


def test_without_triton_home_it_is_under_the_home_folder(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    env: dict[str, str] = {}
    assert autotune_cache.pin_cache_dir(env) == os.path.join(str(tmp_path), ".triton", "cache")


@pytest.mark.parametrize("empty", ["", None])
def test_a_users_folder_stands(empty: str | None) -> None:
    env = {"TRITON_CACHE_DIR": "/data/my triton cache"}
    assert autotune_cache.pin_cache_dir(env) is None
    assert env["TRITON_CACHE_DIR"] == "/data/my triton cache"
    if empty is not None:  # an empty value is no folder: Triton itself falls back to its default
        env = {"TRITON_CACHE_DIR": empty}
        assert autotune_cache.pin_cache_dir(env) == env["TRITON_CACHE_DIR"] != ""


def test_inductor_then_keeps_every_device_in_that_folder(monkeypatch, tmp_path: Path) -> None:
    """The premise: unset, Inductor picks a folder per device index that is not Triton's; pinned, it
    keeps ours for every device."""
    cache_dir_utils = pytest.importorskip("torch._inductor.runtime.cache_dir_utils")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    unpinned = {cache_dir_utils.triton_cache_dir(d) for d in range(4)}
    assert len(unpinned) == 4 and autotune_cache.default_cache_dir(os.environ) not in unpinned
    pinned = autotune_cache.pin_cache_dir()
    assert {cache_dir_utils.triton_cache_dir(d) for d in range(4)} == {pinned}


def test_the_entry_pins_it_before_anything_else(tmp_path: Path) -> None:
    code = (
        "import os\n"
        "from hfsdp.training import entry\n"
        "try:\n"
        "    entry.run(['--no-such-flag'], None, entry.Hooks())\n"
        "except BaseException:\n"
        "    pass\n"
        "print(os.environ.get('TRITON_CACHE_DIR'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env.update(TRITON_HOME=str(tmp_path), PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == str(tmp_path / ".triton" / "cache"), out.stderr[-2000:]
