"""Read job state from ``scontrol`` (accounting, hence ``sacct``, is not available)."""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass

from hfsdp.usererror import UserError

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


@dataclass(frozen=True)
class JobInfo:
    job_id: int
    state: str  # JobState, e.g. COMPLETED / FAILED / RUNNING; UNKNOWN when scontrol forgot it
    exit_code: str  # "rc:signal", e.g. "0:0" or "3:0"
    std_out: str | None
    reason: str = "None"  # Slurm's Reason, e.g. NonZeroExitCode, TimeLimit
    node_list: str = ""

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    @property
    def succeeded(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == "0:0"


def parse_show_job(text: str) -> dict[str, str]:
    """``scontrol show job -o`` output -> key/value dict (values never contain spaces there,
    except Command/WorkDir paths, which we do not need)."""
    fields: dict[str, str] = {}
    for token in shlex.split(text.strip(), posix=True):
        if "=" in token:
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
    return fields


def show_job(job_id: int, env: dict[str, str] | None = None) -> JobInfo:
    """Current scontrol view of ``job_id`` (``env`` may carry ``SLURM_CONF``)."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)],
                              capture_output=True, text=True, env=env)
    except FileNotFoundError:
        raise UserError("scontrol is not installed here (not on PATH), and the summary reads each job's state "
                        "from it", "run the summary where the jobs were submitted (a Slurm login node)") from None
    if proc.returncode != 0 or "JobId=" not in proc.stdout:
        return JobInfo(job_id, "UNKNOWN", "?", None)
    f = parse_show_job(proc.stdout)
    return JobInfo(job_id, f.get("JobState", "UNKNOWN"), f.get("ExitCode", "?"), f.get("StdOut"),
                   f.get("Reason", "None"), f.get("NodeList", ""))
