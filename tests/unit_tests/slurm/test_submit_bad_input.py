"""hfsdp.slurm.submit / summary on bad input: nothing is written, and the message says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfsdp.slurm import sbatch
from hfsdp.slurm.submit import LOG_DIR_MARKER
from hfsdp.usererror import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]
CASE = REPO_ROOT / "tests/functional_tests/test_cases/smoke/cpu_gloo_smoke"


def cli(module: str, *args: str, optimize: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HFSDP_DEBUG"}
    cmd = [sys.executable, *(["-O"] if optimize else []), "-m", module, *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=120)


def test_a_case_that_does_not_exist_writes_nothing(tmp_path):
    logs = tmp_path / "logs"
    proc = cli("hfsdp.slurm.submit", str(CASE), str(tmp_path / "no_such_case"), "--log-dir", str(logs), "--dry-run")
    assert proc.returncode == 2
    assert "no_such_case" in proc.stderr and "model_config.yaml" in proc.stderr and "Traceback" not in proc.stderr
    assert not logs.exists() or not any(logs.iterdir())  # not even the good case's script


@pytest.mark.parametrize("where", ["inside", "the case", "above"])
def test_a_log_dir_in_or_over_a_test_case_is_refused_at_submit_time(tmp_path, where):
    """The jobs' output folders go under --log-dir, and run_case would refuse them only on the cluster."""
    case = tmp_path / "cases" / "smoke" / "c"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(CASE.joinpath("model_config.yaml").read_text())
    logs = {"inside": case / "logs", "the case": case, "above": tmp_path / "cases"}[where]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    proc = cli("hfsdp.slurm.submit", str(case), "--log-dir", str(logs), "--dry-run", "--cpu")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "give --log-dir a folder outside the test cases" in proc.stderr, proc.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_log_dir_under_a_file_is_refused_before_anything_is_written(tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    logs = blocker / "logs"
    proc = cli("hfsdp.slurm.submit", str(CASE), "--log-dir", str(logs), "--dry-run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--log-dir {logs} lies under {blocker}, which is a file" in proc.stderr
    assert sorted(tmp_path.iterdir()) == [blocker] and blocker.read_text() == "mine\n"


def test_a_log_dir_in_a_folder_that_is_not_writable_is_refused_before_anything_runs(tmp_path, lock_folder):
    locked = lock_folder(tmp_path / "locked")
    logs = locked / "logs"
    proc = cli("hfsdp.slurm.submit", str(CASE), "--log-dir", str(logs), "--dry-run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--log-dir {logs}: {locked} is not writable" in proc.stderr
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize(("args", "expected"), [
    (["--time", "0"], "--time: must be > 0"),
    (["--time", "-5"], "--time: must be > 0"),
    (["--nodes", "0"], "--nodes: must be > 0"),
    (["--gpus-per-node", "0"], "--gpus-per-node: must be > 0"),
    (["--time", "1"], "leaves no room"),
    (["--time", "3", "--exit-buffer-min", "3"], "--exit-buffer-min 3"),
    (["--env", "NOEQUALS"], "is not KEY=VALUE"),
])
@pytest.mark.parametrize("optimize", [False, True], ids=["python", "python -O"])
def test_bad_limits_are_refused_even_under_python_O(tmp_path, args, expected, optimize):
    logs = tmp_path / "logs"
    proc = cli("hfsdp.slurm.submit", str(CASE), "--log-dir", str(logs), "--dry-run", *args, optimize=optimize)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not logs.exists() or not any(logs.iterdir())


def test_job_spec_validation_is_not_an_assert():
    with pytest.raises(UserError, match="leaves no room"):
        sbatch.JobSpec(CASE, REPO_ROOT, Path("/nonexistent"), time_limit_min=1, kill_buffer_s=60).validate()
    with pytest.raises(UserError, match="launcher"):
        sbatch.JobSpec(CASE, REPO_ROOT, Path("/nonexistent"), launcher="mpirun").validate()


def test_missing_sbatch_is_a_sentence(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no sbatch on PATH
    env.pop("HFSDP_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "hfsdp.slurm.submit", str(CASE), "--log-dir", str(tmp_path / "l")],
                          cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "sbatch" in proc.stderr and "--dry-run" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "l" / "jobs.json").exists()
    dry = subprocess.run([sys.executable, "-m", "hfsdp.slurm.submit", str(CASE), "--log-dir", str(tmp_path / "l"),
                          "--dry-run"], cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert dry.returncode == 0 and (tmp_path / "l" / "jobs.json").is_file()  # the advice works


@pytest.mark.parametrize("text", ["{not json", '{"a": 1}', '[{"case": 3}]'])
def test_a_corrupt_manifest_is_named(tmp_path, text):
    (tmp_path / LOG_DIR_MARKER).touch()  # a log folder submit made, whose jobs.json was damaged since
    (tmp_path / "jobs.json").write_text(text)
    for module, extra in (("hfsdp.slurm.summary", []), ("hfsdp.slurm.submit", [str(CASE), "--dry-run"])):
        proc = cli(module, *extra, "--log-dir", str(tmp_path))
        assert proc.returncode == 2, (module, proc.stderr)
        assert str(tmp_path / "jobs.json") in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "jobs.json").read_text() == text  # left as it was


def test_summary_of_a_folder_without_jobs(tmp_path):
    proc = cli("hfsdp.slurm.summary", "--log-dir", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "no jobs.json" in proc.stderr


def copy_case(root: Path) -> Path:
    """The CPU smoke case in another folder: the same <model>/<case>."""
    other = root / "smoke" / CASE.name
    other.mkdir(parents=True)
    (other / "model_config.yaml").write_text((CASE / "model_config.yaml").read_text())
    return other


def test_two_case_folders_of_one_name_are_refused_before_anything_is_written(tmp_path):
    """Their scripts share a name: the second once overwrote the one the first job's entry points at."""
    other = copy_case(tmp_path / "elsewhere")
    logs = tmp_path / "logs"
    proc = cli("hfsdp.slurm.submit", str(CASE), str(other), "--log-dir", str(logs), "--dry-run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{CASE} and {other} are both job hfsdp-smoke-cpu_gloo_smoke" in proc.stderr, proc.stderr
    assert "different --log-dir folders" in proc.stderr
    assert not logs.exists() or not any(logs.iterdir())


def test_a_case_folder_of_a_name_an_earlier_submission_used_is_refused(tmp_path):
    logs = tmp_path / "logs"
    assert cli("hfsdp.slurm.submit", str(CASE), "--log-dir", str(logs), "--dry-run").returncode == 0
    before = {p.name: p.read_bytes() for p in logs.iterdir()}
    other = copy_case(tmp_path / "elsewhere")
    proc = cli("hfsdp.slurm.submit", str(other), "--log-dir", str(logs), "--dry-run", "--time", "9")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{CASE} (submitted into this --log-dir before: jobs.json) and {other} are both job" in proc.stderr
    assert {p.name: p.read_bytes() for p in logs.iterdir()} == before


# Answers as sbatch --parsable does, with job ids 101, 102, ...
FAKE_SBATCH = """#!/bin/sh
n=$(cat "$0.count" 2>/dev/null || echo 100)
n=$((n + 1))
echo "$n" > "$0.count"
echo "$n;cluster"
"""


def test_a_case_submitted_again_never_overwrites_the_script_an_earlier_job_ran(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "HFSDP_DEBUG"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    logs = tmp_path / "logs"

    def submit(*args: str) -> None:
        proc = subprocess.run([sys.executable, "-m", "hfsdp.slurm.submit", *args, "--log-dir", str(logs), "--cpu"],
                              cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr

    submit(str(CASE), "--time", "10")
    first = (logs / "hfsdp-smoke-cpu_gloo_smoke.sbatch").read_text()
    submit(str(CASE), "--time", "20")  # again, with another limit
    submit(str(CASE), str(CASE))  # twice in one submission
    jobs = json.loads((logs / "jobs.json").read_text())
    scripts = [Path(j["script"]).name for j in jobs]
    assert [j["job_id"] for j in jobs] == [101, 102, 103, 104]
    assert scripts == ["hfsdp-smoke-cpu_gloo_smoke.sbatch", *(f"hfsdp-smoke-cpu_gloo_smoke-{n}.sbatch"
                                                              for n in (2, 3, 4))]
    assert (logs / scripts[0]).read_text() == first and "#SBATCH --time=10" in first
    assert "#SBATCH --time=20" in (logs / scripts[1]).read_text()
