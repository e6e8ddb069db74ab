"""Every command line tool of ours ends quietly when its output pipe closes, and on Ctrl-C
([Note: closed pipe and Ctrl-C] in hfsdp/usererror.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfsdp.usererror import CLOSED_PIPE_EXIT, INTERRUPTED_EXIT, run_cli

REPO_ROOT = Path(__file__).resolve().parents[3]
PY = sys.executable
CASE = "tests/functional_tests/test_cases/smoke/cpu_gloo_smoke"
_STEP = (" iteration {s:8d}/       8 | consumed samples: 4 | elapsed time per iteration (ms): 70.0 | "
         "lm loss: 1.000000E+01 | loss scale: 1.0 |\n")
_REPORT = '{"peak_allocated_bytes": 100, "peak_reserved_bytes": 200, "pool_bytes_measured": null}\n'


def kept_run(folder: Path) -> Path:
    """A --keep-logs folder with one finished no_db run (8 steps) for the benchmark's --from-logs."""
    folder.mkdir()
    (folder / "no_db-0.log").write_text("".join(_STEP.format(s=s) for s in range(1, 9)))
    (folder / "no_db-0.report.json").write_text(_REPORT)
    return folder


STDOUT_TOOLS = ("patchset", "memory planner", "benchmark", "functional.run_case", "slurm.submit",
                "slurm.launch_cmd")
STDERR_TOOLS = ("functional.batch", "slurm.summary", "hfsdp.launch")


def stdout_tools(tmp: Path) -> dict[str, list[str]]:
    """Each tool doing something that prints on stdout (no GPU, nothing launched); files under ``tmp``."""
    (tmp / "empty.log").write_text("")
    return {
        "patchset": ["sh", "scripts/patchset", "overlay"],
        "memory planner": [PY, "scripts/fsdp_memory_planner.py"],
        "benchmark": [PY, "scripts/benchmark_double_buffer.py", "--nproc", "1", "--configs", "no_db",
                      "--repeats", "1", "--warmup-steps", "5", "--timed-steps", "3", "--no-plan", "--no-chart",
                      "--from-logs", str(kept_run(tmp / "kept")), "--out-json", str(tmp / "r.json")],
        "functional.run_case": [PY, "-m", "hfsdp.functional.run_case", CASE, "--evaluate-log",
                                str(tmp / "empty.log"), "--output-dir", str(tmp / "out")],
        "slurm.submit": [PY, "-m", "hfsdp.slurm.submit", "--dry-run", "--log-dir", str(tmp / "jobs"), CASE],
        "slurm.launch_cmd": [PY, "-m", "hfsdp.slurm.launch_cmd", CASE],
    }


def stderr_tools(tmp: Path) -> dict[str, list[str]]:
    """Tools whose own output is on stderr: each refusing its input (a UserError)."""
    return {
        "functional.batch": [PY, "-m", "hfsdp.functional.batch", str(tmp / "no-case")],
        "slurm.summary": [PY, "-m", "hfsdp.slurm.summary", "--log-dir", str(tmp / "no-jobs")],
        "hfsdp.launch": [PY, "-m", "hfsdp.launch", "--nproc", "2", "--ranks-per-gpu", "auto", "--", "x.py"],
    }


def into_closed_pipe(cmd: list[str], stream: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` with ``stream`` a pipe whose reader is gone: like ``cmd | head -1``, but the reader
    leaves before the first byte, so every write meets the closed pipe (``head`` reading one line
    races with a short output, which may fit in the pipe before it leaves)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "HFSDP_DEBUG"}
    env.update(PYTHON=PY, CUDA_VISIBLE_DEVICES="")  # scripts/patchset: this interpreter; no GPU seen
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, stream: write_end}
    try:
        return subprocess.run(cmd, cwd=REPO_ROOT, text=True, env=env, timeout=300, **pipes)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("tool", STDOUT_TOOLS)
def test_a_closed_stdout_ends_the_tool_quietly(tool, tmp_path):
    tools = stdout_tools(tmp_path)
    assert sorted(tools) == sorted(STDOUT_TOOLS)
    done = into_closed_pipe(tools[tool], "stdout")
    err = done.stderr
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err[-3000:]
    assert done.returncode == CLOSED_PIPE_EXIT == 141, (done.returncode, err[-3000:])


@pytest.mark.parametrize("tool", STDERR_TOOLS)
def test_a_closed_stderr_ends_the_tool_quietly(tool, tmp_path):
    tools = stderr_tools(tmp_path)
    assert sorted(tools) == sorted(STDERR_TOOLS)
    done = into_closed_pipe(tools[tool], "stderr")
    assert done.returncode == CLOSED_PIPE_EXIT, (done.returncode, done.stdout[-3000:])


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    monkeypatch.delenv("HFSDP_DEBUG", raising=False)

    def interrupted() -> int:
        raise KeyboardInterrupt

    def run() -> int:
        try:
            return run_cli("tool", interrupted)
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C went through run_cli, to end in a traceback")

    assert run() == INTERRUPTED_EXIT == 130
    assert capsys.readouterr().err == "tool: interrupted\n"
    monkeypatch.setenv("HFSDP_DEBUG", "1")
    assert run() == 130
    err = capsys.readouterr().err
    assert "Traceback" in err and "in interrupted" in err and err.endswith("tool: interrupted\n")


@pytest.mark.parametrize("signum", [2, 15])  # SIGINT, SIGTERM
def test_a_signal_is_one_line_with_what_became_of_the_work(monkeypatch, capsys, signum):
    import signal

    monkeypatch.delenv("HFSDP_DEBUG", raising=False)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def signalled() -> int:
        os.kill(os.getpid(), signum)
        pytest.fail("the signal did not interrupt the tool")

    assert run_cli("tool", signalled, lambda: "nothing was written") == 128 + signum
    name = signal.Signals(signum).name
    assert capsys.readouterr().err == f"tool: interrupted by {name}; nothing was written\n"
    assert {sig: signal.getsignal(sig) for sig in before} == before  # the handlers are put back


def test_sigterm_to_a_launcher_ends_its_run(tmp_path, sigterm_once_started):
    """A launcher's run has a session of its own, which a SIGTERM to the launcher (a Slurm time
    limit, scancel, timeout) does not reach: under run_cli, run_group ends the run first."""
    import signal

    pidfile = tmp_path / "run.pid"
    launcher = (
        "import sys\n"
        "from hfsdp.proc import run_group\n"
        "from hfsdp.usererror import run_cli\n"
        f"child = [sys.executable, '-c', \"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
        "time.sleep(300)\"]\n"
        "sys.exit(run_cli('launcher', lambda: run_group(child, timeout_s=600).returncode,\n"
        "                 lambda: 'its run was ended'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HFSDP_DEBUG"}
    proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=REPO_ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child, (_, err), gone = sigterm_once_started(proc, pidfile, 60, 10)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "launcher: interrupted by SIGTERM; its run was ended", err
    assert gone, f"the run ({child}) outlived its launcher"
