"""Pass/fail per submitted case, from ``scontrol`` and the jobs' output files.

    python -m hfsdp.slurm.summary --log-dir DIR [--wait SECONDS]

A case PASSes only if its job ended ``COMPLETED`` with ``ExitCode=0:0`` *and* its output holds
``HFSDP-FUNCTIONAL RESULT <its case>: PASS`` (one such line per node with torchrun per node), no
``FAIL`` and no verdict on another case. Unfinished jobs show as RUNNING. A FAIL says why after
``--``: the time limit, the node and task where the failure began (srun's first error), the
driver's first reason. Exit status: 0 if all passed, 1 if any failed, 3 if some are still
running, 2 if the log folder is unusable or lists no submitted job (nothing ran: not "all
passed"), with a sentence saying why, like every tool here.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hfsdp.slurm.scontrol import JobInfo, show_job
from hfsdp.slurm.submit import MANIFEST, load_manifest
from hfsdp.usererror import UserError, positive, run_cli

STILL_RUNNING = 3  # 2 is every tool's "bad input" status (hfsdp/usererror.py)
# Job output lines. ``srun --label`` puts "<task>: " before each line of a task (the node's index
# with torchrun per node, the rank with srun per rank); srun's own messages name the node.
_RESULT = re.compile(r"^\s*(?:(\d+): )?HFSDP-FUNCTIONAL RESULT (\S+): (PASS|FAIL)\s*$", re.M)
_REASON = re.compile(r"^\s*(?:(\d+): )?  - (.+)$", re.M)
_SRUN_ERROR = re.compile(r"^srun: error: ([^\s:]+): (tasks? [0-9,-]+): (.+)$", re.M)
_STOPPED = re.compile(r"^\s*(?:\d+: )?HFSDP-SLURM STOPPED node=(\S*): (.+)$", re.M)


@dataclass(frozen=True)
class CaseStatus:
    case: str
    job_id: int | None
    verdict: str  # PASS / FAIL / RUNNING
    detail: str


@dataclass(frozen=True)
class JobOutput:
    """What a job's output file says: every driver's verdict, and where a failure began."""

    verdicts: list[str]  # PASS/FAIL, one per driver that printed one (one per node, torchrun per node)
    others: list[str]  # cases other than the job's whose verdict the output prints
    reasons: list[str]  # the failing drivers' reasons, "task N: ..." where lines are labelled
    first_error: str | None  # srun's first failing task: "n2 task 1: Killed"
    stopped: list[str]  # nodes whose run the time-limit wrapper ended

    @property
    def verdict(self) -> str | None:
        """FAIL if any driver failed, PASS if some passed and none failed, None if none spoke."""
        return "FAIL" if "FAIL" in self.verdicts else ("PASS" if self.verdicts else None)


def read_output(stdout: str | None, case: str) -> JobOutput:
    """The verdicts on ``case`` (``model/name``) and the failure evidence in a job's output file
    ('' if there is none yet). A verdict on another case is no verdict on this one."""
    text = Path(stdout).read_text(errors="replace") if stdout and Path(stdout).is_file() else ""
    results = list(_RESULT.finditer(text))
    verdicts = [m.group(3) for m in results if m.group(2) == case]
    others = sorted({m.group(2) for m in results if m.group(2) != case})
    failing = {m.group(1) for m in results if m.group(3) == "FAIL"}
    reasons = [(f"task {m.group(1)}: " if m.group(1) is not None else "") + m.group(2)
               for m in _REASON.finditer(text) if m.group(1) in failing or not failing]
    error = _SRUN_ERROR.search(text)
    first = f"{error.group(1)} {error.group(2)}: {error.group(3).strip()}" if error else None
    stopped = sorted({m.group(1) or "?" for m in _STOPPED.finditer(text)})
    return JobOutput(verdicts, others, reasons, first, stopped)


def cause(info: JobInfo, out: JobOutput) -> str:
    """Why a finished job failed, in a few words: the time limit, the node where it began, the
    drivers' first reason; Slurm's own Reason if the output says nothing."""
    parts = []
    if info.state == "TIMEOUT":
        parts.append("Slurm's time limit ended the job")
    if out.stopped:
        parts.append(f"time limit: the run was ended on {', '.join(out.stopped)} before the job's end")
    if out.first_error:
        parts.append(f"first failure: {out.first_error}")
    if out.reasons:
        parts.append(f"driver: {out.reasons[0]}" + (f" (+{len(out.reasons) - 1} more)" if len(out.reasons) > 1 else ""))
    return "; ".join(parts) or f"Slurm Reason={info.reason}"


def judge(entry: dict, info: JobInfo) -> CaseStatus:
    case = Path(entry["case"]).parent.name + "/" + Path(entry["case"]).name
    out = read_output(info.std_out or entry.get("stdout"), case)
    verdict = out.verdict
    detail = f"JobState={info.state} ExitCode={info.exit_code} driver={verdict or '-'}"
    if out.others and (info.finished or info.state == "UNKNOWN"):
        return CaseStatus(case, entry["job_id"], "FAIL", f"{detail} -- the job's output gives the verdict of "
                          f"{', '.join(out.others)}, not of {case} (a job script run for another case?)")
    if info.state == "UNKNOWN":
        # scontrol forgets jobs after MinJobAge: fall back to the output file alone.
        final = "PASS" if verdict == "PASS" else ("FAIL" if verdict == "FAIL" else "RUNNING")
        detail += " (job no longer in scontrol)"
        return CaseStatus(case, entry["job_id"], final, detail + (f" -- {cause(info, out)}" if final == "FAIL" else ""))
    if not info.finished:
        return CaseStatus(case, entry["job_id"], "RUNNING", detail)
    if info.succeeded and verdict == "PASS":
        return CaseStatus(case, entry["job_id"], "PASS", detail)
    return CaseStatus(case, entry["job_id"], "FAIL", f"{detail} -- {cause(info, out)}")


def summarize(log_dir: Path) -> list[CaseStatus]:
    entries = load_manifest(log_dir, required=True)
    submitted = [e for e in entries if e.get("job_id")]
    if not submitted:
        what = (f"only the {len(entries)} job script(s) written with --dry-run" if entries else "no jobs")
        raise UserError(f"{log_dir / MANIFEST} lists {what}: nothing ran, so there is nothing to pass",
                        "submit the cases without --dry-run (python -m hfsdp.slurm.submit), then ask again")
    return [judge(e, show_job(e["job_id"])) for e in submitted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="summary", description=__doc__.split("\n")[0])
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--wait", type=positive(float, zero=True), default=0.0, help="poll until done, up to N s")

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
