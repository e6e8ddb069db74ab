"""Bad input to the Slurm tools, one row each: the input, the exit status, a fragment of the one
sentence that says why. No row may print a traceback, and a refused submission writes nothing.

``{file}`` is an existing regular file, ``{dry}`` a log folder written by ``submit --dry-run``,
``{empty}`` one whose jobs.json lists no jobs, ``{tmp}`` a fresh folder, ``{mine}`` a folder of the
user's (a file in it), ``{void}`` an empty one; ``{case}`` is the CPU smoke case, ``{case2}`` a copy of it
in another folder (the same ``<model>/<case>``). The folders that stand for a log folder of an earlier
submission carry its marker. Rows marked ``gres`` run with a stand-in
``sbatch`` that answers as a cluster without GPUs does.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hfsdp.slurm.submit import LOG_DIR_MARKER

REPO_ROOT = Path(__file__).resolve().parents[3]
CASE = REPO_ROOT / "tests/functional_tests/test_cases/smoke/cpu_gloo_smoke"
SUBMIT, SUMMARY, LAUNCH_CMD = "hfsdp.slurm.submit", "hfsdp.slurm.summary", "hfsdp.slurm.launch_cmd"

# (module, arguments, exit status, fragment of the message on stderr)
ROWS = [
    (SUBMIT, "{case} --dry-run --log-dir {file}", 2, "is a file, not a folder"),
    (SUBMIT, "{case} --dry-run --log-dir {file}/logs", 2, "which is a file"),
    # Refused before anything runs, root or not: no file can be made in /proc.
    (SUBMIT, "{case} --dry-run --log-dir /proc/hfsdp-logs", 2, "--log-dir /proc/hfsdp-logs"),
    (SUBMIT, "{case} --dry-run --log-dir {tmp}/a\tb", 2, "holds white space"),
    (SUBMIT, "{case} --dry-run --log-dir {tmp}/logs --partition a\nb", 2, "is not a Slurm name"),
    (SUBMIT, "{case} --dry-run --log-dir {tmp}/logs --account x\ty", 2, "is not a Slurm name"),
    (SUBMIT, "{case} --dry-run --log-dir {tmp}/logs --python ", 2, "names no program"),
    (SUBMIT, "{case} --dry-run --log-dir {tmp}/logs --nodes 2 --ranks-per-gpu 2", 2, "runs on one host only"),
    (SUBMIT, "{case} --dry-run --log-dir {tmp}/logs --cpu --ranks-per-gpu 2", 2, "--cpu asks for none"),
    (SUBMIT, "{case} --dry-run --log-dir {tmp}/logs --ranks-per-gpu 0", 2, "must be > 0"),
    (SUBMIT, "{case} --dry-run --log-dir {tmp}/logs --time 1", 2, "leaves no room"),
    (SUBMIT, "{tmp}/no_case --dry-run --log-dir {tmp}/logs", 2, "is not a test case"),
    (SUBMIT, "{case} --log-dir {tmp}/logs gres", 2, "has no GPUs (GRES) to give"),
    (SUMMARY, "--log-dir {dry}", 2, "nothing ran"),
    (SUMMARY, "--log-dir {empty}", 2, "lists no jobs: nothing ran"),
    (SUMMARY, "--log-dir {tmp}/nowhere", 2, "no jobs.json"),
    (SUMMARY, "--log-dir {file}", 2, "no jobs.json"),
    (SUMMARY, "--log-dir {dry} --wait -1", 2, "must be >= 0"),
    (SUMMARY, "--log-dir {dry} --wait nan", 2, "must be >= 0"),
    (LAUNCH_CMD, "{tmp}/no_case", 2, "is not a test case"),
    # A jobs.json that is no regular file: reading a named pipe would block, writing would replace it.
    (SUMMARY, "--log-dir {pipe}", 2, "jobs.json is a named pipe, not a regular file"),
    (SUBMIT, "{case} --dry-run --log-dir {pipe}", 2, "jobs.json is a named pipe, not a regular file"),
    (SUMMARY, "--log-dir {folder}", 2, "jobs.json is a folder, not a regular file"),
    # A jobs.json that parses, but that submit never writes.
    (SUMMARY, "--log-dir {negative_id}", 2, "is not a list of jobs"),
    (SUMMARY, "--log-dir {true_id}", 2, "is not a list of jobs"),
    (SUMMARY, "--log-dir {key_twice}", 2, "key 'job_id' is given twice in one object"),
    (SUMMARY, "--log-dir {nan_id}", 2, "NaN is not a JSON number"),
    # A --log-dir with a space (sbatch splits #SBATCH lines) is refused; non-ASCII alone is fine.
    (SUBMIT, "{case} --dry-run --log-dir {tmp}/lo_gs_ö", 0, ""),
    # A --log-dir that exists: written into only when empty or made by an earlier submission (its marker).
    (SUBMIT, "{case} --dry-run --log-dir {mine}", 2, "exists and holds notes.txt, not made by python -m hfsdp.slurm"),
    (SUBMIT, "{case} --dry-run --log-dir {tmp}", 2, "holds a-file, dry, empty, mine, void, not made by"),
    (SUBMIT, "{case} --dry-run --log-dir {void}", 0, ""),
    (SUBMIT, "{case} --dry-run --log-dir {dry}", 0, ""),
    # Two case folders of one <model>/<case>: their scripts would share a name (the later overwrote the earlier).
    (SUBMIT, "{case} {case2} --dry-run --log-dir {tmp}/logs", 2, "are both job hfsdp-smoke-cpu_gloo_smoke"),
    (SUBMIT, "{case2} --dry-run --log-dir {dry}", 2, "(submitted into this --log-dir before: jobs.json) and"),
]

# What sbatch says on a cluster without GPUs when a job asks for some.
NO_GRES_SBATCH = """#!/bin/sh
echo "sbatch: error: Batch job submission failed: Invalid generic resource (gres) specification" >&2
exit 1
"""


def _argv(template: str, places: dict[str, str]) -> list[str]:
    # Split on spaces only: a row's tab or newline stays inside its argument.
    return [part.format(**places) for part in template.split(" ")]


@pytest.mark.parametrize(("module", "args", "status", "fragment"), ROWS,
                         ids=[f"{m.rsplit('.', 1)[1]}:{a}" for m, a, _, _ in ROWS])
def test_bad_input_is_one_sentence(tmp_path: Path, module: str, args: str, status: int, fragment: str) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("not a folder\n")
    dry, empty = tmp_path / "dry", tmp_path / "empty"
    made = subprocess.run([sys.executable, "-m", SUBMIT, str(CASE), "--dry-run", "--log-dir", str(dry)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    empty.mkdir()
    (empty / "jobs.json").write_text("[]\n")
    mine, void = tmp_path / "mine", tmp_path / "void"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    void.mkdir()
    places = {"case": str(CASE), "file": str(afile), "dry": str(dry), "empty": str(empty), "tmp": str(tmp_path),
              "mine": str(mine), "void": str(void)}
    if "{case2}" in args:
        case2 = tmp_path / "copy" / CASE.parent.name / CASE.name
        case2.mkdir(parents=True)
        (case2 / "model_config.yaml").write_text((CASE / "model_config.yaml").read_text())
        places["case2"] = str(case2)
    manifest = (dry / "jobs.json").read_text()
    ids = {"negative_id": "-3", "true_id": "true", "key_twice": "7, \"job_id\": 7", "nan_id": "NaN"}
    makers = {name: (lambda p, v=v: p.write_text(manifest.replace('"job_id": null', f'"job_id": {v}')))
              for name, v in ids.items()}
    for name, make in {"pipe": lambda p: os.mkfifo(p), "folder": lambda p: p.mkdir(), **makers}.items():
        if "{" + name + "}" in args:
            (tmp_path / name).mkdir()
            (tmp_path / name / LOG_DIR_MARKER).touch()  # a log folder submit made, whose jobs.json was replaced
            make(tmp_path / name / "jobs.json")
            places[name] = str(tmp_path / name)
    argv = _argv(args, places)
    env = {k: v for k, v in os.environ.items() if k != "HFSDP_DEBUG"}
    if argv[-1] == "gres":
        argv.pop()
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "sbatch").write_text(NO_GRES_SBATCH)
        (bin_dir / "sbatch").chmod(0o755)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == status, proc.stdout + proc.stderr
    assert fragment in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    if "pipe" in places:
        assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe" / "jobs.json").st_mode), "the named pipe was replaced"
    if status == 0:
        return
    prog = module.rsplit(".", 1)[1]
    assert [ln for ln in proc.stderr.splitlines() if "error:" in ln] == [
        next(ln for ln in proc.stderr.splitlines() if ln.startswith(f"{prog}: error:"))], proc.stderr  # one
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    scripts = [p for p in written if p.suffix == ".sbatch" and p not in before]
    new = [p for p in written if p not in before and p not in scripts and not any(p in s.parents for s in scripts)
           and not (p.name == LOG_DIR_MARKER and any(p.parent == s.parent for s in scripts))]
    assert not new, new  # nothing but the script sbatch refused (named in the message), in a marked folder, is written
    assert not scripts or str(tmp_path / scripts[0]) in proc.stderr, proc.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine\n"
