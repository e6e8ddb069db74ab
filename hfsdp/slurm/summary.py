"""Pass/fail per submitted case, from ``scontrol`` and the jobs' output files.

    python -m hfsdp.slurm.summary --log-dir DIR [--wait SECONDS]

A case PASSes only if its job ended ``COMPLETED`` with ``ExitCode=0:0`` *and* its output holds
``HFSDP-FUNCTIONAL RESULT ...: PASS``. Unfinished jobs show as RUNNING. Exit status: 0 if all
passed, 1 if any failed, 3 if some are still running, 2 if the log folder is unusable (with a
sentence saying why, like every tool here).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hfsdp.slurm.scontrol import JobInfo, show_job
from hfsdp.slurm.submit import load_manifest
from hfsdp.usererror import run_cli

STILL_RUNNING = 3  # 2 is every tool's "bad input" status (hfsdp/usererror.py)
_RESULT = re.compile(r"HFSDP-FUNCTIONAL RESULT (\S+): (PASS|FAIL)")


@dataclass(frozen=True)
class CaseStatus:
    case: str
    job_id: int | None
    verdict: str  # PASS / FAIL / RUNNING
    detail: str


def driver_result(stdout: str | None) -> str | None:
    """Last driver verdict in a job's output file, if any."""
    if not stdout or not Path(stdout).is_file():
        return None
    found = _RESULT.findall(Path(stdout).read_text(errors="replace"))
    return found[-1][1] if found else None


def judge(entry: dict, info: JobInfo) -> CaseStatus:
    case = Path(entry["case"]).parent.name + "/" + Path(entry["case"]).name
    stdout = info.std_out or entry.get("stdout")
    verdict = driver_result(stdout)
    detail = f"JobState={info.state} ExitCode={info.exit_code} driver={verdict or '-'}"
    if info.state == "UNKNOWN":
        # scontrol forgets jobs after MinJobAge: fall back to the output file alone.
        final = "PASS" if verdict == "PASS" else ("FAIL" if verdict == "FAIL" else "RUNNING")
        return CaseStatus(case, entry["job_id"], final, detail + " (job no longer in scontrol)")
    if not info.finished:
        return CaseStatus(case, entry["job_id"], "RUNNING", detail)
    ok = info.succeeded and verdict == "PASS"
    return CaseStatus(case, entry["job_id"], "PASS" if ok else "FAIL", detail)


def summarize(log_dir: Path) -> list[CaseStatus]:
    return [judge(e, show_job(e["job_id"])) for e in load_manifest(log_dir, required=True) if e.get("job_id")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="summary", description=__doc__.split("\n")[0])
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--wait", type=float, default=0.0, help="poll until done, up to N s")

    def run() -> int:
        ns = parser.parse_args(argv)  # inside run_cli: --help into a closed pipe ends quietly
        return _report(ns.log_dir, ns.wait)

    return run_cli("summary", run)


def _report(log_dir: Path, wait: float) -> int:
    deadline = time.monotonic() + wait
    rows = summarize(log_dir)
    while any(r.verdict == "RUNNING" for r in rows) and time.monotonic() < deadline:
        time.sleep(2.0)
        rows = summarize(log_dir)
    for r in rows:
        print(f"{r.verdict:8s} {r.job_id!s:>8s}  {r.case:50s} {r.detail}")
    if any(r.verdict == "FAIL" for r in rows):
        return 1
    return STILL_RUNNING if any(r.verdict == "RUNNING" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
