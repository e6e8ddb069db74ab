"""Generate sbatch scripts that run functional-test cases (docs/slurm.md).

Two launch styles, both under ``srun --label --kill-on-bad-exit=1``:

* ``torchrun`` (default, like Megatron's functional tests): ``srun --ntasks-per-node=1`` starts
  one driver per node (:data:`NODE_SCRIPT`); each runs ``python -m hfsdp.functional.run_case``,
  which launches torchrun with ``--node-rank $SLURM_NODEID``.
* ``srun`` (like Megatron's examples): one task per rank running the training script directly,
  with ``RANK=$SLURM_PROCID``, ``LOCAL_RANK=$SLURM_LOCALID``, ``WORLD_SIZE=$SLURM_NTASKS``, then
  one evaluation step. Only for single-run cases (``regular``/``smoke``).

Master: the first node of ``SLURM_JOB_NODELIST`` at the address Slurm has for it (its
``NodeAddr``, :func:`master_lines`): a node name need not resolve as a host. ``MASTER_PORT`` is
derived from the job id, so jobs sharing a host differ.

Time limits: the script reads the job's own time limit (``SLURM_JOB_END_TIME - SLURM_JOB_START_TIME``,
falling back to the generator's ``--time``), passes ``--exit-duration-in-mins`` = limit minus a
buffer to Megatron so it checkpoints and exits cleanly, and wraps the driver in ``timeout`` so a
hung collective cannot outlive the job; a node stopped so prints :data:`STOPPED_LINE`.
``set -o pipefail`` plus ``srun --kill-on-bad-exit=1`` make any failing rank fail the job with a
non-zero exit code.

Environment: sbatch hands the submitting shell's environment to the job (its default,
``--export=ALL``); the script exports only what ``JobSpec.env`` (``submit --env KEY=VALUE``)
names, and ``PYTHONPATH``, and passes the same pairs to the driver or ``launch_cmd`` as ``--env``,
where they win over the case's ENV_VARS. Nothing else is forced ([Note: launch environment] in
hfsdp/launch/env.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from hfsdp.atomic import write_text_atomic
from hfsdp.usererror import UserError, quoted

LAUNCHERS = ("torchrun", "srun")
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,:+@-]+$")


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
    env: dict[str, str] = field(default_factory=dict)  # set in the job; wins over the case's ENV_VARS
    ranks_per_gpu: int = 1  # several ranks per GPU (one node only): docs/several-ranks-per-gpu.md

    @property
    def job_name(self) -> str:
        return f"hfsdp-{self.case_dir.parent.name}-{self.case_dir.name}"

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node * self.ranks_per_gpu

    def validate(self) -> None:
        """Raise a UserError for a spec no job could run with (explicit checks: ``python -O`` too)."""
        if self.launcher not in LAUNCHERS:
            raise UserError(f"launcher {self.launcher!r} is not one of {LAUNCHERS}", "pass --launcher torchrun or srun")
        for name, value in (("--nodes", self.nodes), ("--gpus-per-node", self.gpus_per_node),
                            ("--time", self.time_limit_min), ("--ranks-per-gpu", self.ranks_per_gpu)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name} {value!r}: must be > 0", f"pass a positive whole number to {name}")
        for option, text in (("--partition", self.partition), ("--account", self.account)):
            if text is not None and not _SLURM_NAME.match(text):
                raise UserError(f"{option} {text!r} is not a Slurm name (letters, digits and _.,:+@- only); it "
                                "would not read as one #SBATCH line", f"pass the {option[2:]}'s name as sinfo/sacctmgr "
                                "shows it")
        if not self.python.strip() or any(c in self.python for c in "\n\0"):
            raise UserError(f"--python {self.python!r} names no program", "pass the Python that runs the job, "
                            "e.g. --python python3 (default: this Python)")
        if any(c.isspace() for c in str(self.log_dir)):
            raise UserError(f"--log-dir {str(self.log_dir)!r} holds white space, and sbatch reads an #SBATCH "
                            "--output line word by word", "pick a log folder whose path has no spaces")
        if self.ranks_per_gpu > 1 and self.nodes > 1:
            raise UserError(f"--ranks-per-gpu {self.ranks_per_gpu} runs on one host only, and this job asks for "
                            f"{self.nodes} nodes", "submit it with --nodes 1, or drop --ranks-per-gpu "
                            "(docs/several-ranks-per-gpu.md)")
        if self.ranks_per_gpu > 1 and not self.use_gpus:
            raise UserError(f"--ranks-per-gpu {self.ranks_per_gpu} shares GPUs between ranks, and --cpu asks for "
                            "none", "drop --cpu to request GPUs, or drop --ranks-per-gpu")
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


STOPPED_LINE = ("HFSDP-SLURM STOPPED node=$SLURMD_NODENAME: time limit (the job time limit less its buffer ran "
                "out; the run was ended)")

# Run on each node by srun (torchrun per node): $1 is the seconds left before the job's own limit
# less its buffer, the rest the driver's command line; the node's rank comes from Slurm here.
NODE_SCRIPT = f"""\
limit=$1; shift
timeout --signal=TERM --kill-after=30 "$limit" "$@" --node-rank "$SLURM_NODEID"
rc=$?
if [ "$rc" -eq 124 ]; then
  echo "{STOPPED_LINE}"
fi
exit "$rc"
"""


def master_lines() -> list[str]:
    """Shell lines that set MASTER_ADDR and MASTER_PORT (see the module docstring)."""
    return [
        "# The master: the first node of the allocation, at the address Slurm has for it (its NodeAddr);",
        "# a node's name need not resolve to a host.",
        'FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        "MASTER_ADDR=$(scontrol show node -o \"$FIRST_NODE\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p' "
        "| sed -n 1p) || MASTER_ADDR=",
        'if [[ -z "$MASTER_ADDR" ]]; then',
        '  echo "hfsdp: scontrol gave no NodeAddr for $FIRST_NODE; using the node name as the master address"',
        '  MASTER_ADDR=$FIRST_NODE',
        "fi",
        "MASTER_PORT=$(( 61000 + SLURM_JOB_ID % 4536 ))",
        "export MASTER_ADDR MASTER_PORT",
    ]


def render_sbatch(spec: JobSpec) -> str:
    """The sbatch script text for ``spec``."""
    spec.validate()
    out_root = spec.log_dir / "functional"
    ranks = spec.ranks_per_node
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
        header.append(f"#SBATCH --cpus-per-task={ranks}")
    else:
        header.append(f"#SBATCH --ntasks-per-node={ranks}")
    if spec.use_gpus:
        header.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.partition:
        header.append(f"#SBATCH --partition={spec.partition}")
    if spec.account:
        header.append(f"#SBATCH --account={spec.account}")
    header.extend(f"#SBATCH {line}" for line in spec.extra_sbatch)

    # Options both the driver and launch_cmd take: --env wins over the case's ENV_VARS there.
    shared = [f"--ranks-per-gpu {spec.ranks_per_gpu}"] if spec.ranks_per_gpu > 1 else []
    shared += [f"--env {quoted(f'{k}={v}')}" for k, v in sorted(spec.env.items())]
    record = ["--record"] if spec.record else []
    body = [
        "set -euo pipefail",
        f"cd {quoted(spec.repo_root)}",
        *(f"export {k}={quoted(v)}" for k, v in sorted(spec.env.items())),  # --env only
        f"export PYTHONPATH={quoted(spec.repo_root)}${{PYTHONPATH:+:$PYTHONPATH}}",
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
        *master_lines(),
        f"PY={quoted(spec.python)}",
        f"OUT_ROOT={quoted(out_root)}/$SLURM_JOB_ID",
        f"CASE={quoted(spec.case_dir)}",
        'echo "hfsdp: case=$CASE nodes=$SLURM_JOB_NUM_NODES ($SLURM_JOB_NODELIST) '
        'master=$FIRST_NODE@$MASTER_ADDR:$MASTER_PORT limit=${LIMIT_S}s exit_mins=$EXIT_MINS"',
        "",
    ]
    if spec.launcher == "torchrun":
        body += [
            "# One driver per node (torchrun inside); --label prefixes each line with the node's task",
            "# number, srun names the node of a task that fails, and --kill-on-bad-exit ends the others.",
            f"NODE_SCRIPT={quoted(NODE_SCRIPT)}",
            f'RUN_CASE=("$PY" -m hfsdp.functional.run_case "$CASE" --nproc {ranks} '
            '--nnodes "$SLURM_JOB_NUM_NODES" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" '
            '--output-dir "$OUT_ROOT" --exit-duration-in-mins "$EXIT_MINS"'
            + "".join(f" {a}" for a in [*shared, *record]) + ")",
            'srun --kill-on-bad-exit=1 --label --ntasks-per-node=1 bash -c "$NODE_SCRIPT" node "$KILL_AFTER_S" '
            '"${RUN_CASE[@]}"',
        ]
    else:
        body += [
            "# One task per rank: the training script itself, ranks from SLURM, lines labelled by rank.",
            'CMD_TEXT=$("$PY" -m hfsdp.slurm.launch_cmd "$CASE" --output-dir "$OUT_ROOT" '
            '--exit-duration-in-mins "$EXIT_MINS"' + "".join(f" {a}" for a in shared) + ")",
            'mapfile -t CMD <<< "$CMD_TEXT"',
            'mkdir -p "$OUT_ROOT"',
            "rc=0",
            'timeout --signal=TERM --kill-after=30 "$KILL_AFTER_S" '
            "srun --kill-on-bad-exit=1 --label bash -c '"
            "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS; "
            "exec \"$@\"' _ \"${CMD[@]}\" 2>&1 | tee \"$OUT_ROOT/run1.log\" || rc=$?",
            'if [[ "$rc" -eq 124 ]]; then',
            f'  echo "{STOPPED_LINE}"',
            "fi",
            '[[ "$rc" -eq 0 ]] || exit "$rc"',
            '"$PY" -m hfsdp.functional.run_case "$CASE" --nproc "$SLURM_NTASKS" --output-dir "$OUT_ROOT" '
            '--evaluate-log "$OUT_ROOT/run1.log"' + "".join(f" {a}" for a in [*shared, *record]),
        ]
    return "\n".join(header) + "\n\n" + "\n".join(body) + "\n"


def write_sbatch(spec: JobSpec, path: Path | None = None) -> Path:
    """Write the script to ``path`` (default ``<log_dir>/<job_name>.sbatch``), atomically, and return its path."""
    text = render_sbatch(spec)
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    path = path or spec.log_dir / f"{spec.job_name}.sbatch"
    write_text_atomic(path, text)
    return path
