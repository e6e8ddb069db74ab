"""Submit functional-test cases as sbatch jobs (one job per case).

    python -m hfsdp.slurm.submit <case_dir>... --log-dir DIR [--nodes 1] [--gpus-per-node 2]
        [--time 30] [--launcher torchrun|srun] [--partition P] [--cpu] [--record] [--dry-run]

Writes ``DIR/<job>.sbatch`` and appends ``{job_id, case, script, stdout}`` to ``DIR/jobs.json``,
which ``python -m hfsdp.slurm.summary --log-dir DIR`` reads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from hfsdp.slurm.sbatch import JobSpec, write_sbatch

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "jobs.json"


def load_manifest(log_dir: Path) -> list[dict]:
    path = log_dir / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else []


def submit(spec: JobSpec, dry_run: bool = False) -> dict:
    """Write and (unless ``dry_run``) sbatch one job; returns its manifest entry."""
    script = write_sbatch(spec)
    entry = {"case": str(spec.case_dir), "script": str(script), "job_id": None, "stdout": None}
    if not dry_run:
        proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed: {proc.stderr.strip()}")
        job_id = int(proc.stdout.strip().split(";")[0])
        entry["job_id"] = job_id
        entry["stdout"] = str(spec.log_dir / f"{spec.job_name}-{job_id}.out")
    manifest = load_manifest(spec.log_dir) + [entry]
    (spec.log_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="+", type=Path)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=2)
    parser.add_argument("--time", type=int, default=30, help="job time limit (minutes)")
    parser.add_argument("--exit-buffer-min", type=float, default=5.0)
    parser.add_argument("--launcher", choices=("torchrun", "srun"), default="torchrun")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default=None)
    parser.add_argument("--cpu", action="store_true", help="request no GPUs (CPU smoke cases)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="write scripts, do not sbatch")
    ns = parser.parse_args(argv)
    log_dir = ns.log_dir.resolve()
    for case in ns.cases:
        spec = JobSpec(
            case_dir=case.resolve(), repo_root=REPO_ROOT, log_dir=log_dir, nodes=ns.nodes,
            gpus_per_node=ns.gpus_per_node, time_limit_min=ns.time,
            exit_buffer_min=ns.exit_buffer_min, launcher=ns.launcher, partition=ns.partition,
            account=ns.account, use_gpus=not ns.cpu, python=ns.python, record=ns.record,
        )
        entry = submit(spec, dry_run=ns.dry_run)
        print(f"{entry['job_id'] or 'dry-run'}\t{entry['case']}\t{entry['script']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
