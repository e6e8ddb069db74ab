"""Ctrl-C or SIGTERM of the functional driver ends its runs, then one sentence ([Note: interrupts]
in hfsdp/usererror.py). Each test starts a real torchrun of a trainer that
logs one step and sleeps, interrupts the driver alone, and checks that the trainer is gone too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SLEEPER = '''\
import os, time
from pathlib import Path
Path(os.environ["SLEEPER_PIDS"]).joinpath(str(os.getpid())).touch()
print(" iteration        1/       4 | consumed samples: 8 | elapsed time per iteration (ms): 50.0 | "
      "lm loss: 9.750000E+00 |", flush=True)
time.sleep(300)
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


def _interrupt(tmp_path: Path, module: str, signum: int) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Start ``module`` on a sleeping case, send ``signum`` to it alone once the trainer runs."""
    case = tmp_path / "cases" / "gpt" / "sleepy"
    case.mkdir(parents=True)
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (case / "model_config.yaml").write_text(
        f"TRAINING_SCRIPT: {tmp_path / 'sleeper.py'}\nNPROC: 1\nREQUIRE_GOLDEN: false\nMETRICS: [lm loss]\n"
        "MODEL_ARGS: {--train-iters: 4}\n")
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "HFSDP_DEBUG"}, "SLEEPER_PIDS": str(pids)}
    driver = subprocess.Popen([sys.executable, "-m", module, str(case), "--output-dir", str(tmp_path / "out")],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not any(pids.iterdir()) and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any(pids.iterdir()), "the trainer never started"
    driver.send_signal(signum)
    out, err = driver.communicate(timeout=120)
    return subprocess.CompletedProcess(driver.args, driver.returncode, out, err), [int(p.name) for p in pids.iterdir()]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_run_case_ends_its_run_and_says_so(tmp_path, signum):
    proc, trainers = _interrupt(tmp_path, "hfsdp.functional.run_case", signum)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"run_case: interrupted by {name}; the run's processes were ended, and the case FAILed")
    assert f"stopped by {name}: the run was ended" in proc.stdout  # the verdict a job's summary reads
    assert proc.stdout.strip().splitlines()[-1].endswith(": FAIL"), proc.stdout[-3000:]
    assert "Traceback" not in proc.stderr
    assert trainers and not any(_alive(pid) for pid in trainers)


def test_batch_ends_its_cases_and_says_so(tmp_path):
    proc, trainers = _interrupt(tmp_path, "hfsdp.functional.batch", signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "functional.batch: interrupted by SIGTERM; the running cases were ended")
    assert "0 cases had finished" in proc.stderr and "Traceback" not in proc.stderr
    assert trainers and not any(_alive(pid) for pid in trainers)
    log = (tmp_path / "out" / "gpt" / "sleepy.driver.log").read_text()
    assert "run_case: interrupted by SIGTERM" in log  # the case ended its own run
