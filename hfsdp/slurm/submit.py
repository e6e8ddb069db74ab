"""Submit functional-test cases as sbatch jobs (one job per case).

    python -m hfsdp.slurm.submit <case_dir>... --log-dir DIR [--nodes 1] [--gpus-per-node 2]
        [--time 30] [--launcher torchrun|srun] [--partition P] [--cpu] [--record] [--dry-run]
        [--ranks-per-gpu N] [--env KEY=VALUE ...]

Every case and every limit is checked before anything is written: a bad one refuses the whole
submission with a sentence (exit 2). Then, per case, ``DIR/<job>.sbatch`` is written and
submitted (``<job>-2.sbatch`` and so on where an earlier job's entry points at that name: a script is
never overwritten; two case folders of one ``<model>/<case>`` are refused), and
``{job_id, case, script, stdout}`` is added to ``DIR/jobs.json`` (rewritten in one
step after each submission, so it always lists exactly the jobs that exist), which
``python -m hfsdp.slurm.summary --log-dir DIR`` reads. Jobs get the submitting environment
(sbatch's default) plus ``--env``, which also wins over the case's ENV_VARS (it reaches the
driver and the ranks as their own ``--env``). ``--ranks-per-gpu N`` (one node, GPUs) starts N
ranks on each of the ``--gpus-per-node`` GPUs, as the launcher of the same name does.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from hfsdp.atomic import loads_strict, write_json_atomic
from hfsdp.functional import outdir
from hfsdp.functional.recipe import load_recipe
from hfsdp.launch.env import add_env_option, parse_assignments
from hfsdp.launch.torchrun import add_ranks_per_gpu_option
from hfsdp.slurm.sbatch import JobSpec, write_sbatch
from hfsdp.usererror import UserError, not_a_regular_file, output_folder, positive, run_cli

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "jobs.json"
LOG_DIR_MARKER = ".hfsdp-slurm-logs"  # in every --log-dir submit made (check_log_dir)
# What sbatch says when the partition has no GPUs (generic resources) of the kind asked for.
_NO_GRES = re.compile(r"\bgres\b|generic resource", re.IGNORECASE)
_ENTRY_KEYS = {"case": str, "script": str}


def _job_id(value: object) -> bool:
    """Whether ``value`` is a Slurm job id as sbatch gives them: a whole number > 0 (not true)."""
    return type(value) is int and value > 0


def load_manifest(log_dir: Path, required: bool = False) -> list[dict]:
    """The jobs recorded in ``log_dir/jobs.json`` ([] when absent, unless ``required``)."""
    path = log_dir / MANIFEST
    if os.path.lexists(path) and (why := not_a_regular_file(path)):  # reading a pipe would block, writing replace it
        raise UserError(f"{path} {why}", f"move {path} away, or give another --log-dir")
    if not path.is_file():
        if required:
            raise UserError(f"{log_dir} has no {MANIFEST}: no jobs were submitted with this --log-dir",
                            "pass the --log-dir given to `python -m hfsdp.slurm.submit`")
        return []
    fix = f"restore {path} or move it away (submitting again starts a new one)"
    try:
        entries = loads_strict(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path} cannot be read as JSON: {exc}", fix) from exc
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and all(isinstance(e.get(k), t) for k, t in _ENTRY_KEYS.items())
        and (e.get("job_id") is None or _job_id(e.get("job_id"))) for e in entries
    ):
        raise UserError(f"{path} is not a list of jobs ({{case, script, job_id, stdout}} objects)", fix)
    return entries


def check_log_dir(log_dir: Path) -> None:
    """Refuse a ``--log-dir`` that is, or lies under, something other than a folder, or that we may
    not write to (:func:`hfsdp.usererror.output_folder`), or that is, lies in or holds a test case (the
    jobs' output folders go under it), or that holds what submit did not write ([Note: made by us] in
    hfsdp/functional/outdir.py: a log folder of an earlier submission carries LOG_DIR_MARKER, so
    submitting into it again is fine), before any job script is written."""
    fix = "give --log-dir a folder outside the test cases, e.g. out/slurm"
    outdir.check_not_a_case(log_dir, max_depth=outdir.ROOT_SCAN_DEPTH, fix=fix)
    output_folder("--log-dir", log_dir)
    outdir.refuse_foreign("--log-dir", log_dir, "give --log-dir a new or empty folder, or one an earlier submission "
                          "made", marker=LOG_DIR_MARKER, ours=None, maker="python -m hfsdp.slurm.submit",
                          rule="it writes only into log folders it made")


def check_job_names(specs: list[JobSpec], manifest: list[dict]) -> None:
    """[Note: one case per job name] A job's script is ``<log-dir>/hfsdp-<model>-<case>.sbatch``, named by
    the case folder's last two parts. Two case folders of one name (``a/gpt/x`` and ``b/gpt/x``) in one
    ``--log-dir``, both in this submission or one of them in an earlier one (jobs.json), would share
    that script, and the later would overwrite what the earlier job's entry points at: refused before
    anything is written, naming both folders. One case submitted again gets a script of its own
    (:func:`script_path`)."""
    seen: dict[str, Path] = {}
    for case in [Path(e["case"]) for e in manifest] + [s.case_dir for s in specs]:
        job = JobSpec(case_dir=case, repo_root=REPO_ROOT, log_dir=Path()).job_name
        first = seen.setdefault(job, case)
        if first != case:
            earlier = " (submitted into this --log-dir before: jobs.json)" if first in {
                Path(e["case"]) for e in manifest} else ""
            raise UserError(f"{first}{earlier} and {case} are both job {job} (named by a case folder's last two "
                            f"parts), so their scripts would both be {job}.sbatch in the --log-dir and the later would "
                            "overwrite the earlier's", "submit them with different --log-dir folders (or rename one "
                            "case folder)")


def script_path(spec: JobSpec, manifest: list[dict]) -> Path:
    """``<log-dir>/<job>.sbatch``, or ``<job>-2.sbatch``, ``-3``, ... where an earlier job (an entry of
    jobs.json with a job id) points at it: a script sbatch ran is never overwritten."""
    taken = {Path(e["script"]) for e in manifest if e.get("job_id")}
    path, n = spec.log_dir / f"{spec.job_name}.sbatch", 1
    while path in taken:
        n += 1
        path = spec.log_dir / f"{spec.job_name}-{n}.sbatch"
    return path


def submit(spec: JobSpec, dry_run: bool = False) -> dict:
    """Write and (unless ``dry_run``) sbatch one job; returns its manifest entry."""
    manifest = load_manifest(spec.log_dir)
    try:
        script = write_sbatch(spec, script_path(spec, manifest))
    except OSError as exc:
        raise UserError(f"--log-dir {spec.log_dir} cannot take the job script: {exc.strerror or exc}",
                        "pass a folder you can write to for --log-dir") from exc
    entry: dict[str, str | int | None] = {
        "case": str(spec.case_dir), "script": str(script), "job_id": None, "stdout": None,
    }
    if not dry_run:
        try:
            proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
        except FileNotFoundError:
            raise UserError("sbatch is not installed here (not on PATH); the script was written to "
                            f"{script} but not submitted",
                            "run on a SLURM login node, or pass --dry-run to only write the scripts") from None
        if proc.returncode != 0:
            said = " ".join(proc.stderr.replace("sbatch: error: ", "").split())
            if spec.use_gpus and _NO_GRES.search(said):
                raise UserError(f"the cluster has no GPUs (GRES) to give the {spec.gpus_per_node} GPUs per node "
                                f"that {spec.job_name} asks for (sbatch: {said!r}); the script was written to "
                                f"{script} but not submitted",
                                "submit GPU cases on a partition with GPUs, or pass --cpu for the CPU smoke cases")
            raise UserError(f"sbatch {script} failed: {said}",
                            "fix what sbatch reports (partition, account, limits) and submit again")
        job_id = int(proc.stdout.strip().split(";")[0])
        entry["job_id"] = job_id
        entry["stdout"] = str(spec.log_dir / f"{spec.job_name}-{job_id}.out")
    write_json_atomic(spec.log_dir / MANIFEST, manifest + [entry], indent=2, sort_keys=False)
    return entry


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="submit", description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="+", type=Path)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--nodes", type=positive(), default=1)
    parser.add_argument("--gpus-per-node", type=positive(), default=2)
    parser.add_argument("--time", type=positive(), default=30, help="job time limit (minutes)")
    parser.add_argument("--exit-buffer-min", type=float, default=5.0)
    parser.add_argument("--launcher", choices=("torchrun", "srun"), default="torchrun")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default=None)
    parser.add_argument("--cpu", action="store_true", help="request no GPUs (CPU smoke cases)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="write scripts, do not sbatch")
    add_ranks_per_gpu_option(parser)
    add_env_option(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    def run() -> int:
        ns = build_parser().parse_args(argv)  # inside run_cli: --help into a closed pipe ends quietly
        log_dir = ns.log_dir.resolve()
        check_log_dir(log_dir)
        env = parse_assignments(ns.env)
        specs = []
        for case in ns.cases:  # check everything first: a bad case or limit writes nothing
            recipe = load_recipe(case)
            if ns.launcher == "srun" and recipe.test_type == "ckpt-resume":
                raise UserError(f"{case} is a ckpt-resume case; --launcher srun runs single-run cases only",
                                "submit it with --launcher torchrun")
            spec = JobSpec(
                case_dir=recipe.case_dir, repo_root=REPO_ROOT, log_dir=log_dir, nodes=ns.nodes,
                gpus_per_node=ns.gpus_per_node, time_limit_min=ns.time,
                exit_buffer_min=ns.exit_buffer_min, launcher=ns.launcher, partition=ns.partition,
                account=ns.account, use_gpus=not ns.cpu, python=ns.python, record=ns.record, env=env,
                ranks_per_gpu=ns.ranks_per_gpu,
            )
            spec.validate()
            specs.append(spec)
        check_job_names(specs, load_manifest(log_dir))  # a corrupt manifest refuses too, before any job is submitted
        try:
            outdir.mark(log_dir, LOG_DIR_MARKER)
        except OSError as exc:
            raise UserError(f"--log-dir {log_dir} cannot be made: {exc.strerror or exc}",
                            "pass a folder you can write to for --log-dir") from exc
        for spec in specs:
            entry = submit(spec, dry_run=ns.dry_run)
            print(f"{entry['job_id'] or 'dry-run'}\t{entry['case']}\t{entry['script']}")
        return 0

    return run_cli("submit", run)


if __name__ == "__main__":
    from hfsdp.environment import require_environment

    require_environment("submit")
    sys.exit(main())
