"""Run one functional-test case, write its metrics, and judge it against goldens.

    python -m hfsdp.functional.run_case <case_dir> [--record | --record-missing] [--nproc N]
        [--compare-to <other_case_dir>] [--output-dir DIR] [--platform dgx_h200] [--env KEY=VALUE]

Per case (``TEST_TYPE``):
* ``regular`` / ``smoke``: one torchrun launch.
* ``ckpt-resume``: run 1 saves every ``--save-interval`` (= TRAIN_ITERS/2); like Megatron's
  ``run_ci_test.sh`` we then drop the final checkpoint, point ``latest_checkpointed_iteration.txt``
  at the half-way one, and run 2 (``MODEL_ARGS`` + ``MODEL_ARGS_2``, ``ENV_VARS`` +
  ``ENV_VARS_2``) resumes. Run 2's ``lm loss`` must equal run 1's step for step: resuming (even
  across a flag change) must continue exactly as the straight run. ``RESUME_COMPARE`` relaxes
  this after the first resumed step(s) to an rtol, for a resume into another FSDP unit layout
  (recipe.py). Where run 1 evaluated (``--eval-iters`` > 0), run 2's validation losses must
  equal run 1's at the resumed steps too, and ``COMPARE_TO`` holds validation losses to the twin's.

Outputs under ``<output-dir>`` (default ``$HFSDP_FUNCTIONAL_OUT`` or ``<repo>/out/functional``
``/<model>/<case>``): ``run1.log`` [``run2.log``], ``metrics.json`` (golden format), and
``result.json``. The last stdout line is ``HFSDP-FUNCTIONAL RESULT <model>/<case>: <verdict>``:

* ``PASS`` (exit 0);
* ``FAIL`` (exit 1): different numbers in a matching environment, or a check of the case failed;
* ``NO GOLDEN FOR THIS ENVIRONMENT`` (exit 3): the case ran and its own checks passed, but no
  golden was recorded in an environment equal to this one; the reason line names the nearest
  golden and how its environment differs ([Note: choosing a golden] in selection.py);
* ``REFUSED`` (exit 4): the environment lacks what the recipe's ``ENVIRONMENT`` requires, or has
  what it excludes; said before any GPU work.

Input it refuses exits 2 with a sentence (hfsdp/usererror.py). Before the run the driver probes
the run's environment (hfsdp/functional/environment.py). ``--record`` writes
``golden_values_<label>_<platform>.json`` (with that environment) into the case directory
instead of comparing, only from a passing run whose metrics are complete and finite;
``--record-missing`` does so only where no golden holds for this environment, and never over a
golden of another one.

The runs get the caller's environment unchanged, plus the case's ``ENV_VARS`` and ``--env``
([Note: launch environment] in hfsdp/launch/env.py). The output folder is cleared before a run
only if the driver made it ([Note: output folders] in outdir.py); a golden must be complete and
finite and cover every step the run logged, or the case fails naming what is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hfsdp import proc
from hfsdp.atomic import write_json_atomic
from hfsdp.diagnostics import stack_dump_after_s
from hfsdp.functional import environment, golden, logparse, outdir, provenance, runlock, selection
from hfsdp.functional.environment import Environment
from hfsdp.functional.recipe import Recipe, args_to_argv, load_recipe, merged_args, merged_env
from hfsdp.launch import fit, torchrun
from hfsdp.launch.env import add_env_option, job_env, parse_assignments
from hfsdp.training import entries
from hfsdp.usererror import Interrupted, UserError, not_a_regular_file, positive, quoted, run_cli

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULT_MARK = "HFSDP-FUNCTIONAL RESULT"


@dataclass(frozen=True)
class Launch:
    """A case's torchrun on this node: where its ranks go (SLURM fills the placement per node),
    and the limits of its run."""

    placement: torchrun.Placement
    timeout_s: float | None = None
    exit_duration_in_mins: float | None = None

    @property
    def world_size(self) -> int:
        return self.placement.nproc * self.placement.nnodes


# A run whose last rank is still alive this long after its last step hangs at exit (e.g. in
# destroy_process_group); final evaluation and checkpoint saving fit well inside it.
EXIT_AFTER_LAST_STEP_S = 30.0


@dataclass
class RunRecord:
    log: str
    returncode: int
    timed_out: bool
    exit_after_last_step_s: float | None = None  # from the last step's log line to the last rank's exit


PASS, FAIL, NO_GOLDEN, REFUSED = "PASS", "FAIL", "NO GOLDEN FOR THIS ENVIRONMENT", "REFUSED"
EXIT_STATUS = {PASS: 0, FAIL: 1, NO_GOLDEN: 3, REFUSED: 4}


@dataclass
class Result:
    case: str
    status: str = PASS
    reasons: list[str] = field(default_factory=list)
    runs: list[RunRecord] = field(default_factory=list)
    metrics_path: str | None = None
    world_size: int | None = None  # ranks of the runs: a twin's metrics compare only at the same size
    golden: str | None = None  # the golden held to or recorded (file name)
    recorded: bool = False
    environment: dict | None = None  # the run's environment block (environment.py)
    recipe_hash: str | None = None  # what made the numbers, and the metrics.json written ([Note: twin provenance])
    metrics_digest: str | None = None

    def fail(self, why: str) -> None:
        self.status = FAIL
        self.reasons.append(why)


def _unclean_runs(result_path: Path) -> str:
    """How the runs recorded in ``result_path`` ended badly ('' when all exited 0 in time).

    A reference run that crashed after logging every step still leaves complete metrics;
    comparing against them would pass a case whose twin never finished.
    """
    if not result_path.is_file():
        return ""
    try:
        runs = json.loads(result_path.read_text()).get("runs", [])
    except (OSError, ValueError, AttributeError):
        return f"record {result_path} is unreadable"
    bad = [f"{Path(r.get('log', '?')).name}: " + ("timed out" if r.get("timed_out")
                                                  else f"exit {r.get('returncode')}")
           for r in runs if r.get("timed_out") or r.get("returncode") != 0]
    return "ended badly (" + ", ".join(bad) + ")" if bad else ""


def _recorded_world_size(result_path: Path) -> int | None:
    """The world size a case's ``result.json`` records (None: unknown or unreadable)."""
    try:
        size = json.loads(result_path.read_text()).get("world_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def output_dir_for(recipe: Recipe, root: Path | None) -> Path:
    base = root or Path(os.environ.get("HFSDP_FUNCTIONAL_OUT", REPO_ROOT / "out" / "functional"))
    return Path(base) / recipe.model / recipe.name


def path_variables(out: Path) -> dict[str, str]:
    """Values for ``${...}`` placeholders in MODEL_ARGS."""
    ckpt = out / "checkpoints"
    return {
        "OUTPUT_PATH": str(out),
        "CHECKPOINT_SAVE_PATH": str(ckpt),
        "CHECKPOINT_LOAD_PATH": str(ckpt),
        "TENSORBOARD_PATH": str(out / "tensorboard"),
        "DATA_PATH": os.environ.get("DATA_PATH", ""),
        "DATA_CACHE_PATH": str(out / "data_cache"),
    }


def script_target(recipe: Recipe) -> list[str]:
    """``-m module`` or the absolute script path of ``TRAINING_SCRIPT``."""
    script = recipe.training_script.split()
    if script[0] == "-m":
        return ["-m", *script[1:]]
    return [str((REPO_ROOT / script[0]).resolve()), *script[1:]]


CPU_CASE = "tests/functional_tests/test_cases/smoke/cpu_gloo_smoke"


def trains_on_gpus(recipe: Recipe) -> bool:
    """Whether the case's ``TRAINING_SCRIPT`` is one of the training entry points, which need CUDA GPUs."""
    first = recipe.training_script.split()[0]
    return first != "-m" and entries.training_entry(first) is not None


def check_gpus_for(recipe: Recipe, env: Mapping[str, str]) -> None:
    """Refuse, before anything is launched, a case that trains on GPUs where its ranks would see none."""
    if trains_on_gpus(recipe) and not fit.gpu_memory(env=env):
        visible = env.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise UserError(f"{recipe.model}/{recipe.name} trains with {recipe.training_script.split()[0]}, which needs "
                        f"CUDA GPUs, and its ranks would see none here{where}",
                        f"run it on a machine with NVIDIA GPUs; on this one `python -m hfsdp.functional.run_case "
                        f"{quoted(CPU_CASE)}` (in the checkout) runs the CPU smoke case")


def build_command(recipe: Recipe, argv: Sequence[str], launch: Launch,
                  python: str = sys.executable) -> list[str]:
    """torchrun command line for one run of ``recipe`` (hfsdp/launch/torchrun.py)."""
    argv = list(argv)
    if launch.exit_duration_in_mins is not None and "--exit-duration-in-mins" not in argv:
        argv += ["--exit-duration-in-mins", f"{launch.exit_duration_in_mins:g}"]
    return torchrun.command(launch.placement, [*script_target(recipe), *argv], python=python)


def run_env(env_vars: Mapping[str, str | None], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment, then the case's ENV_VARS, then ``--env`` (see hfsdp/launch/env.py)."""
    env = job_env(os.environ, env_vars, extra or {})
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
    )
    return env


STACK_DUMP_GRACE_S = proc.STACK_GRACE_S  # time the ranks get to write their stacks before SIGTERM


def run_problem(rec: RunRecord, n: int) -> str | None:
    """Why run ``n`` failed, or None. A run the timer fired on fails even if it then exited 0:
    its exit was not timely (it ended during the kill's grace period, or in the moment between
    its exit and the timer's cancel, or a lingering child held its output open). So does a run
    whose ranks outlived its last step by more than ``EXIT_AFTER_LAST_STEP_S``."""
    late = rec.exit_after_last_step_s
    hang = late is not None and late > EXIT_AFTER_LAST_STEP_S
    why = (f"its ranks were still alive {late:.0f} s after its last step, more than "
           f"{EXIT_AFTER_LAST_STEP_S:.0f} s: a hang at exit") if hang else ""
    if rec.returncode != 0:
        ended = f"run {n} exited with {rec.returncode}" + (" (timeout)" if rec.timed_out else "")
    elif rec.timed_out:
        ended = f"run {n} exceeded its timeout (then exited 0)"
    elif hang:
        return f"run {n}: {why}"
    else:
        return None
    return f"{ended}; {why}" if why else ended


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float | None) -> RunRecord:
    """Run ``cmd`` as a process group (hfsdp.proc), tee its output to ``log`` and stdout."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as sink:
        sink.write("$ " + " ".join(cmd) + "\n")
        sink.flush()

        last_step: list[float] = []

        def tee(line: str) -> None:
            sink.write(line)
            sys.stdout.write(line)
            if logparse.is_step_line(line):
                last_step[:] = [time.monotonic()]

        res = proc.run_group(cmd, timeout_s=timeout_s, env=env, cwd=REPO_ROOT, on_line=tee,
                             stack_grace_s=STACK_DUMP_GRACE_S)
        ended = time.monotonic()
        exit_s = round(ended - last_step[0], 1) if last_step else None
        if res.timed_out or res.stragglers:
            sink.write(f"[hfsdp] run ended: rc={res.returncode} timed_out={res.timed_out} "
                       f"signals={','.join(res.signals) or '-'} stragglers={res.stragglers}\n")
        if exit_s is not None:
            sink.write(f"[hfsdp] last rank exited {exit_s} s after the last step\n")
    return RunRecord(str(log), res.returncode, res.timed_out, exit_s)


def prepare_resume(ckpt_dir: Path, half: int, final: int) -> None:
    """Keep the half-way checkpoint only and make it the one ``--load`` picks."""
    half_dir = ckpt_dir / f"iter_{half:07d}"
    if not half_dir.is_dir():
        raise FileNotFoundError(f"run 1 left no {half_dir}; is --save-interval {half}?")
    final_dir = ckpt_dir / f"iter_{final:07d}"
    if final_dir.is_dir():
        shutil.rmtree(final_dir)
    (ckpt_dir / "latest_checkpointed_iteration.txt").write_text(str(half))


# torchrun's agents of a multi-node run meet at an exit barrier in the store that the first
# node's agent hosts. When that agent passes the barrier and exits while another agent still waits
# for the store's answer, the waiting agent logs "Error waiting on exit barrier" with the
# exception's traceback, and then exits 0 like the ranks did: a race inside torch elastic, after
# every rank has finished, not a failure of the run. That one log record is left out of the
# forbidden-pattern checks (its lines share the record's prefix: level, time, pid, source line).
# torch names its source file relative to where it was imported from: "torch/..." or, with a
# virtual environment inside the working folder, ".venv/lib/python3.12/site-packages/torch/...".
_EXIT_BARRIER = re.compile(r"^(?P<prefix>E\d{4} [\d:.]+ \d+ (?:\S*/)?"
                           r"torch/distributed/elastic/agent/server/api\.py:\d+\]) "
                           r"Error waiting on exit barrier", re.M)


def without_exit_barrier_race(text: str) -> tuple[str, bool]:
    """``text`` without torchrun's exit-barrier error record (see above); whether there was one."""
    prefixes = {m.group("prefix") for m in _EXIT_BARRIER.finditer(text)}
    if not prefixes:
        return text, False
    kept = [ln for ln in text.splitlines(keepends=True) if not any(p in ln for p in prefixes)]
    return "".join(kept), True


def apply_checks(recipe: Recipe, log: Path, metrics: logparse.Metrics, result: Result,
                 judges_loss: bool = True) -> None:
    """The recipe's CHECKS on one run's log. ``judges_loss`` False (a node before the last of a
    multi-node run, whose ranks log no loss): the forbidden patterns only."""
    text, raced = without_exit_barrier_race(log.read_text(errors="replace"))
    if raced:
        print(f"note: {log.name}: torchrun's agent logged an error at the exit barrier after its ranks "
              "finished (the first node's agent left first); not counted against the run", flush=True)
    for pattern in recipe.checks.log_absent:
        if re.search(pattern, text):
            result.fail(f"{log.name}: forbidden log pattern {pattern!r} found")
    if not judges_loss:
        return
    for pattern in recipe.checks.log_present:
        if not re.search(pattern, text):
            result.fail(f"{log.name}: required log pattern {pattern!r} not found")
    loss = metrics.get("lm loss", {})
    if len(loss) < recipe.checks.min_iterations:
        result.fail(f"{log.name}: {len(loss)} iterations logged, need {recipe.checks.min_iterations}")
    if any(not math.isfinite(v) for v in loss.values()):
        result.fail(f"{log.name}: non-finite lm loss")
    if recipe.checks.loss_decreases and loss:
        first, last = loss[min(loss)], loss[max(loss)]
        if not last < first:
            result.fail(f"{log.name}: lm loss did not decrease ({first} -> {last})")


def compare_curves(name: str, a: logparse.Metrics, b: logparse.Metrics,
                   steps: set[int] | None, result: Result, loss_rtol: float = 0.0) -> None:
    """The losses of two curves on ``steps`` (default: all of ``a``'s): equal, or within rtol.

    ``lm loss`` always; each other of ``golden.LOSS_METRICS`` (the validation loss) where the
    reference ``a`` has it, so that ``b`` must then have it at the same steps.
    """
    names = [n for n in golden.LOSS_METRICS if n == "lm loss" or n in a]
    problems = golden.compare(a, b, names, steps=steps, loss_rtol=loss_rtol)
    for p in problems:
        result.fail(f"{name}: {p}")
    if not a.get("lm loss"):
        result.fail(f"{name}: reference curve is empty")


TWIN_WAIT_S = 3600.0  # how long a case waits for a run rewriting its twin, when it has no timeout of its own


def _compare_with_twin(recipe: Recipe, twin: Recipe, twin_metrics: Path, metrics: logparse.Metrics,
                       env: Mapping[str, str] | None, result: Result) -> None:
    """Hold this run's losses to its COMPARE_TO twin's, read from the twin's output folder (under its
    lock: [Note: one run per output folder] in runlock.py), or say why the twin is no reference."""
    name = f"{twin.model}/{twin.name}"
    if crashed := _unclean_runs(twin_metrics.parent / "result.json"):
        result.fail(f"compare-to case {name} is no reference: its run {crashed} (rerun it first)")
    elif twin_metrics.is_file() and (stale := provenance.mismatch(twin, env, twin_metrics.parent)):
        result.fail(f"compare-to case {name} is no reference: {stale}; rerun it first: "
                    f"`python -m hfsdp.functional.run_case {quoted(twin.case_dir)}` (with this run's options)")
    elif twin_metrics.is_file():
        try:
            other_metrics = golden.load(twin_metrics)
        except golden.GoldenError as exc:
            result.fail(f"compare-to case {name}: {exc.cause}")
        else:
            compare_curves(f"vs {name}", other_metrics, metrics, None, result, loss_rtol=recipe.compare_rtol)


GOLDEN_MARK = "run_case: golden"  # the line naming the golden a run was held to (the batch runner reads it)


def choose_golden(recipe: Recipe, run: Environment, platform: str | None, shared: bool) -> selection.Selection:
    """The golden for ``run`` ([Note: choosing a golden] in selection.py). ``platform`` given: that
    platform's golden, its GPU kind not compared with this machine's."""
    base = platform or selection.platform_of(run)
    base = base.removesuffix(golden.SHARED_SUFFIX)
    platforms = [base + golden.SHARED_SUFFIX, base] if shared else [base]
    ignore_gpu = platform is not None and selection.kind_of(base) != run.gpu
    return selection.select(recipe, run, platforms, ignore_gpu=ignore_gpu, any_kind=shared)


@runlock.holding  # the output folders it locks are its own until it returns
def run_case(case_dir: Path, *, launch: Launch | None = None, record: bool = False, record_missing: bool = False,
             compare_to: Path | None = None, output_root: Path | None = None, platform: str | None = None,
             evaluate_log: Path | None = None, env: Mapping[str, str] | None = None,
             run_environment: Environment | None = None) -> Result:
    """Run and judge one case; see the module docstring.

    ``evaluate_log`` judges an existing log instead of launching (the srun-per-GPU SLURM mode
    launches the ranks itself and calls this afterwards; single-run cases only). ``env`` is
    ``--env``: set in the launched runs on top of the caller's environment and ENV_VARS.
    ``platform``: the golden's platform (default: this machine's GPU kind and the tree's base).
    ``run_environment``: the environment already probed (a twin's run shares its case's).
    """
    recipe = load_recipe(case_dir)
    launch = launch or Launch(torchrun.Placement(nproc=recipe.nproc))
    torchrun.check(launch.placement)
    shared = launch.placement.shared
    at_recipe_size = launch.world_size == recipe.nproc  # goldens hold runs of NPROC ranks on one node
    if record and not at_recipe_size:
        raise UserError(f"{recipe.model}/{recipe.name} records goldens of NPROC={recipe.nproc} ranks, and this "
                        f"launch has {launch.world_size}", f"record it with --nproc {recipe.nproc} on one node")
    if launch.placement.nnodes > 1 and recipe.test_type == "ckpt-resume":
        raise UserError(f"{recipe.model}/{recipe.name} is a ckpt-resume case, which runs on one node "
                        "(the resume step edits the checkpoint)", "run it with --nnodes 1")
    if output_root is not None:
        outdir.check_root(output_root)
    # The twin is read before anything runs: a bad --compare-to must not cost the case's run.
    other = compare_to or (recipe.case_dir / recipe.compare_to if recipe.compare_to else None)
    try:
        other_recipe = load_recipe(other) if other is not None else None
    except UserError as exc:
        raise UserError(f"--compare-to: {exc.cause}" if compare_to else exc.cause, exc.fix) from exc
    out = output_dir_for(recipe, output_root)
    if launch.placement.nnodes > 1:
        out = out / f"node{launch.placement.node_rank}"  # per-node logs; no cross-node file races
    result = Result(case=f"{recipe.model}/{recipe.name}", world_size=launch.world_size,
                    recipe_hash=provenance.recipe_hash(recipe, env))
    # The environment is compared before any number, and a case's declared needs before any GPU work.
    measured = run_environment or environment.probe(run_env(recipe.env_vars, env))
    result.environment = measured.to_json()
    if (unmet := selection.unmet_needs(recipe, measured)) is not None:
        result.status, result.reasons = REFUSED, [unmet]
        return result
    chosen = choose_golden(recipe, measured, platform, shared)
    if record_missing and not chosen.matched and os.path.lexists(chosen.path):
        raise UserError(f"--record-missing would write {chosen.path}, which holds a golden of another environment "
                        f"({'; '.join(chosen.differences) or chosen.problem})",
                        "pass --record to replace it, or record this environment's golden on another platform name")
    record = record or (record_missing and not chosen.matched)
    golden_path = chosen.path
    result.golden = golden_path.name
    print(f"{GOLDEN_MARK} {golden_path.name} ({'recorded from this run' if record else 'held to' if chosen.matched
                                              else 'none for this environment'}); environment {measured.label()}: "
          f"{measured.describe()}", flush=True)
    if evaluate_log is not None:
        if recipe.test_type == "ckpt-resume":
            raise UserError(f"{recipe.model}/{recipe.name} is a ckpt-resume case; --evaluate-log judges "
                            "single-run cases only", "run it without --evaluate-log (the driver launches both runs)")
        if why := not_a_regular_file(evaluate_log):
            what = "is a folder, not a log file" if Path(evaluate_log).is_dir() else why
            raise UserError(f"--evaluate-log {evaluate_log} {what}",
                            "pass the log the training wrote (the srun-per-GPU sbatch script tees it to run1.log)")
        runlock.hold(out, result.case)  # one run per output folder (runlock's note)
        outdir.prepare(out, clear=False)  # writes only into a folder the driver made (outdir's note)
        rec1 = RunRecord(str(evaluate_log), 0, False)
    else:
        argv1 = args_to_argv(recipe.model_args, path_variables(out))
        env1 = run_env(recipe.env_vars, env)
        # Every check comes before the output folder is cleared: a refused run loses nothing.
        outdir.check(out)
        runlock.hold(out, result.case)
        if shared:
            flags = entries.megatron_flags(recipe.training_script.split()[0], argv1)
            print(f"run_case: {fit.preflight(launch.placement, flags, environ=env1)}", flush=True)
        else:
            check_gpus_for(recipe, env1)
        outdir.prepare(out, clear=True)  # a stale checkpoint would turn run 1 into a resume
        rec1 = run_logged(build_command(recipe, argv1, launch), env1,
                          out / "run1.log", launch.timeout_s)
    variables = path_variables(out)
    result.runs.append(rec1)
    metrics = logparse.parse_file(rec1.log)
    if (problem := run_problem(rec1, 1)) is not None:
        result.fail(problem)
    # Megatron prints the loss on the last rank only: a node before the last judges its exit
    # status and the forbidden log patterns, the last node the loss too.
    last_node = launch.placement.node_rank == launch.placement.nnodes - 1
    apply_checks(recipe, Path(rec1.log), metrics, result, judges_loss=last_node)

    if recipe.test_type == "ckpt-resume" and rec1.returncode == 0:
        final = recipe.train_iters
        half = final // 2
        try:
            prepare_resume(Path(variables["CHECKPOINT_SAVE_PATH"]), half, final)
        except FileNotFoundError as exc:
            result.fail(str(exc))
        else:
            argv2 = args_to_argv(merged_args(recipe.model_args, recipe.model_args_2), variables)
            env2 = merged_env(recipe.env_vars, recipe.env_vars_2)
            rec2 = run_logged(build_command(recipe, argv2, launch), run_env(env2, env),
                              out / "run2.log", launch.timeout_s)
            result.runs.append(rec2)
            metrics2 = logparse.parse_file(rec2.log)
            if (problem := run_problem(rec2, 2)) is not None:
                result.fail(problem)
            apply_checks(recipe, Path(rec2.log), metrics2, result)
            resumed = set(range(half + 1, final + 1))
            if not resumed <= set(metrics2.get("lm loss", {})):
                result.fail(f"run 2 did not log every step {half + 1}..{final}")
            exact, close = recipe.resume_compare.split(resumed)
            compare_curves("resume vs straight run", metrics, metrics2, exact, result)
            if close:
                compare_curves("resume vs straight run", metrics, metrics2, close, result,
                               loss_rtol=recipe.resume_compare.rtol)

    result.metrics_digest = provenance.metrics_digest(golden.to_golden(metrics, list(metrics)))
    metrics_path = out / "metrics.json"
    golden.save(metrics_path, metrics, list(metrics), measured)
    result.metrics_path = str(metrics_path)

    if not last_node:
        write_json_atomic(out / "result.json", asdict(result), indent=2, sort_keys=False)
        return result
    # Cross-case checks come first: a golden is recorded only from a run that passed them all.
    if other is not None and other_recipe is not None:
        other_metrics_path = output_dir_for(other_recipe, output_root) / "metrics.json"
        twin_out = other_metrics_path.parent
        wait_s = launch.timeout_s or TWIN_WAIT_S
        try:  # the twin's folder is read under its lock, never while another run writes it (runlock's note)
            with runlock.reading(twin_out, result.case, wait_s):
                rerun = (not other_metrics_path.is_file()
                         or _recorded_world_size(twin_out / "result.json") != launch.world_size
                         or provenance.mismatch(other_recipe, env, twin_out))  # [Note: twin provenance]
            if rerun:
                sub = run_case(Path(other), launch=launch, output_root=output_root, platform=platform,
                               record=False, env=env, run_environment=measured)
                if sub.status != "PASS" and not other_metrics_path.is_file():
                    result.fail(f"compare-to case {sub.case} failed: {sub.reasons}")
            with runlock.reading(twin_out, result.case, wait_s):
                _compare_with_twin(recipe, other_recipe, other_metrics_path, metrics, env, result)
        except runlock.Busy as exc:
            result.fail(f"compare-to case {other_recipe.model}/{other_recipe.name} was not read: {exc.cause}; "
                        f"{exc.fix}")

    odd_golden = not_a_regular_file(golden_path) if os.path.lexists(golden_path) else None
    if odd_golden is not None:  # neither read (a pipe would block) nor replaced: it is not ours to lose
        result.fail(f"golden {golden_path} {odd_golden}; it is neither compared nor recorded over")
    elif record:
        missing = golden.incomplete_metrics(metrics, recipe.metrics)
        if missing:
            result.fail(f"not recording goldens: the run's metrics are not complete and finite ({'; '.join(missing)})")
        elif result.status == PASS:
            golden.save(golden_path, metrics, list(recipe.metrics), measured)
            result.recorded = True
            print(f"recorded {golden_path}")
        else:
            result.fail("not recording goldens from a failing run")
    elif golden_path.is_file() and not at_recipe_size:
        print(f"note: golden {golden_path.name} holds a run of NPROC={recipe.nproc} ranks and this one has "
              f"{launch.world_size}: not compared (the twin, if any, ran at {launch.world_size} too)")
    elif chosen.matched:
        held_to = selection.parse_name(golden_path.name)
        names, skipped = golden.compared_metrics(recipe.metrics, shared, held_to[1] if held_to else "")
        if skipped:
            print(f"note: golden {golden_path.name}: {', '.join(skipped)} not compared (several ranks per "
                  "GPU on one side: [Note: goldens of the several-ranks-per-GPU mode] in golden.py)")
        try:
            expected = golden.read_golden(golden_path, recipe.metrics)
        except golden.GoldenError as exc:
            result.fail(f"{exc.cause} -> {exc.fix}")
        else:
            for mismatch in golden.compare(expected, metrics, names):
                result.fail(f"golden {golden_path.name}: {mismatch}")
            if "iteration-time" in names and (drift := golden.iteration_time_drift(expected, metrics)):
                print(f"note: golden {golden_path.name}: {drift}")
            for uncovered in golden.uncovered_steps(expected, metrics, names):
                result.fail(f"golden {golden_path.name}: {uncovered}; re-record it with --record")
    elif chosen.problem is not None:
        result.fail(chosen.problem)
    elif recipe.require_golden and at_recipe_size:
        if result.status == PASS:
            result.status = NO_GOLDEN
        result.reasons.append(f"no golden for this environment: {chosen.verdict_line()}")

    write_json_atomic(out / "result.json", asdict(result), indent=2, sort_keys=False)
    return result


def env_port(environ: Mapping[str, str]) -> int | None:
    """``MASTER_PORT`` from the environment (None when unset); a value that is no port is refused."""
    raw = environ.get("MASTER_PORT")
    if raw is None:
        return None
    if not (raw.isdigit() and 0 < int(raw) < 65536):
        raise UserError(f"MASTER_PORT={raw!r} is not a TCP port", "unset it, or set a port from 1 to 65535")
    return int(raw)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run_case", description=__doc__.split("\n")[0])
    parser.add_argument("case_dir", type=Path)
    record = parser.add_mutually_exclusive_group()
    record.add_argument("--record", action="store_true", help="write this environment's golden instead of comparing")
    record.add_argument("--record-missing", action="store_true",
                        help="record this environment's golden only where the case has none for it")
    parser.add_argument("--nproc", type=positive(int), default=None, help="processes per node (default: NPROC)")
    parser.add_argument("--nnodes", type=positive(int), default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                        help="default: $MASTER_ADDR, else 127.0.0.1")
    parser.add_argument("--master-port", type=positive(int), default=None,
                        help="default: $MASTER_PORT, else a free port (one node only)")
    torchrun.add_ranks_per_gpu_option(parser)
    parser.add_argument("--compare-to", type=Path, default=None,
                        help="another case whose lm loss curve must be identical")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="root for case outputs (default $HFSDP_FUNCTIONAL_OUT or out/functional); never "
                             "a folder holding test cases")
    parser.add_argument("--platform", default=None,
                        help="hold the run to this platform's golden, e.g. dgx_h100 (default: this machine's GPU "
                             "kind and the tree's base; another kind's GPU field is then not compared)")
    parser.add_argument("--timeout-s", type=positive(float), default=None,
                        help="end a run after this long (stacks, then SIGTERM, then SIGKILL; hfsdp/proc.py)")
    parser.add_argument("--exit-duration-in-mins", type=positive(float), default=None,
                        help="forwarded to Megatron (SLURM jobs derive it from the time limit)")
    parser.add_argument("--evaluate-log", type=Path, default=None,
                        help="judge this existing log instead of launching (srun-per-GPU mode)")
    add_env_option(parser)

    failed_verdict = False  # printed for an interrupted case: run_cli's line says so

    def run() -> int:
        nonlocal failed_verdict
        ns = parser.parse_args(argv)  # inside run_cli: --help into a closed pipe ends quietly
        extra_env = parse_assignments(ns.env)
        stack_dump_after_s(job_env(os.environ, extra_env))  # junk in a variable we read: one sentence, up front
        if not ns.record:
            golden.iter_time_max_ratio()  # read when the run is judged, after the run: checked before it
        recipe = load_recipe(ns.case_dir)
        port = ns.master_port if ns.master_port is not None else env_port(os.environ)
        if port is None and ns.nnodes > 1:
            port = 29500  # every node must name the same port: torchrun's default
        placement = torchrun.Placement(nproc=ns.nproc or recipe.nproc, ranks_per_gpu=ns.ranks_per_gpu,
                                       nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
                                       master_port=port)
        launch = Launch(placement, timeout_s=ns.timeout_s, exit_duration_in_mins=ns.exit_duration_in_mins)
        try:
            result = run_case(ns.case_dir, launch=launch, record=ns.record, record_missing=ns.record_missing,
                              compare_to=ns.compare_to, output_root=ns.output_dir,
                              platform=ns.platform, evaluate_log=ns.evaluate_log, env=extra_env)
        except Interrupted as stop:
            # Ctrl-C, a time limit, scancel, or srun ending the step after another node failed:
            # run_group ended the run's processes (hfsdp/proc.py); the case FAILs, and a job's
            # summary reads this verdict line. run_cli then says so on stderr.
            print(f"  - {stop}: the run was ended (after SIGTERM its ranks' stacks are above, where they "
                  "caught the stack signal)")
            print(f"{RESULT_MARK} {recipe.model}/{recipe.name}: FAIL", flush=True)
            failed_verdict = True
            raise
        for reason in result.reasons:
            print(f"  - {reason}")
        print(f"{RESULT_MARK} {result.case}: {result.status}", flush=True)
        return EXIT_STATUS[result.status]

    return run_cli("run_case", run, lambda: "the run's processes were ended, and the case FAILed"
                   if failed_verdict else "no case was run")


if __name__ == "__main__":
    from hfsdp.environment import require_environment

    require_environment("run_case")
    sys.exit(main())
