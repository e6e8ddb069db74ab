"""Generate sbatch scripts that run functional-test cases.

Two launch styles:

* ``torchrun`` (default, like Megatron's functional tests): ``srun --ntasks-per-node=1`` starts
  one driver per node; each runs ``python -m hfsdp.functional.run_case`` which launches torchrun
  with ``MASTER_ADDR`` = first host of ``SLURM_JOB_NODELIST`` (``scontrol show hostnames``),
  ``MASTER_PORT`` derived from the job id, and ``--node-rank $SLURM_NODEID``.
* ``srun`` (like Megatron's examples): one task per GPU running the training script directly,
  with ``RANK=$SLURM_PROCID``, ``LOCAL_RANK=$SLURM_LOCALID``, ``WORLD_SIZE=$SLURM_NTASKS``, then
  one evaluation step. Only for single-run cases (``regular``/``smoke``).

Time limits: the script reads the job's own time limit (``SLURM_JOB_END_TIME - SLURM_JOB_START_TIME``,
falling back to the generator's ``--time``), passes ``--exit-duration-in-mins`` = limit minus a
buffer to Megatron so it checkpoints and exits cleanly, and wraps the driver in ``timeout`` so a
hung collective cannot outlive the job. ``set -o pipefail`` plus ``srun --kill-on-bad-exit=1``
make any failing rank fail the job with a non-zero exit code.

Environment: sbatch hands the submitting shell's environment to the job (its default,
``--export=ALL``); the script exports only what ``JobSpec.env`` (``submit --env KEY=VALUE``)
names, and ``PYTHONPATH``. Nothing else is forced ([Note: launch environment] in
hfsdp/launch/env.py).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from hfsdp.atomic import write_text_atomic
from hfsdp.usererror import UserError

LAUNCHERS = ("torchrun", "srun")


@dataclass(frozen=True)
class JobSpec:
    """One sbatch job running one functional-test case."""

    case_dir: Path  # .../test_cases/<model>/<case>
    repo_root: Path
    log_dir: Path  # sbatch stdout/stderr and the driver's outputs go under here
    nodes: int = 1
    gpus_per_node: int = 2  # = processes per node
    time_limit_min: int = 30
    exit_buffer_min: float = 5.0  # Megatron stops this long before the job's end
    kill_buffer_s: int = 60  # the timeout wrapper fires this long before the job's end
    launcher: str = "torchrun"
    partition: str | None = None
    account: str | None = None
    use_gpus: bool = True  # false for the CPU smoke cases
    python: str = "python"
    record: bool = False
    extra_sbatch: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    @property
    def job_name(self) -> str:
        return f"hfsdp-{self.case_dir.parent.name}-{self.case_dir.name}"

    def validate(self) -> None:
        """Raise a UserError for a spec no job could run with (explicit checks: ``python -O`` too)."""
        if self.launcher not in LAUNCHERS:
            raise UserError(f"launcher {self.launcher!r} is not one of {LAUNCHERS}", "pass --launcher torchrun or srun")
        for name, value in (("--nodes", self.nodes), ("--gpus-per-node", self.gpus_per_node),
                            ("--time", self.time_limit_min)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name} {value!r}: must be > 0", f"pass a positive whole number to {name}")
        if self.time_limit_min * 60 <= self.kill_buffer_s:
            raise UserError(
                f"--time {self.time_limit_min} min leaves no room for the {self.kill_buffer_s} s the job keeps "
                "to end a hung run before SLURM's own limit",
                f"pass --time {self.kill_buffer_s // 60 + 2} or more (minutes)",
            )
        if not 0 <= self.exit_buffer_min < self.time_limit_min:
            raise UserError(
                f"--exit-buffer-min {self.exit_buffer_min:g} must be >= 0 and less than --time {self.time_limit_min}",
                "Megatron stops that many minutes before the job's end; pass a smaller buffer or a longer --time",
            )


def exit_duration_minutes(time_limit_s: float, buffer_min: float) -> float:
    """Minutes Megatron may train before exiting (``--exit-duration-in-mins``); at least 1."""
    return max(1.0, time_limit_s / 60.0 - buffer_min)


def master_port(job_id: int) -> int:
    """Deterministic per-job port (enroot's pytorch hook uses the same formula)."""
    return 61000 + job_id % 4536


def _q(value: object) -> str:
    return shlex.quote(str(value))


def render_sbatch(spec: JobSpec) -> str:
    """The sbatch script text for ``spec``."""
    spec.validate()
    out_root = spec.log_dir / "functional"
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nodes}",
        f"#SBATCH --time={spec.time_limit_min}",
        f"#SBATCH --output={spec.log_dir}/%x-%j.out",
        f"#SBATCH --error={spec.log_dir}/%x-%j.out",
    ]
    if spec.launcher == "torchrun":
        header.append("#SBATCH --ntasks-per-node=1")
        header.append(f"#SBATCH --cpus-per-task={spec.gpus_per_node}")
    else:
        header.append(f"#SBATCH --ntasks-per-node={spec.gpus_per_node}")
    if spec.use_gpus:
        header.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.partition:
        header.append(f"#SBATCH --partition={spec.partition}")
    if spec.account:
        header.append(f"#SBATCH --account={spec.account}")
    header.extend(f"#SBATCH {line}" for line in spec.extra_sbatch)

    body = [
        "set -euo pipefail",
        f"cd {_q(spec.repo_root)}",
        *(f"export {k}={_q(v)}" for k, v in sorted(spec.env.items())),  # --env only
        f"export PYTHONPATH={_q(spec.repo_root)}${{PYTHONPATH:+:$PYTHONPATH}}",
        "",
        "# Time budget: the job's own limit when SLURM exports it, else what we asked for.",
        f"LIMIT_S={spec.time_limit_min * 60}",
        'if [[ -n "${SLURM_JOB_END_TIME:-}" && -n "${SLURM_JOB_START_TIME:-}" ]]; then',
        "  LIMIT_S=$(( SLURM_JOB_END_TIME - SLURM_JOB_START_TIME ))",
        "fi",
        f"EXIT_MINS=$(awk -v s=\"$LIMIT_S\" 'BEGIN {{ m = s / 60 - {spec.exit_buffer_min}; "
        "if (m < 1) m = 1; printf \"%.2f\", m }')",
        f"KILL_AFTER_S=$(( LIMIT_S - {spec.kill_buffer_s} - (SECONDS) ))",
        "",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "MASTER_PORT=$(( 61000 + SLURM_JOB_ID % 4536 ))",
        "export MASTER_ADDR MASTER_PORT",
        f"OUT_ROOT={_q(out_root)}/$SLURM_JOB_ID",
        f"CASE={_q(spec.case_dir)}",
        'echo "hfsdp: case=$CASE nodes=$SLURM_JOB_NUM_NODES master=$MASTER_ADDR:$MASTER_PORT '
        'limit=${LIMIT_S}s exit_mins=$EXIT_MINS"',
    ]
    record = " --record" if spec.record else ""
    if spec.launcher == "torchrun":
        body += [
            "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c '"
            f"exec timeout --signal=TERM --kill-after=30 \"$0\" {_q(spec.python)} -m hfsdp.functional.run_case "
            f"\"$1\" --nproc {spec.gpus_per_node} --nnodes \"$SLURM_JOB_NUM_NODES\" "
            "--node-rank \"$SLURM_NODEID\" --master-addr \"$MASTER_ADDR\" --master-port \"$MASTER_PORT\" "
            f"--output-dir \"$2\" --exit-duration-in-mins \"$3\"{record}"
            "' \"$KILL_AFTER_S\" \"$CASE\" \"$OUT_ROOT\" \"$EXIT_MINS\"",
        ]
    else:
        body += [
            "# One task per GPU: the training script itself, ranks from SLURM.",
            f"mapfile -t CMD < <({_q(spec.python)} -m hfsdp.slurm.launch_cmd \"$CASE\" --output-dir "
            "\"$OUT_ROOT\" --exit-duration-in-mins \"$EXIT_MINS\")",
            'mkdir -p "$OUT_ROOT"',
            "timeout --signal=TERM --kill-after=30 \"$KILL_AFTER_S\" "
            "srun --kill-on-bad-exit=1 bash -c '"
            "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS; "
            "exec \"$@\"' _ \"${CMD[@]}\" 2>&1 | tee \"$OUT_ROOT/run1.log\"",
            f"{_q(spec.python)} -m hfsdp.functional.run_case \"$CASE\" --output-dir \"$OUT_ROOT\" "
            f"--evaluate-log \"$OUT_ROOT/run1.log\"{record}",
        ]
    return "\n".join(header) + "\n\n" + "\n".join(body) + "\n"


def write_sbatch(spec: JobSpec) -> Path:
    """Write the script to ``<log_dir>/<job_name>.sbatch`` (atomically) and return its path."""
    text = render_sbatch(spec)
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    path = spec.log_dir / f"{spec.job_name}.sbatch"
    write_text_atomic(path, text)
    return path
