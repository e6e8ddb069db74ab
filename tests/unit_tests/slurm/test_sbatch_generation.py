"""sbatch text generation, scontrol parsing and summary verdicts (no scheduler needed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hfsdp.slurm import sbatch, summary
from hfsdp.slurm.scontrol import JobInfo, parse_show_job
from hfsdp.usererror import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]
CASE = REPO_ROOT / "tests/functional_tests/test_cases/hybrid/hybrid_mcore_local_fsdp_maxpool_db"


def _spec(tmp_path: Path, **kw) -> sbatch.JobSpec:
    return sbatch.JobSpec(case_dir=CASE, repo_root=REPO_ROOT, log_dir=tmp_path, **kw)


def test_torchrun_per_node_script(tmp_path: Path) -> None:
    text = sbatch.render_sbatch(_spec(tmp_path, nodes=2, gpus_per_node=8, time_limit_min=45,
                                      partition="batch"))
    assert text.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=2", "#SBATCH --time=45", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --partition=batch",
                 "set -euo pipefail",
                 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 "MASTER_PORT=$(( 61000 + SLURM_JOB_ID % 4536 ))", "LIMIT_S=2700"):
        assert line in text, line
    assert "--node-rank \"$SLURM_NODEID\"" in text and "--nproc 8" in text
    assert "srun --kill-on-bad-exit=1" in text and "timeout --signal=TERM" in text
    assert "--exit-duration-in-mins" in text and "--record" not in text
    assert "NVLS" not in text and "MULTICAST" not in text  # the user's environment decides


def test_srun_per_gpu_script(tmp_path: Path) -> None:
    text = sbatch.render_sbatch(_spec(tmp_path, launcher="srun", gpus_per_node=4, record=True))
    assert "#SBATCH --ntasks-per-node=4" in text
    assert "RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS" in text
    assert "--evaluate-log" in text and "--record" in text


@pytest.mark.parametrize("launcher", sbatch.LAUNCHERS)
def test_scripts_are_valid_bash(tmp_path: Path, launcher: str) -> None:
    path = sbatch.write_sbatch(_spec(tmp_path, launcher=launcher))
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_time_budget_helpers() -> None:
    assert sbatch.exit_duration_minutes(30 * 60, 5) == 25
    assert sbatch.exit_duration_minutes(3 * 60, 5) == 1  # never below one minute
    assert sbatch.master_port(4536) == 61000 and sbatch.master_port(4537) == 61001
    with pytest.raises(UserError, match="no room"):
        sbatch.render_sbatch(sbatch.JobSpec(CASE, REPO_ROOT, Path("/tmp"), time_limit_min=1,
                                            kill_buffer_s=60))


def test_time_limit_arithmetic_in_the_script(tmp_path: Path) -> None:
    """Run the generated budget lines in bash with SLURM's start/end times."""
    text = sbatch.render_sbatch(_spec(tmp_path, time_limit_min=30, exit_buffer_min=5))
    lines = [ln for ln in text.splitlines() if ln.startswith(("LIMIT_S=", "if [[", "  LIMIT_S",
                                                            "fi", "EXIT_MINS=", "KILL_AFTER_S="))]
    script = "\n".join(lines) + '\necho "$LIMIT_S $EXIT_MINS $KILL_AFTER_S"\n'
    env = {"SLURM_JOB_START_TIME": "1000", "SLURM_JOB_END_TIME": str(1000 + 20 * 60), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True).stdout.split()
    assert out[0] == "1200" and out[1] == "15.00" and 1130 <= int(out[2]) <= 1140, out


def test_parse_show_job_line() -> None:
    line = ("JobId=7 JobName=hfsdp-smoke-x UserId=root(0) JobState=FAILED Reason=NonZeroExitCode "
            "Dependency=(null) ExitCode=1:0 RunTime=00:00:12 StdOut=/tmp/x-7.out Command=/tmp/a b")
    f = parse_show_job(line)
    assert (f["JobId"], f["JobState"], f["ExitCode"], f["StdOut"]) == ("7", "FAILED", "1:0", "/tmp/x-7.out")


def test_summary_verdicts(tmp_path: Path) -> None:
    out_ok, out_bad = tmp_path / "ok.out", tmp_path / "bad.out"
    out_ok.write_text("...\nHFSDP-FUNCTIONAL RESULT smoke/a: PASS\n")
    out_bad.write_text("...\nHFSDP-FUNCTIONAL RESULT smoke/b: FAIL\n")
    entry = {"case": "/x/smoke/a", "job_id": 1, "stdout": str(out_ok)}
    assert summary.judge(entry, JobInfo(1, "COMPLETED", "0:0", str(out_ok))).verdict == "PASS"
    # A zero exit code with a failing driver verdict is still a failure, and vice versa.
    assert summary.judge(entry, JobInfo(1, "COMPLETED", "0:0", str(out_bad))).verdict == "FAIL"
    assert summary.judge(entry, JobInfo(1, "FAILED", "1:0", str(out_ok))).verdict == "FAIL"
    assert summary.judge(entry, JobInfo(1, "RUNNING", "0:0", str(out_ok))).verdict == "RUNNING"
    assert summary.judge(entry, JobInfo(1, "UNKNOWN", "?", None)).verdict == "PASS"  # file fallback


def test_submit_dry_run_writes_manifest(tmp_path: Path) -> None:
    from hfsdp.slurm.submit import main

    assert main([str(CASE), "--log-dir", str(tmp_path), "--dry-run", "--time", "20"]) == 0
    manifest = json.loads((tmp_path / "jobs.json").read_text())
    assert manifest[0]["case"] == str(CASE) and manifest[0]["job_id"] is None
    assert Path(manifest[0]["script"]).is_file()


def test_local_cluster_finds_sbin_tools_on_a_non_login_path() -> None:
    """runuser, slurmctld and munged live in sbin, which `env -i PATH=/usr/bin:/bin` lacks."""
    from hfsdp.slurm.local_cluster import SBIN_DIRS, with_sbin

    path = with_sbin({"PATH": "/usr/bin:/bin:/usr/sbin"})["PATH"].split(":")
    assert path == ["/usr/bin", "/bin", "/usr/sbin", "/usr/local/sbin", "/sbin"], path
    assert with_sbin({})["PATH"].split(":")[-len(SBIN_DIRS):] == list(SBIN_DIRS)
