"""Real-scheduler CI: a 4-node Slurm cluster on this one host runs our generated sbatch jobs.

Opt-in (installs packages, starts daemons): ``HFSDP_SLURM_CI=1``, as root, with apt-get. One
cluster (hfsdp/slurm/local_cluster.py): nodes n1..n4 on loopback, partitions ``four`` (n1-n4,
the default) and ``two`` (n1-n2). Every job runs the CPU gloo smoke case; all are submitted at
once and the scheduler places them (:data:`JOBS`, in submission order):

* two 2-node jobs at once, one per launcher (torchrun per node, srun per rank): both PASS, on
  separate nodes, with different master ports;
* a 4-node job per launcher: PASS; a 1-node job per launcher: PASS;
* the designed-to-fail case with the failing rank on the first node and on the last, with each
  launcher (``--env HFSDP_SMOKE_FAIL_RANK`` wins over the case's ENV_VARS): FAIL, non-zero exit
  (the torchrun ones on partition ``two``);
* a run that stalls past its time limit (``--time 2``): FAIL naming the time limit;
* a run whose last rank is SIGKILLed while it stalls: FAIL within the smoke's gloo timeout,
  naming the node the rank ran on.

After each job ends, no process of it may be left (its ``SLURM_JOB_ID`` in a process's
environment); at the end, only the daemons we started may be. A GPU job is refused in one
sentence (the cluster has no GRES). The daemons are always stopped, by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
CASES = REPO_ROOT / "tests" / "functional_tests" / "test_cases" / "smoke"
SMOKE, FAILING = CASES / "cpu_gloo_smoke", CASES / "cpu_gloo_smoke_rank_failure"
GLOO_TIMEOUT_S = 60  # the stalled ranks' collectives give up after this (HFSDP_SMOKE_GLOO_TIMEOUT_S)
DEADLINE_S = 540  # every job has ended by then
LEFTOVER_GRACE_S = 5.0  # a finished job's processes are gone by then


def _skip_reason() -> str | None:
    if os.environ.get("HFSDP_SLURM_CI") != "1":
        return "set HFSDP_SLURM_CI=1 to install slurm-wlm+munge and run a local Slurm cluster"
    if os.geteuid() != 0:
        return "the Slurm CI test must run as root (it starts slurmctld/slurmd/munged)"
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        return "neither apt-get nor an installed Slurm is available"
    return None


pytestmark = [pytest.mark.slurm, pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]


@dataclass
class Job:
    case: Path
    args: list[str]
    expect: str  # PASS / FAIL
    kill_last_rank: bool = False  # SIGKILL the last rank's process tree once every rank stalls
    # Filled in as it runs:
    job_id: int = 0
    log_dir: Path = Path()
    row: str = ""  # its line of `python -m hfsdp.slurm.summary`
    summary_rc: int = -1
    state: str = ""
    exit_code: str = ""
    node_list: str = ""
    ended_s: float = 0.0  # seconds after submission at which scontrol had it finished
    leftovers: list[str] = field(default_factory=list)  # its processes still alive after it ended
    killed: dict[str, str] = field(default_factory=dict)  # pid/node of the killed rank, when the kill ran
    output: str = ""


# name -> job, in submission order (the scheduler starts them first come, first served).
JOBS: dict[str, Job] = {
    "two_nodes_torchrun": Job(SMOKE, ["--nodes", "2"], "PASS"),
    "two_nodes_srun": Job(SMOKE, ["--nodes", "2", "--launcher", "srun"], "PASS"),
    "four_nodes_torchrun": Job(SMOKE, ["--nodes", "4"], "PASS"),
    "four_nodes_srun": Job(SMOKE, ["--nodes", "4", "--launcher", "srun"], "PASS"),
    "time_limit": Job(SMOKE, ["--nodes", "2", "--time", "2", "--exit-buffer-min", "1",
                              "--env", "HFSDP_SMOKE_STALL_S=600"], "FAIL"),
    "killed_rank": Job(SMOKE, ["--nodes", "2", "--env", "HFSDP_SMOKE_STALL_S=600",
                               "--env", f"HFSDP_SMOKE_GLOO_TIMEOUT_S={GLOO_TIMEOUT_S}"], "FAIL",
                       kill_last_rank=True),
    "fail_first_node_torchrun": Job(FAILING, ["--nodes", "2", "--partition", "two",
                                              "--env", "HFSDP_SMOKE_FAIL_RANK=0"], "FAIL"),
    "fail_last_node_torchrun": Job(FAILING, ["--nodes", "2", "--partition", "two",
                                             "--env", "HFSDP_SMOKE_FAIL_RANK=3"], "FAIL"),
    "fail_first_node_srun": Job(FAILING, ["--nodes", "2", "--launcher", "srun",
                                          "--env", "HFSDP_SMOKE_FAIL_RANK=0"], "FAIL"),
    "fail_last_node_srun": Job(FAILING, ["--nodes", "2", "--launcher", "srun",
                                         "--env", "HFSDP_SMOKE_FAIL_RANK=3"], "FAIL"),
    "one_node_torchrun": Job(SMOKE, [], "PASS"),
    "one_node_srun": Job(SMOKE, ["--launcher", "srun"], "PASS"),
}


def _environ(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _processes_of(job_id: int) -> dict[str, dict[str, str]]:
    """Live processes whose environment carries this job's SLURM_JOB_ID: pid -> environment."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        env = _environ(pid)
        if env.get("SLURM_JOB_ID") == str(job_id):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in "ZX":
                found[pid] = env
    return found


def _tree(pid: str) -> list[str]:
    """``pid`` and its descendants."""
    children: dict[str, list[str]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kill_last_rank(job: Job, world: int, started: float) -> None:
    """SIGKILL the process tree of the job's last rank (RANK = world - 1), once every rank stalls."""
    if job.killed or job.output.count(" stalls ") < world:
        return
    for pid, env in _processes_of(job.job_id).items():
        if env.get("RANK") == str(world - 1):
            job.killed = {"pid": pid, "node": env.get("SLURMD_NODENAME", "?"),
                          "at_s": f"{time.monotonic() - started:.1f}"}
            for p in _tree(pid):
                try:
                    os.kill(int(p), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    from hfsdp.slurm.local_cluster import LocalCluster, ensure_installed

    ensure_installed()
    with LocalCluster(tmp_path_factory.mktemp("slurm"), nodes=4, partitions={"four": 4, "two": 2}) as c:
        yield c
    assert not c.pids(), f"daemons still alive after stop: {c.pids()}"
    gone = time.monotonic() + 10  # slurmstepd and slurmscriptd end with their daemons
    while (left := _started_under(c)) and time.monotonic() < gone:
        time.sleep(0.2)
    assert not left, f"processes of the stopped cluster: {left}"


def _started_under(cluster) -> list[str]:
    """Live processes that carry this cluster's SLURM_CONF: its daemons' and its jobs'."""
    return [f"{p} {_cmdline(p)}" for p in filter(str.isdigit, os.listdir("/proc"))
            if _environ(p).get("SLURM_CONF") == str(cluster.conf) and _cmdline(p) != "?"]


def _env(cluster) -> dict[str, str]:
    return {**cluster.env, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def _cli(cluster, module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], env=_env(cluster), capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    """Submit every job of JOBS, kill where asked, wait for all to end, and note what each left."""
    from hfsdp.slurm.scontrol import show_job

    root = tmp_path_factory.mktemp("jobs")
    started = time.monotonic()
    for name, job in JOBS.items():
        job.log_dir = root / name
        proc = _cli(cluster, "hfsdp.slurm.submit", str(job.case), "--log-dir", str(job.log_dir), "--cpu",
                    "--gpus-per-node", "2", "--time", "10", "--exit-buffer-min", "2", *job.args)
        assert proc.returncode == 0, f"{name}: {proc.stderr}"
        job.job_id = int(proc.stdout.split("\t")[0])
    pending = dict(JOBS)
    while pending and time.monotonic() - started < DEADLINE_S:
        for name, job in list(pending.items()):
            info = show_job(job.job_id, env=cluster.env)
            out = Path(info.std_out) if info.std_out else None
            job.output = out.read_text(errors="replace") if out and out.is_file() else ""
            if job.kill_last_rank:
                _kill_last_rank(job, world=2 * 2, started=started)
            if not info.finished:
                continue
            job.ended_s = time.monotonic() - started
            job.state, job.exit_code, job.node_list = info.state, info.exit_code, info.node_list
            gone = time.monotonic() + LEFTOVER_GRACE_S
            while (left := _processes_of(job.job_id)) and time.monotonic() < gone:
                time.sleep(0.2)
            job.leftovers = [f"{pid} {_cmdline(pid)}" for pid in left]
            for pid in left:  # do not let them disturb the other jobs
                os.kill(int(pid), signal.SIGKILL)
            summary = _cli(cluster, "hfsdp.slurm.summary", "--log-dir", str(job.log_dir))
            job.row, job.summary_rc = summary.stdout.strip(), summary.returncode
            job.output = out.read_text(errors="replace") if out and out.is_file() else ""
            del pending[name]
        time.sleep(1.0)
    print(f"slurm CI: {len(JOBS)} jobs in {time.monotonic() - started:.0f} s")
    for name, job in JOBS.items():
        killed = f" (rank killed at {job.killed['at_s']} s on {job.killed['node']})" if job.killed else ""
        print(f"  {name:26s} ended at {job.ended_s:4.0f} s{killed}: {job.row}")
    if pending:
        for job in pending.values():
            subprocess.run(["scancel", str(job.job_id)], env=cluster.env, capture_output=True)
        pytest.fail(f"jobs still running after {DEADLINE_S} s: {sorted(pending)}\n{cluster.logs()}")
    return JOBS


def _context(job: Job, cluster) -> str:
    return (f"row: {job.row}\nstate={job.state} exit={job.exit_code} nodes={job.node_list} "
            f"leftovers={job.leftovers}\n--- output\n{job.output[-4000:]}")


def _check(job: Job, cluster) -> None:
    """The verdict, exit status and summary every job must agree on; no process left behind."""
    ctx = _context(job, cluster)
    assert not job.leftovers, ctx
    assert job.row.split()[0] == job.expect, ctx
    if job.expect == "PASS":
        assert (job.state, job.exit_code, job.summary_rc) == ("COMPLETED", "0:0", 0), ctx
    else:
        assert job.state in ("FAILED", "TIMEOUT") and job.exit_code != "0:0" and job.summary_rc == 1, ctx


@pytest.mark.parametrize("name", [n for n, j in JOBS.items() if j.expect == "PASS"])
def test_smoke_passes(jobs: dict[str, Job], cluster, name: str) -> None:
    job = jobs[name]
    _check(job, cluster)
    nodes = int(job.args[job.args.index("--nodes") + 1]) if "--nodes" in job.args else 1
    # Every node's driver (torchrun per node) or the one evaluation (srun per rank) said PASS.
    drivers = job.output.count("HFSDP-FUNCTIONAL RESULT smoke/cpu_gloo_smoke: PASS")
    assert drivers == (nodes if "srun" not in job.args else 1), _context(job, cluster)
    assert f" iteration        8/       8 | consumed samples: {8 * nodes * 2:12d} |" in job.output, \
        _context(job, cluster)  # the loss is logged by the last rank: nodes x 2 ranks x 1 sample
    # The master is the first node's NodeAddr, not its name (n1 does not resolve).
    assert "@127.0.0.1:" in job.output, _context(job, cluster)


def test_two_multi_node_jobs_at_once(jobs: dict[str, Job], cluster) -> None:
    """Both 2-node jobs ran at the same time, on separate nodes, with different master ports."""
    a, b = jobs["two_nodes_torchrun"], jobs["two_nodes_srun"]
    ports = [next(ln for ln in j.output.splitlines() if ln.startswith("hfsdp: case=")).split(":")[-1].split()[0]
             for j in (a, b)]
    assert ports[0] != ports[1], ports
    from hfsdp.slurm.scontrol import parse_show_job

    shown = [parse_show_job(subprocess.run(["scontrol", "show", "job", "-o", str(j.job_id)], env=cluster.env,
                                           capture_output=True, text=True).stdout) for j in (a, b)]
    assert shown[0]["NodeList"] != shown[1]["NodeList"], shown
    assert shown[0]["StartTime"] < shown[1]["EndTime"] and shown[1]["StartTime"] < shown[0]["EndTime"], shown


@pytest.mark.parametrize("name", [n for n in JOBS if n.startswith("fail_")])
def test_a_failing_rank_fails_the_job(jobs: dict[str, Job], cluster, name: str) -> None:
    job = jobs[name]
    _check(job, cluster)
    rank = job.args[job.args.index("--env") + 1].split("=")[1]
    # --env won over the case's ENV_VARS (HFSDP_SMOKE_FAIL_RANK: "1"): the named rank raised.
    assert f"designed failure on rank {rank}" in job.output, _context(job, cluster)
    assert "first failure: n" in job.row, _context(job, cluster)


def test_the_time_limit_stops_the_run_and_says_so(jobs: dict[str, Job], cluster) -> None:
    job = jobs["time_limit"]
    _check(job, cluster)
    assert "time limit" in job.row, _context(job, cluster)
    assert "HFSDP-SLURM STOPPED node=" in job.output and "stopped by SIGTERM" in job.output, _context(job, cluster)


def test_a_killed_rank_fails_the_job_and_the_summary_names_its_node(jobs: dict[str, Job], cluster) -> None:
    job = jobs["killed_rank"]
    assert job.killed, f"the ranks never all stalled, so nothing was killed\n{_context(job, cluster)}"
    _check(job, cluster)
    node = job.killed["node"]
    assert f"first failure: {node} " in job.row, f"killed a rank on {node}\n{_context(job, cluster)}"
    took = job.ended_s - float(job.killed["at_s"])
    assert took < GLOO_TIMEOUT_S, f"the job ended {took:.0f} s after the kill\n{_context(job, cluster)}"


def test_a_gpu_job_is_refused_in_one_sentence(cluster, tmp_path: Path) -> None:
    proc = _cli(cluster, "hfsdp.slurm.submit", str(SMOKE), "--log-dir", str(tmp_path / "gpu"), "--time", "5",
                "--exit-buffer-min", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "has no GPUs (GRES)" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "gpu" / "jobs.json").exists()


def test_nothing_of_the_jobs_is_left(jobs: dict[str, Job], cluster) -> None:
    """No process of any job once all ended: none with a job id of this cluster in its environment
    (the daemons, slurmstepd and slurmscriptd carry none; the cluster fixture checks they end)."""
    strays = [f"{p} {_cmdline(p)}" for p in filter(str.isdigit, os.listdir("/proc"))
              if (env := _environ(p)).get("SLURM_CONF") == str(cluster.conf) and "SLURM_JOB_ID" in env]
    assert not strays, strays
