"""A timing run's files after it ends: read a finished run, keep it, read kept runs back.

``--keep-logs DIR`` copies each run's Megatron log and run report into DIR (:func:`keep_run`);
``--from-logs DIR`` summarizes such a folder without launching anything
(:func:`runs_from_logs`), for an invocation that stopped early. Both read a run the one way
:func:`read_run` does, so a kept run counts exactly when it counted as it ran.

[Note: resumed invocations] One command may not outlast a time limit that an invocation of many
repeats exceeds. ``--keep-logs DIR --resume`` goes on with such an invocation: the runs DIR holds
that count are taken as they are (:func:`kept_runs`) and only the others are launched, in the same
interleaved order. Ratios are only meaningful between runs of one machine, so DIR records the
machine its runs came from (``machine.json``: host name and GPU UUIDs, :func:`machine_identity`)
and a launch into DIR from another machine is refused before anything runs (:func:`claim_machine`).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import socket
import subprocess
from collections.abc import Sequence
from typing import Any

from hfsdp.atomic import loads_strict, write_json_atomic
from hfsdp.bench import bases, pretrain_launch
from hfsdp.bench import configs as cfgs
from hfsdp.bench import results as res
from hfsdp.usererror import UserError, not_a_regular_file

MACHINE_FILE = "machine.json"


def read_run(config: cfgs.BenchConfig, repeat: int, stem: str, flags: Sequence[str],
             opts: argparse.Namespace) -> res.RunResult:
    """A finished timing run from ``<stem>.log`` and ``<stem>.report.json``; raises
    ``pretrain_launch.RunFailed`` when they lack a timed step or, for a graphed configuration,
    the capture."""
    run = pretrain_launch.result(config.name, repeat, f"{stem}.log", f"{stem}.report.json",
                                 warmup_steps=opts.warmup_steps, timed_steps=opts.timed_steps,
                                 nproc=opts.nproc, flags=[*flags, *config.flags])
    if config.graphed and not run.cuda_graph_captured:
        raise pretrain_launch.RunFailed("no full-iteration CUDA graph was captured")
    return run


def keep_run(stem: str, folder: str, failed: str | None) -> None:
    """Copy a run's log and report into ``folder``; a failed run also gets
    ``<config>-<repeat>.failed`` with the reason, a run that counts loses a stale one."""
    os.makedirs(folder, exist_ok=True)
    for path in glob.glob(f"{stem}.log") + glob.glob(f"{stem}.report.json*"):
        shutil.copy(path, folder)
    marker = os.path.join(folder, os.path.basename(stem) + ".failed")
    if failed is not None:
        with open(marker, "w") as f:
            f.write(failed + "\n")
    elif os.path.exists(marker):
        os.remove(marker)  # our own marker from an earlier run of this name into this folder


def machine_identity() -> dict[str, Any]:
    """This machine as a kept folder records it: host name and the GPUs' UUIDs (nvidia-smi's; none
    where it is absent)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        gpus = sorted(line.strip() for line in out.stdout.splitlines() if line.strip()) if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        gpus = []
    return {"host": socket.gethostname(), "gpus": gpus}


def claim_machine(folder: str, here: dict[str, Any] | None = None) -> None:
    """Record this machine in ``folder`` (a --keep-logs folder), or refuse when it holds runs of
    another one ([Note: resumed invocations])."""
    here = machine_identity() if here is None else here
    path = os.path.join(folder, MACHINE_FILE)
    if os.path.lexists(path):
        if why := not_a_regular_file(path):
            raise UserError(f"--keep-logs {folder}: {MACHINE_FILE} {why}", "give a new --keep-logs folder")
        try:
            with open(path, encoding="utf-8") as f:
                there = loads_strict(f.read())
        except (OSError, ValueError) as exc:
            raise UserError(f"--keep-logs {folder}: {MACHINE_FILE} is unreadable ({exc})",
                            "give a new --keep-logs folder") from None
        if there != here:
            raise UserError(f"--keep-logs {folder} holds runs of another machine ({there.get('host')!r}, "
                            f"{len(there.get('gpus', []))} GPU(s)), not of this one ({here['host']!r}); "
                            "step times of two machines do not compare",
                            "give a new --keep-logs folder, or summarize that one with --from-logs")
        return
    if glob.glob(os.path.join(glob.escape(folder), "*.log")):
        raise UserError(f"--keep-logs {folder} holds runs whose machine is not recorded ({MACHINE_FILE} is missing)",
                        "give a new --keep-logs folder, or summarize that one with --from-logs")
    os.makedirs(folder, exist_ok=True)
    write_json_atomic(path, here)


def kept_runs(folder: str, order: Sequence[tuple[int, str]], flags: Sequence[str],
              opts: argparse.Namespace) -> dict[tuple[int, str], res.RunResult]:
    """The runs of ``order`` that ``folder`` holds and that count, by (repeat, configuration); a
    missing folder holds none (--resume of an invocation that has not started)."""
    if not os.path.isdir(folder):
        return {}
    found, _ = _read_kept(folder, order, flags, opts)
    return found


def _read_kept(folder: str, order: Sequence[tuple[int, str]], flags: Sequence[str],
               opts: argparse.Namespace) -> tuple[dict[tuple[int, str], res.RunResult], dict[str, str]]:
    found: dict[tuple[int, str], res.RunResult] = {}
    failures: dict[str, str] = {}
    refused = kept_upstream_failures(folder, order)
    for repeat, name in order:
        stem = os.path.join(folder, f"{name}-{repeat}")
        if name in refused and not os.path.exists(f"{stem}.log"):
            failures[f"{name}#{repeat}"] = f"not repeated: {refused[name]}"
            continue
        if not os.path.exists(f"{stem}.log"):
            failures[f"{name}#{repeat}"] = f"not in {folder}"
            continue
        if os.path.exists(f"{stem}.failed"):
            failures[f"{name}#{repeat}"] = f"failed when it ran: {failed_reason(f'{stem}.failed')}"
            continue
        try:
            found[repeat, name] = read_run(bases.config(name), repeat, stem, flags, opts)
        except pretrain_launch.RunFailed as exc:
            failures[f"{name}#{repeat}"] = str(exc)
    return found, failures


def kept_upstream_failures(folder: str | None, order: Sequence[tuple[int, str]]) -> dict[str, str]:
    """An upstream release's rows that ``folder`` holds a failed repeat of, with the reason: a
    resumed invocation does not launch them again (a release fails a configuration it lacks the
    same way every time; the fork's failed runs are always retried)."""
    out: dict[str, str] = {}
    if folder is None or not os.path.isdir(folder):
        return out
    for repeat, name in order:
        marker = os.path.join(folder, f"{name}-{repeat}.failed")
        if bases.split(name)[0] != bases.FORK and name not in out and os.path.exists(marker):
            out[name] = failed_reason(marker)
    return out


def runs_from_logs(folder: str, order: Sequence[tuple[int, str]], flags: Sequence[str],
                   opts: argparse.Namespace) -> tuple[list[res.RunResult], dict[str, str]]:
    """The runs of ``order`` that ``folder`` (a ``--keep-logs`` folder) holds, each read by
    :func:`read_run` as when it ran; the others, and those :func:`keep_run` marked failed
    (``<config>-<repeat>.failed``), are returned as failures."""
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "no such folder"
        raise UserError(f"--from-logs {folder}: {what}",
                        "give the folder an earlier invocation's --keep-logs wrote")
    if not order:
        raise UserError(f"--from-logs {folder}: no run asked for", "name the configurations with --configs")
    found, failures = _read_kept(folder, order, flags, opts)
    runs = list(found.values())
    print(f"{len(runs)} of {len(order)} runs read from {folder}"
          + (f"; missing or unusable: {len(failures)}" if failures else ""))
    for key, why in failures.items():
        print(f"  {key}: {why}")
    if not runs:
        first, why = next(iter(failures.items()))
        more = f"; {len(failures) - 1} more listed above" if len(failures) > 1 else ""
        raise UserError(f"--from-logs {folder}: no usable run among the {len(order)} asked for "
                        f"({first}: {why}{more})",
                        "check --configs, --repeats and the step counts against the invocation "
                        "that wrote the folder")
    return runs, failures


def failed_reason(marker: str) -> str:
    """What a ``<config>-<repeat>.failed`` marker says (:func:`keep_run`)."""
    if why := not_a_regular_file(marker):
        return f"no reason recorded ({marker} {why})"
    try:
        with open(marker, errors="replace") as f:
            return f.read().strip() or "no reason recorded"
    except OSError as exc:
        return f"no reason recorded ({marker}: {exc.strerror or exc})"
