"""Queue round trips, deterministic refresh, lint failures, check against a newer release, CLI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from patchset_fake import ALLOC_PATCH, BASE_FILES, TRAIN_PATCH, Env, make_sdist, patch_text

from hfsdp.patchset import gitops
from hfsdp.patchset.check import check_against, check_base
from hfsdp.patchset.cli import main
from hfsdp.patchset.errors import PatchDoesNotApply, SeriesError
from hfsdp.patchset.export import export_queue
from hfsdp.patchset.lint import lint
from hfsdp.patchset.materialize import materialize, tree_status
from hfsdp.patchset.queue import make_queue
from hfsdp.patchset.refresh import refresh

REPO_ROOT = Path(__file__).resolve().parents[3]


def quiet(*_: object) -> None:
    pass


def snapshot(env: Env) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(env.project.patches_dir.iterdir())}


def test_queue_then_export_is_byte_identical(fake: Env, tmp_path: Path) -> None:
    # Exported patches are canonical; a round trip through the queue must not change a byte.
    queue = make_queue(fake.project, tmp_path / "q")
    export_queue(fake.project, queue.repo, log=quiet)
    first = snapshot(fake)
    export_queue(fake.project, make_queue(fake.project, tmp_path / "q2").repo, log=quiet)
    assert snapshot(fake) == first
    assert [line for line in first["series"].decode().splitlines() if not line.startswith("#")] == [
        "alloc.patch", "train.patch"]


def _edit_alloc(project) -> None:
    alloc = project.megatron_dir / "core" / "alloc.py"
    alloc.write_text(alloc.read_text().replace("line_30 = 30\n", "line_30 = 30\nstrict_homes = True\n"))


def test_refresh_into_owning_patch_is_deterministic(fake: Env, tmp_path: Path) -> None:
    # Canonicalize first so the comparison below only sees the refresh.
    export_queue(fake.project, make_queue(fake.project, tmp_path / "q").repo, log=quiet)
    twin_root = tmp_path / "twin"
    shutil.copytree(fake.project.root, twin_root)  # a second checkout in the same state
    before = snapshot(fake)
    materialize(fake.project, log=quiet)
    _edit_alloc(fake.project)
    assert refresh(fake.project, log=quiet) == "alloc.patch"  # the only patch touching alloc.py
    after = snapshot(fake)
    assert "+strict_homes = True" in after["alloc.patch"].decode()
    assert "Last-Update: 2026-11-18" in after["alloc.patch"].decode()  # from SOURCE_DATE_EPOCH
    assert after["train.patch"] == before["train.patch"]
    st = tree_status(fake.project)
    assert st.up_to_date and st.edits == {}
    # Re-running with nothing to fold changes nothing.
    assert refresh(fake.project, log=quiet) == ""
    assert snapshot(fake) == after
    # The same edit refreshed in the twin checkout gives byte-identical patch files.
    twin = type(fake.project)(twin_root)
    materialize(twin, log=quiet)
    _edit_alloc(twin)
    refresh(twin, log=quiet)
    assert {p.name: p.read_bytes() for p in sorted(twin.patches_dir.iterdir())} == after


def test_refresh_into_an_earlier_patch_rebases_later_ones(fake: Env) -> None:
    # Edit a file owned by the first patch while a later patch exists: fixup + autosquash.
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH),
                       "train.patch": patch_text("Fork training", TRAIN_PATCH)})
    materialize(fake.project, log=quiet)
    alloc = fake.project.megatron_dir / "core" / "alloc.py"
    alloc.write_text(alloc.read_text().replace("line_5 = 5\n", "line_5 = 50\n"))
    assert refresh(fake.project, patch="alloc", log=quiet) == "alloc.patch"
    assert "+line_5 = 50" in (fake.project.patches_dir / "alloc.patch").read_text()
    assert "line_5" not in (fake.project.patches_dir / "train.patch").read_text()
    assert check_base(fake.project) == 2


def test_refresh_new_patch_and_ambiguous_edits(fake: Env) -> None:
    materialize(fake.project, log=quiet)
    (fake.project.megatron_dir / "core" / "__init__.py").write_text("VALUE = 5\n")
    with pytest.raises(SeriesError) as info:
        refresh(fake.project, log=quiet)  # no patch owns core/__init__.py
    assert "--new NAME" in info.value.fix
    assert refresh(fake.project, new="value-five", description="Set VALUE to five", log=quiet) == "value-five.patch"
    text = (fake.project.patches_dir / "value-five.patch").read_text()
    assert text.startswith("Description: Set VALUE to five\n") and "+VALUE = 5" in text
    assert (fake.project.patches_dir / "series").read_text().rstrip().endswith("value-five.patch")
    assert lint(fake.project) == []


def test_lint_reports_header_and_path_problems(fake: Env) -> None:
    assert lint(fake.project) == []
    bad_header = ("Description: x\nOrigin: backport, not-a-url\nBug: sometimes\nForwarded: maybe\n"
                  "Last-Update: 21/11/2026\n")
    outside = ALLOC_PATCH.replace("megatron/core/alloc.py", "megatron/core/ghost.py")
    (fake.project.patches_dir / "alloc.patch").write_text(bad_header + "---\n" + outside)
    (fake.project.patches_dir / "stray.patch").write_text(patch_text("stray", TRAIN_PATCH))
    messages = [str(p) for p in lint(fake.project)]
    joined = "\n".join(messages)
    assert "stray.patch: is in patches/ but not listed" in joined
    assert "alloc.patch: missing Applied-Upstream" in joined
    assert "Origin 'backport, not-a-url': an upstream/backport origin needs a URL" in joined
    assert "Bug 'sometimes'" in joined and "Forwarded 'maybe'" in joined
    assert "Last-Update '21/11/2026': expected YYYY-MM-DD" in joined
    assert "modifies megatron/core/ghost.py, which does not exist in the megatron_core-0.18.2.tar.gz sdist" in joined


@pytest.mark.parametrize("bug, refused", [
    ("https://github.com/NVIDIA/Megatron-LM/pull/5222", True),
    ("https://gitlab.example.com/group/repo/-/merge_requests/7", True),
    ("https://github.com/NVIDIA/Megatron-LM/commit/55638bc443", True),
    ("https://github.com/NVIDIA/Megatron-LM/issues/1541", False),
    ("none", False),
])
def test_lint_refuses_a_change_as_bug(fake: Env, bug: str, refused: bool) -> None:
    header = (f"Description: x\nOrigin: vendor, hfsdp\nBug: {bug}\nForwarded: no\nApplied-Upstream: no\n"
              "Last-Update: 2026-11-21\n")
    (fake.project.patches_dir / "alloc.patch").write_text(header + "---\n" + ALLOC_PATCH)
    messages = [str(p) for p in lint(fake.project)]
    assert any("is a change, not a bug report" in m for m in messages) == refused, messages


def test_lint_missing_description_and_outside_members(fake: Env) -> None:
    header = "Origin: vendor, hfsdp\nBug: none\nForwarded: no\nApplied-Upstream: no\nLast-Update: 2026-11-21\n"
    diff = TRAIN_PATCH.replace("megatron/training/train.py", "setup.py")
    fake.write_series({"x.patch": header + "---\n" + diff})
    joined = "\n".join(str(p) for p in lint(fake.project))
    assert "x.patch: missing Description" in joined
    assert "touches setup.py, outside megatron/core, megatron/training" in joined


def test_check_against_newer_release_finds_upstreamed_patches(fake: Env, tmp_path: Path) -> None:
    newer = dict(BASE_FILES)
    newer["megatron/core/alloc.py"] = newer["megatron/core/alloc.py"].replace(
        "line_20 = 20\n", "line_20 = 20\nmaxpool = True\n")
    newer["megatron/training/train.py"] = "def train():\n    return 'rewritten upstream'\n"
    sdist = make_sdist(tmp_path, version="0.19.0", files=newer)
    results = {r.patch: r for r in check_against(fake.project, str(sdist)).patches}
    assert results["alloc.patch"].state == "upstream"
    assert results["train.patch"].state == "conflicts"
    assert results["train.patch"].files == ("megatron/training/train.py",)


def test_gitops_failure_parsing_names_files(tmp_path: Path) -> None:
    repo = tmp_path / "r"
    repo.mkdir()
    gitops.init_repo(repo)
    (repo / "megatron" / "core").mkdir(parents=True)
    gitops.commit_all(repo, "base\n")
    with pytest.raises(PatchDoesNotApply) as info:
        gitops.apply_patch(repo, "alloc.patch", ALLOC_PATCH)
    assert info.value.files == ["megatron/core/alloc.py"]


def test_cli_status_lint_check_exit_codes(fake: Env, capsys) -> None:
    root = ["--root", str(fake.project.root)]
    assert main([*root, "status"]) == 1  # not materialized yet
    assert main([*root, "materialize"]) == 0
    assert main([*root, "status"]) == 0
    assert main([*root, "lint"]) == 0
    assert main([*root, "check"]) == 0
    (fake.project.megatron_dir / "core" / "__init__.py").write_text("VALUE = 9\n")
    assert main([*root, "diff"]) == 0
    out = capsys.readouterr().out
    assert "+VALUE = 9" in out
    (fake.project.patches_dir / "series").write_text("alloc.patch\nalloc.patch\n")
    assert main([*root, "status"]) == 2
    assert "listed twice" in capsys.readouterr().err


def test_scripts_patchset_shim_runs(fake: Env) -> None:
    proc = subprocess.run(
        [str(REPO_ROOT / "scripts" / "patchset"), "--root", str(fake.project.root), "materialize"],
        capture_output=True, text=True, env={**__import__("os").environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr
    assert "materialized megatron/" in proc.stdout


def test_check_against_reports_declared_backports_that_do_not_reverse_apply(fake: Env, tmp_path: Path) -> None:
    # A clean-room backport rarely reverse-applies; its Applied-Upstream header still tells.
    header = patch_text("Fork training", TRAIN_PATCH).replace(
        "Applied-Upstream: no", "Applied-Upstream: 0.19.0, commit:abc123")
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", ALLOC_PATCH), "train.patch": header})
    newer = dict(BASE_FILES)
    newer["megatron/training/train.py"] = "def train():\n    return 'upstream rewrote it'\n"
    sdist = make_sdist(tmp_path, version="0.19.0", files=newer)
    results = {r.patch: r for r in check_against(fake.project, str(sdist)).patches}
    assert results["train.patch"].state == "declared"
    assert "0.19.0" in results["train.patch"].note
    assert results["alloc.patch"].state == "applies"
    (tmp_path / "old").mkdir()
    older = make_sdist(tmp_path / "old", version="0.18.9", files=newer)  # predates the backport
    assert {r.patch: r.state for r in check_against(fake.project, str(older)).patches}["train.patch"] == "conflicts"


def test_a_run_cleaning_up_beside_the_queue_never_deletes_a_scratch_folder_not_locked_yet(
        fake: Env, tmp_path: Path, monkeypatch) -> None:
    """Another `queue --dir` to the same folder, cleaning up right after this run made its scratch folder (and
    before it locked it), leaves it alone: making and locking it is one step for other runs."""
    from hfsdp.patchset import queue as queue_mod

    dest = tmp_path / "q"
    other = ("import os, shutil, sys; from pathlib import Path; from hfsdp.patchset.queue import _new_scratch; "
             "scratch, held = _new_scratch(Path(sys.argv[1]), print); shutil.rmtree(scratch)")
    real = queue_mod.tempfile.mkdtemp
    procs: list[subprocess.Popen[str]] = []

    def mkdtemp(*args: object, **kwargs: object) -> str:
        made = real(*args, **kwargs)  # type: ignore[call-overload]
        procs.append(subprocess.Popen([sys.executable, "-c", other, str(dest)], cwd=REPO_ROOT, text=True,
                                      stdout=subprocess.PIPE))
        try:  # the other run's clean-up: done, or waiting for this one
            procs[0].wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        return made

    monkeypatch.setattr(queue_mod.tempfile, "mkdtemp", mkdtemp)
    queue = make_queue(fake.project, dest, log=quiet)
    out, _ = procs[0].communicate(timeout=60)
    assert procs[0].returncode == 0 and out == "", out  # it removed nothing
    assert gitops.git(["rev-list", "--count", "HEAD"], cwd=queue.repo).stdout.strip() != "0"
