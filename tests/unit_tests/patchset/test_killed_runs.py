"""``kill -9`` at any moment of ``refresh``, ``export`` and ``queue`` loses no edit and no patch.

Each test makes a start state, runs the verb once to the end (the reference: what it writes, and how
many steps on disk it takes), then, from fresh copies of the start state, runs it again and kills it
right before a few of those steps (kill_points.py), picked with a fixed seed. After each kill the
next commands a user would run (``status``, then the verb again, doing what the messages say)
must end where the reference ended, with every edit where it was, and no traceback on the way.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from patchset_fake import ALLOC_PATCH, OTHER, Env, patch_text

from hfsdp.patchset.cli import main

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
KILLS = 3  # kill points per test: a few, to keep the run short; the seeds keep them the same every run


def run(root: Path, *args: str, kill_at: int = 0, trace: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``scripts/patchset --root ROOT ARGS`` in a process of its own, killed right before step ``kill_at``
    (``trace``: where to write its steps)."""
    tmp = root.parent / "tmp"  # the system temporary folder of the run: what a kill leaves there stays in the test
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{HERE}", "PATCHSET_KILL_AT": str(kill_at),
           "TMPDIR": str(tmp)}
    if trace is not None:
        env["PATCHSET_KILL_TRACE"] = str(trace)
    proc = subprocess.run([sys.executable, str(HERE / "kill_points.py"), "--root", str(root), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def kill_points(seed: int, trace: Path, *where: str) -> list[int]:
    """A few steps of a traced run, with a fixed seed: most of them among the steps on a path holding one of
    ``where`` (what the verb writes: the checkout, or the queue), one anywhere (most steps build scratch
    queues in the system's temporary folder)."""
    steps = [(line.split(" ", 2) + [""])[:3] for line in trace.read_text().splitlines()]
    writing = [int(n) for n, _, on in steps if any(w in on for w in where)]
    rng = random.Random(seed)
    picked = set(rng.sample(writing, min(KILLS, len(writing)))) | {rng.randint(1, len(steps))}
    return sorted(picked)


def reference(start: Path, work: Path, *args: str) -> tuple[Path, list[int]]:
    """Run the verb to the end on a copy of ``start``; (that copy, the steps to kill the others at)."""
    shutil.copytree(start, work, symlinks=True)
    trace = work.parent / f"{work.name}.steps"
    proc = run(work, *args, trace=trace)
    assert proc.returncode == 0, proc.stderr
    return work, kill_points(len(args), trace, str(work))


def killed(start: Path, work: Path, step: int, *args: str) -> Path:
    """A copy of ``start`` on which the verb was killed right before ``step``."""
    shutil.copytree(start, work, symlinks=True)
    proc = run(work, *args, kill_at=step)
    assert proc.returncode == -signal.SIGKILL, (step, proc.returncode, proc.stderr)
    return work


STAMPS = (".patchset-stamp", "..patchset-stamp")  # the stamp, refresh's next one, and their temporary files


def files(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file below ``folder`` (``skip``: name prefixes left out) -> its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(skip) and "__pycache__" not in p.parts}


def patches_of(root: Path) -> dict[str, bytes]:
    return files(root / "patches")


def no_leftovers(root: Path) -> None:
    left = [p.name for p in root.iterdir() if p.name.startswith((".patchset-tmp-", ".patchset-old-"))]
    assert left == [], left
    assert not [p for p in (root / "megatron").glob("*") if p.name.startswith((".patchset-stamp.next", ".."))]


def status_says_something(root: Path) -> None:
    """``status`` after a kill: an answer (a report, or a refusal with its way out), never a traceback."""
    proc = run(root, "status")
    assert proc.returncode in (0, 1, 2), proc
    assert proc.returncode != 2 or "  -> " in proc.stderr, proc.stderr


def test_refresh_killed_at_any_moment(overlaid: Env, tmp_path: Path) -> None:
    root = overlaid.project.root
    assert main(["--root", str(root), "materialize"]) == 0
    alloc = root / "megatron/core/alloc.py"
    alloc.write_text(alloc.read_text().replace("maxpool = True", "maxpool = 'edited'"))  # into alloc.patch
    lanes = root / "megatron/core/maxpool_allocator.py"
    lanes.write_text(lanes.read_text().replace("POOL_LANES = 2", "POOL_LANES = 4"))  # into the overlay
    tree = files(root / "megatron", skip=STAMPS)
    before = patches_of(root)
    ref, steps = reference(root, tmp_path / "ref", "refresh")
    after = patches_of(ref)
    assert after != before and b"maxpool = 'edited'" in after["alloc.patch"]
    for step in steps:
        work = killed(root, tmp_path / f"kill-{step}", step, "refresh")
        assert files(work / "megatron", skip=STAMPS) == tree, step  # the edits are where they were
        status_says_something(work)
        proc = run(work, "refresh")
        assert proc.returncode == 0, (step, proc.stderr)
        assert patches_of(work) == after, step
        assert files(work / "megatron", skip=STAMPS) == tree, step
        assert run(work, "status").returncode == 0, step  # up to date, no edits: they are in the patches
        no_leftovers(work)


def test_refresh_of_another_base_killed_at_any_moment(two: Env, tmp_path: Path) -> None:
    """The same on a second base ([Note: bases] in project.py): the edit of a shared patch's file becomes that
    base's variant; the default base's files are never written."""
    root = two.project.root
    assert main(["--root", str(root), "--base", OTHER, "materialize"]) == 0
    alloc = root / "megatron/core/alloc.py"
    alloc.write_text(alloc.read_text().replace("maxpool = True", "maxpool = 'edited'"))
    tree = files(root / "megatron", skip=STAMPS)
    before = patches_of(root)
    ref, steps = reference(root, tmp_path / "ref", "--base", OTHER, "refresh")
    after = patches_of(ref)
    assert b"maxpool = 'edited'" in after[f"bases/{OTHER}/alloc.patch"]
    assert {k: v for k, v in after.items() if f"bases/{OTHER}/alloc.patch" != k} == before
    for step in steps:
        work = killed(root, tmp_path / f"kill-{step}", step, "--base", OTHER, "refresh")
        assert files(work / "megatron", skip=STAMPS) == tree, step
        status_says_something(work)
        proc = run(work, "--base", OTHER, "refresh")
        assert proc.returncode == 0, (step, proc.stderr)
        assert patches_of(work) == after, step
        assert run(work, "--base", OTHER, "status").returncode == 0, step
        no_leftovers(work)


def test_export_killed_at_any_moment(fake: Env, tmp_path: Path) -> None:
    root = fake.project.root
    queue = tmp_path / "q"
    assert main(["--root", str(root), "queue", "--dir", str(queue)]) == 0
    (queue / "megatron/core/__init__.py").write_text("VALUE = 2\n")
    header = textwrap.dedent("""\
        Description: Value two
        Origin: vendor, hfsdp
        Bug: none
        Forwarded: no
        Applied-Upstream: no
        Last-Update: 2026-11-21""")
    for args in (["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm",
                                 f"value-two\n\n{header}"]):
        subprocess.run(["git", "-C", str(queue), *args], check=True, capture_output=True)
    before = patches_of(root)
    ref, steps = reference(root, tmp_path / "ref", "export", "--queue", str(queue))
    after = patches_of(ref)
    assert set(after) == {*before, "value-two.patch"}
    for step in steps:
        work = killed(root, tmp_path / f"kill-{step}", step, "export", "--queue", str(queue))
        status_says_something(work)
        proc = run(work, "export", "--queue", str(queue))
        assert proc.returncode == 0, (step, proc.stderr)
        assert patches_of(work) == after, step
        no_leftovers(work)


def test_queue_killed_at_any_moment(fake: Env, tmp_path: Path) -> None:
    root = fake.project.root
    trace = tmp_path / "queue.steps"
    assert run(root, "queue", "--dir", str(tmp_path / "ref-q"), trace=trace).returncode == 0
    assert run(root, "export", "--queue", str(tmp_path / "ref-q")).returncode == 0  # series as export writes it
    before = patches_of(root)
    for step in kill_points(3, trace, str(tmp_path / "ref-q"), ".ref-q.patchset-tmp-"):
        queue = tmp_path / f"q-{step}"
        proc = run(root, "queue", "--dir", str(queue), kill_at=step)
        assert proc.returncode == -signal.SIGKILL, proc
        if not queue.exists():  # killed before the queue was in place: make it again
            assert run(root, "queue", "--dir", str(queue)).returncode == 0, step
        assert not list(tmp_path.glob(f".{queue.name}.patchset-tmp-*")), step  # the killed run's scratch is gone
        proc = run(root, "export", "--queue", str(queue))  # complete: it exports to the series it was made from
        assert proc.returncode == 0 and "patches/ already holds what" in proc.stdout, (step, proc.stderr)
        assert patches_of(root) == before, step


STOPS = ALLOC_PATCH.replace(" line_20 = 20\n+maxpool", " line_20 = 'changed upstream'\n+maxpool")


def test_queue_continue_killed_at_any_moment(fake: Env, tmp_path: Path) -> None:
    """A queue stopped at alloc.patch (its context changed), fixed by hand; `--continue` applies train.patch."""
    root = fake.project.root
    fake.write_series({"alloc.patch": patch_text("Add maxpool flag", STOPS),
                       "train.patch": (root / "patches/train.patch").read_text()})
    start = tmp_path / "stopped"
    assert main(["--root", str(root), "queue", "--dir", str(start)]) == 2
    alloc = start / "megatron/core/alloc.py"
    alloc.write_text(alloc.read_text().replace("line_20 = 20\n", "line_20 = 20\nmaxpool = True\n"))
    for rej in start.rglob("*.rej"):
        rej.unlink()
    ref = tmp_path / "ref"
    shutil.copytree(start, ref, symlinks=True)
    assert run(root, "queue", "--continue", "--dir", str(ref), trace=tmp_path / "ref.steps").returncode == 0
    checkout = tmp_path / "checkout"
    shutil.copytree(root, checkout, symlinks=True)
    assert run(checkout, "export", "--queue", str(ref)).returncode == 0
    after = patches_of(checkout)
    assert b"maxpool = True" in after["alloc.patch"]
    for step in kill_points(4, tmp_path / "ref.steps", str(ref)):
        queue = tmp_path / f"kill-{step}"
        shutil.copytree(start, queue, symlinks=True)
        proc = run(root, "queue", "--continue", "--dir", str(queue), kill_at=step)
        assert proc.returncode == -signal.SIGKILL, (step, proc.returncode, proc.stderr)
        assert run(root, "export", "--queue", str(queue)).returncode == 2, step  # not before it is finished
        for _ in range(3):  # `--continue` again, doing what it says
            proc = run(root, "queue", "--continue", "--dir", str(queue))
            if proc.returncode == 0 or "nothing to continue" in proc.stderr:
                break
            assert proc.returncode == 2, (step, proc.stderr)
            lock = re.search(r"'([^']+index\.lock)'", proc.stderr)
            if lock:  # git's own way out: a git command was killed
                Path(lock[1]).unlink()
            else:
                (command,) = [c for c in re.findall(r"`([^`]+)`", proc.stderr.split("-> ", 1)[1])
                              if c.startswith("git ")]
                subprocess.run(command.split(), check=True, capture_output=True)
        else:
            raise AssertionError(f"step {step}: --continue did not finish: {proc.stderr}")
        checkout = tmp_path / f"checkout-{step}"
        shutil.copytree(root, checkout, symlinks=True)
        assert run(checkout, "export", "--queue", str(queue)).returncode == 0, step
        assert patches_of(checkout) == after, step
