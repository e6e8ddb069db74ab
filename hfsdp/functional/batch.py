"""Run many functional cases, each through :mod:`hfsdp.functional.run_case`, and summarize them.

    python -m hfsdp.functional.batch CASE_DIR ... [--record-missing] [--platform dgx_h100]
        [--record] [--ranks-per-gpu N] [--nproc N] [--jobs N] [--timeout-s T] [--output-dir DIR]
        [--summary FILE] [--env KEY=VALUE]

Each case is one ``run_case`` process with its log beside the case's outputs. A case's
``COMPARE_TO`` twin runs before it (added to the batch when it is not named), so no two cases
ever run one twin at once. ``--jobs N`` runs up to N cases at a time, after a first case alone,
which fills the kernel caches. With one rank per GPU each case then gets GPUs of its own
(:class:`GpuSlots`): a 4-GPU machine runs two 2-GPU cases, or four 1-GPU cases, side by side.
Neighbours share only the host, so step times are still judged, within the goldens' tolerance.
With several ranks per GPU cases share the GPUs, and no step time is judged ([Note: goldens of
the several-ranks-per-GPU mode] in golden.py).

Goldens: each ``run_case`` probes its run's environment and picks the golden recorded in an
equal one ([Note: choosing a golden] in selection.py); ``--record-missing`` records the goldens a
case lacks for this environment (under ``<platform>_shared`` in the shared mode). Exit status 0
only when every case passed or was refused by a need its recipe declares (``ENVIRONMENT``); the
summary counts each verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hfsdp.diagnostics import stack_dump_after_s
from hfsdp.functional import golden, outdir
from hfsdp.functional.recipe import Recipe, load_recipe
from hfsdp.functional.run_case import (
    EXIT_STATUS,
    GOLDEN_MARK,
    PASS,
    REFUSED,
    RESULT_MARK,
    output_dir_for,
    trains_on_gpus,
)
from hfsdp.launch import fit, torchrun
from hfsdp.launch.env import add_env_option, job_env, parse_assignments
from hfsdp.usererror import Interrupted, UserError, output_file, positive, run_cli

STOP_GRACE_S = 60.0  # an interrupted case's time to end its run (run_case: stacks, SIGTERM, SIGKILL)


@dataclass(frozen=True)
class Outcome:
    case: str
    returncode: int
    seconds: float
    result: str  # the driver's result line, or why there is none
    golden: str  # the golden file held to or recorded, as run_case named it ('' when it named none)
    recorded: bool

    def line(self) -> str:
        mode = " (recorded)" if self.recorded else ""
        held = f" golden {self.golden}{mode}" if self.golden else ""
        return f"rc={self.returncode} {self.seconds:.0f}s {self.result} [{self.case}]{held}"

    @property
    def verdict(self) -> str:
        """The verdict of the result line (``PASS``, ``FAIL``, ...), ``not run`` without one."""
        head, sep, verdict = self.result.rpartition(": ")
        return verdict if sep and head.startswith(RESULT_MARK) else "not run"


def ordered(cases: Sequence[Path]) -> list[list[Recipe]]:
    """Waves by depth: first the cases without ``COMPARE_TO`` (every twin among them, added when
    not named), then the cases whose twin is in the first wave, and so on: a twin always runs in
    an earlier wave than the cases compared with it. A cycle of twins is refused."""
    recipes = {r.case_dir.resolve(): r for r in (load_recipe(c) for c in cases)}
    pending = list(recipes.values())
    while pending:
        recipe = pending.pop()
        if recipe.compare_to:
            twin = (recipe.case_dir / recipe.compare_to).resolve()
            if twin not in recipes:
                recipes[twin] = load_recipe(twin)
                pending.append(recipes[twin])
    depth: dict[Path, int] = {}

    def depth_of(key: Path, chain: tuple[Path, ...] = ()) -> int:
        if key in chain:
            names = " -> ".join(f"{p.parent.name}/{p.name}" for p in (*chain, key))
            raise UserError(f"COMPARE_TO forms a cycle: {names}",
                            "compare each case with a twin that compares with none of them")
        if key not in depth:
            recipe = recipes[key]
            twin = (recipe.case_dir / recipe.compare_to).resolve() if recipe.compare_to else None
            depth[key] = 0 if twin is None else depth_of(twin, (*chain, key)) + 1
        return depth[key]

    for key in recipes:
        depth_of(key)
    return [[r for k, r in recipes.items() if depth[k] == d] for d in range(max(depth.values(), default=-1) + 1)]


class Running:
    """The ``run_case`` processes of a batch, so that an interrupt ends them and starts no more
    ([Note: interrupts] in hfsdp/usererror.py)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.procs: set[subprocess.Popen] = set()
        self.stopped = False

    def start(self, cmd: list[str], sink: IO) -> subprocess.Popen | None:
        with self.lock:
            if self.stopped:
                return None
            child = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
            self.procs.add(child)
            return child

    def finished(self, child: subprocess.Popen) -> None:
        with self.lock:
            self.procs.discard(child)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """End every running case (SIGTERM: each ends its own run), wait ``grace_s``, then kill; returns how many."""
        with self.lock:
            self.stopped = True
            procs = list(self.procs)
        for child in procs:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in procs:
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        return len(procs)


class GpuSlots:
    """This host's GPUs, handed out whole to cases that run side by side with one rank per GPU: a
    case waits until as many are free as it has ranks, and its ranks see only those
    (``CUDA_VISIBLE_DEVICES``)."""

    def __init__(self, gpus: Sequence[str]) -> None:
        self.free = list(gpus)
        self.size = len(self.free)
        self.changed = threading.Condition()

    @classmethod
    def of_host(cls, environ: Mapping[str, str]) -> GpuSlots:
        """The GPUs the caller's ``CUDA_VISIBLE_DEVICES`` names, else every GPU torch sees."""
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return cls([g.strip() for g in visible.split(",") if g.strip()])
        return cls([str(i) for i in range(len(fit.gpu_memory()))])

    def check(self, rank_counts: Sequence[int]) -> None:
        """Refuse, before any case runs, a case with more ranks than there are GPUs to hand out."""
        if rank_counts and max(rank_counts) > self.size:
            raise UserError(f"a case of {max(rank_counts)} ranks needs as many GPUs of its own and {self.size} "
                            f"{'is' if self.size == 1 else 'are'} visible here",
                            "run it on a larger machine, or give --jobs 1 (torchrun then reports it)")

    @contextlib.contextmanager
    def take(self, count: int) -> Iterator[str]:
        """``count`` free GPUs as a ``CUDA_VISIBLE_DEVICES`` value, given back on exit (:meth:`check`
        has made sure there are that many)."""
        with self.changed:
            self.changed.wait_for(lambda: len(self.free) >= count)
            taken, self.free = self.free[:count], self.free[count:]
        try:
            yield ",".join(taken)
        finally:
            with self.changed:
                self.free.extend(taken)
                self.changed.notify_all()


def run_one(recipe: Recipe, ns: argparse.Namespace, shared: bool, running: Running | None = None,
            slots: GpuSlots | None = None) -> Outcome:
    """One case through run_case; with ``slots``, a case that trains on GPUs gets its own."""
    if slots is None or not trains_on_gpus(recipe):
        return run_case(recipe, ns, shared, running or Running(), [])
    with slots.take(ns.nproc or recipe.nproc) as gpus:
        return run_case(recipe, ns, shared, running or Running(), [f"CUDA_VISIBLE_DEVICES={gpus}"])


def run_case(recipe: Recipe, ns: argparse.Namespace, shared: bool, running: Running, env: list[str]) -> Outcome:
    record = {"all": ["--record"], "missing": ["--record-missing"]}.get(ns.record or "", [])
    out = output_dir_for(recipe, ns.output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{recipe.name}.driver.log"
    cmd = [sys.executable, "-m", "hfsdp.functional.run_case", str(recipe.case_dir),
           *(["--platform", ns.platform] if ns.platform else []),
           "--ranks-per-gpu", str(ns.ranks_per_gpu), *record,
           *(["--nproc", str(ns.nproc)] if ns.nproc else []),
           *(["--timeout-s", f"{ns.timeout_s:g}"] if ns.timeout_s else []),
           *(["--output-dir", str(ns.output_dir)] if ns.output_dir else []),
           *[f"--env={item}" for item in [*ns.env, *env]]]
    start = time.monotonic()
    with open(log, "w") as sink:
        child = running.start(cmd, sink)
        if child is None:
            return Outcome(f"{recipe.model}/{recipe.name}", -1, 0.0, "not run: the batch was interrupted", "", False)
        try:
            rc = child.wait()
        finally:
            running.finished(child)
    text = log.read_text(errors="replace").splitlines()
    lines = [ln for ln in text if ln.startswith(RESULT_MARK)]
    refused = [ln.removeprefix("run_case: error: ") for ln in text if ln.startswith("run_case: error: ")]
    result = lines[-1] if lines else f"refused: {refused[-1]} (see {log})" if refused else f"no result line (see {log})"
    named = [ln.removeprefix(GOLDEN_MARK).split()[0] for ln in text if ln.startswith(GOLDEN_MARK + " ")]
    recorded = any(ln.startswith("recorded ") for ln in text)
    return Outcome(f"{recipe.model}/{recipe.name}", rc, time.monotonic() - start, result,
                   named[0] if named else "", recorded)


def check_gpus(recipes: Sequence[Recipe], ns: argparse.Namespace) -> None:
    """Refuse, before any case runs, a batch whose ranks would find no GPU (the shared mode's, or
    those of its GPU cases): each case would be refused on its own, one after another."""
    from hfsdp.functional.run_case import check_gpus_for, run_env

    if ns.ranks_per_gpu > 1:
        torchrun.check_gpus(torchrun.Placement(nproc=ns.ranks_per_gpu, ranks_per_gpu=ns.ranks_per_gpu),
                            len(fit.gpu_memory()))
    extra = parse_assignments(ns.env)
    seen: dict[str | None, bool] = {}  # CUDA_VISIBLE_DEVICES of the ranks -> whether they see a GPU
    blocked: list[str] = []
    for recipe in (r for r in recipes if trains_on_gpus(r)):
        env = run_env(recipe.env_vars, extra)
        key = env.get("CUDA_VISIBLE_DEVICES")
        if key not in seen:
            try:
                check_gpus_for(recipe, env)
                seen[key] = True
            except UserError:
                seen[key] = False
        if not seen[key]:
            blocked.append(f"{recipe.model}/{recipe.name}")
    if blocked:
        shown = ", ".join(blocked[:4]) + (f" and {len(blocked) - 4} more" if len(blocked) > 4 else "")
        raise UserError(f"{len(blocked)} of the cases train on CUDA GPUs and their ranks would see none here "
                        f"({shown})", "run them on a machine with NVIDIA GPUs, or leave them out (the CPU smoke "
                        "cases need none)")


def count_line(outcomes: Sequence[Outcome]) -> str:
    """``N of M cases passed`` and how many got each other verdict (``2 REFUSED, 1 FAIL``)."""
    passed = sum(o.verdict == PASS for o in outcomes)
    others: dict[str, int] = {}
    for o in outcomes:
        if o.verdict != PASS:
            others[o.verdict] = others.get(o.verdict, 0) + 1
    tail = "".join(f", {n} {verdict}" for verdict, n in sorted(others.items()))
    return f"{passed} of {len(outcomes)} cases passed{tail}"


def check_summary(path: Path) -> None:
    """Refuse a ``--summary`` that cannot be written, before any case runs (not after all of them)."""
    output_file("--summary", path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hfsdp.functional.batch", description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="+", type=Path)
    record = parser.add_mutually_exclusive_group()
    record.add_argument("--record", dest="record", action="store_const", const="all",
                        help="record every case's golden (for this platform, and mode)")
    record.add_argument("--record-missing", dest="record", action="store_const", const="missing",
                        help="record the goldens of cases that have none to be held to (see the module note)")
    parser.add_argument("--platform", default=None,
                        help="hold every case to this platform's goldens, e.g. dgx_h100 (default: each run's own, "
                             "as run_case)")
    parser.add_argument("--nproc", type=positive(int), default=None,
                        help="ranks per case (default: each case's NPROC; another count compares no golden)")
    torchrun.add_ranks_per_gpu_option(parser)
    parser.add_argument("--jobs", type=positive(int), default=1,
                        help="cases at a time; with one rank per GPU each case gets GPUs of its own")
    parser.add_argument("--timeout-s", type=positive(float), default=None, help="per run (run_case --timeout-s)")
    parser.add_argument("--output-dir", type=Path, default=None, help="as run_case --output-dir")
    parser.add_argument("--summary", type=Path, default=None, help="also write the summary lines here")
    add_env_option(parser)

    running = Running()
    outcomes: list[Outcome] = []

    def run() -> int:
        ns = parser.parse_args(argv)  # inside run_cli: --help into a closed pipe ends quietly
        parse_assignments(ns.env)  # refuse a malformed --env before anything runs
        stack_dump_after_s(job_env(os.environ, parse_assignments(ns.env)))  # and junk in a variable we read
        if not ns.record:
            golden.iter_time_max_ratio()
        shared = ns.ranks_per_gpu > 1
        slots = None
        if ns.jobs > 1 and not shared:
            if "CUDA_VISIBLE_DEVICES" in parse_assignments(ns.env):
                raise UserError(f"--jobs {ns.jobs} gives each case GPUs of its own, and --env CUDA_VISIBLE_DEVICES "
                                "would give every case the same ones",
                                "set CUDA_VISIBLE_DEVICES for the batch (it picks among those GPUs), or give --jobs 1")
            slots = GpuSlots.of_host(os.environ)
        if ns.output_dir is not None:
            outdir.check_root(ns.output_dir)
        if ns.summary is not None:
            check_summary(ns.summary)
        waves = ordered(ns.cases)
        check_gpus([r for wave in waves for r in wave], ns)
        if slots is not None:
            slots.check([ns.nproc or r.nproc for wave in waves for r in wave if trains_on_gpus(r)])
        if ns.jobs > 1 and len(waves[0]) > 1:
            # The first case runs alone: it fills the Triton and compile caches that the cases
            # after it read, instead of every rank of every case compiling the same kernels at once.
            waves = [waves[0][:1], waves[0][1:], *waves[1:]]
        for wave in waves:
            with ThreadPoolExecutor(max_workers=ns.jobs) as pool:
                try:
                    for outcome in pool.map(lambda r: run_one(r, ns, shared, running, slots), wave):
                        print(outcome.line(), flush=True)
                        outcomes.append(outcome)
                except Interrupted:
                    running.stop()  # before the pool's exit waits for its threads
                    pool.shutdown(cancel_futures=True)
                    raise
        failed = [o for o in outcomes if o.returncode not in (EXIT_STATUS[PASS], EXIT_STATUS[REFUSED])]
        summary = [o.line() for o in outcomes] + [count_line(outcomes)]
        print(summary[-1])
        if ns.summary is not None:
            ns.summary.parent.mkdir(parents=True, exist_ok=True)
            ns.summary.write_text("\n".join(summary) + "\n")
        return 1 if failed else 0

    def after() -> str:
        return (f"the running cases were ended (each one's log is beside its outputs) and no further case started; "
                f"{len(outcomes)} case{'' if len(outcomes) == 1 else 's'} had finished")

    return run_cli("functional.batch", run, after)


if __name__ == "__main__":
    from hfsdp.environment import require_environment

    require_environment("python -m hfsdp.functional.batch")
    sys.exit(main())
