"""A throw-away Slurm cluster of one or more nodes on this one host, for CI: our generated sbatch
jobs run under a real scheduler (tests/unit_tests/slurm/test_slurm_cluster.py, opt-in with
``HFSDP_SLURM_CI=1``).

It runs where a CI job runs: as root in a container, with no systemd and no cgroup control.
Debian's ``slurm-wlm`` + ``munge`` (installed with apt when missing); config, state and logs in a
temp directory; ``munged`` started by hand (as the ``munge`` user) when ``munge -n | unmunge``
does not already work, with a fresh key if none is there; ``slurmctld`` and one ``slurmd`` per
node started with ``-f <conf>`` as root (``slurmd -N n<k>``: several slurmd daemons share one
host, one per node name) and stopped by their pid files. Nodes are ``n1`` .. ``n<N>``: each has
its own ``Port=``, all share ``NodeHostname=<this host>`` and ``NodeAddr=127.0.0.1``, and each
advertises this machine's CPUs, so the nodes' jobs share the real cores. A node name does not
resolve as a host, so a job must take a node's address from Slurm (``scontrol show node``), as
the sbatch scripts do. Spool, pid and log paths carry ``%n`` (the node name). The configuration
asks for nothing a container lacks: processes tracked by ``proctrack/linuxproc`` (no cgroups), no
task plugin, no GPUs (no ``Gres``), free ports picked at start. Accounting is off, so results come
from ``scontrol`` and job output files.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from hfsdp.launch.torchrun import free_port

MUNGE_KEY = Path("/etc/munge/munge.key")


# Slurm's and munge's daemons and runuser live in sbin, which a non-login PATH may lack.
SBIN_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def with_sbin(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the sbin folders appended to its PATH (those it lacks)."""
    path = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p]
    return {**env, "PATH": os.pathsep.join([*path, *(d for d in SBIN_DIRS if d not in path)])}


def _run(cmd: list[str], env: Mapping[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=with_sbin(os.environ if env is None else env),
                          **kw)


def ensure_installed(timeout_s: float = 400) -> None:
    """apt-get install slurm-wlm and munge unless their daemons are already on PATH."""
    search = with_sbin(os.environ)["PATH"]
    if all(shutil.which(b, path=search) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    env = with_sbin({**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports nobody listens on, below the kernel's ephemeral range, where other processes' outgoing
    connections cannot take them before the daemons bind ([Note: the master's port] in hfsdp/launch/torchrun.py)."""
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def _kill_pidfile(path: Path) -> None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class LocalCluster:
    """Context manager: ``with LocalCluster(tmp, nodes=4) as c: subprocess.run([...], env=c.env)``.

    ``partitions`` maps a partition's name to its node count (its nodes are the first ones);
    the first partition is the default. Default: one partition ``ci`` of all nodes.
    """

    def __init__(self, workdir: Path, nodes: int = 1, partitions: Mapping[str, int] | None = None) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, not {nodes}")
        self.workdir = Path(workdir)
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [f"n{k}" for k in range(1, nodes + 1)]
        self.partitions = dict(partitions or {"ci": nodes})
        if bad := {p: n for p, n in self.partitions.items() if not 1 <= n <= nodes}:
            raise ValueError(f"partitions {bad} need 1 to {nodes} nodes")
        self.conf = self.workdir / "slurm.conf"
        self._started_munged = False
        self.env = with_sbin({**os.environ, "SLURM_CONF": str(self.conf)})

    # Lifecycle #

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._start_munge()
        for sub in ("state", *(f"spool/{n}" for n in self.nodes)):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._slurm_conf())
        for cmd in (["slurmctld"], *(["slurmd", "-N", n] for n in self.nodes)):
            proc = _run([*cmd, "-f", str(self.conf)], env=self.env)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed to start: {proc.stderr}\n{self.logs()}")
        self.wait_idle()

    def pids(self) -> dict[str, int]:
        """The daemons we started that are still alive, by name: slurmctld, slurmd-n1, ..."""
        found = {}
        for name in ("slurmctld", *(f"slurmd-{n}" for n in self.nodes)):
            try:
                pid = int((self.workdir / f"{name}.pid").read_text().strip())
                os.kill(pid, 0)
            except (OSError, ValueError):
                continue
            found[name] = pid
        return found

    def stop(self) -> None:
        """Stop what we started, by pid file; safe to call twice."""
        for node in self.nodes:
            _kill_pidfile(self.workdir / f"slurmd-{node}.pid")
        _kill_pidfile(self.workdir / "slurmctld.pid")
        if self._started_munged:
            _kill_pidfile(Path("/run/munge/munged.pid"))
            self._started_munged = False

    # Helpers #

    def _start_munge(self) -> None:
        if not MUNGE_KEY.is_file() or MUNGE_KEY.stat().st_size < 1024:
            MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
            MUNGE_KEY.write_bytes(os.urandom(1024))
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.chmod(0o400)
        if self._munge_works():
            return
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        proc = _run(["runuser", "-u", "munge", "--", "munged"])
        if proc.returncode != 0:
            proc = _run(["munged", "--force"])
        self._started_munged = proc.returncode == 0
        for _ in range(50):
            if self._munge_works():
                return
            time.sleep(0.1)
        raise RuntimeError(f"munged is not working: {proc.stderr}")

    @staticmethod
    def _munge_works() -> bool:
        return subprocess.run("munge -n | unmunge", shell=True, capture_output=True,
                              env=with_sbin(os.environ)).returncode == 0

    def _slurm_conf(self) -> str:
        w = self.workdir
        ports = _free_ports(1 + len(self.nodes))  # slurmctld's, then each slurmd's
        return "\n".join([
            "ClusterName=hfsdpci",
            f"SlurmctldHost={self.host}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "MinJobAge=3600",
            f"SlurmctldPort={ports[0]}",
            f"StateSaveLocation={w / 'state'}",
            f"SlurmdSpoolDir={w / 'spool'}/%n",
            f"SlurmctldPidFile={w / 'slurmctld.pid'}",
            f"SlurmdPidFile={w / 'slurmd'}-%n.pid",
            f"SlurmctldLogFile={w / 'slurmctld.log'}",
            f"SlurmdLogFile={w / 'slurmd'}-%n.log",
            *(f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
              f"CPUs={os.cpu_count() or 1} State=UNKNOWN" for n, port in zip(self.nodes, ports[1:], strict=True)),
            *(f"PartitionName={name} Nodes={','.join(self.nodes[:count])} Default={'YES' if k == 0 else 'NO'} "
              "MaxTime=INFINITE State=UP" for k, (name, count) in enumerate(self.partitions.items())),
            "",
        ])

    def wait_idle(self, timeout_s: float = 60) -> None:
        """Wait until every node is idle."""
        deadline = time.monotonic() + timeout_s
        states: list[str] = []
        while time.monotonic() < deadline:
            proc = _run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env)
            states = sorted(set(proc.stdout.split("\n"))) if proc.returncode == 0 else []
            idle = {line.split()[0] for line in states if line.strip().endswith(" idle")}
            if idle >= set(self.nodes):
                return
            time.sleep(0.5)
        raise RuntimeError(f"nodes never became idle: {states}\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", *(f"slurmd-{n}.log" for n in self.nodes)):
            path = self.workdir / name
            if path.is_file():
                parts.append(f"--- {name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)
