"""One run at a time in a case's output folder ([Note: one run per output folder] in
hfsdp/functional/runlock.py): a second run is refused naming the holder, a dead holder's lock is
taken by the next run (by one of several racing ones), and a re-run twin's folder is locked too."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfsdp import filelock
from hfsdp.functional import runlock
from hfsdp.functional.run_case import Launch, run_case
from hfsdp.launch.torchrun import Placement
from hfsdp.usererror import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]

# Prints Megatron's step lines. With FAKE_GO set it first waits (up to a minute) for that file;
# PROBE_LOCKS (paths joined by os.pathsep) prints whether each lock is free while it runs.
TRAINER = '''\
import os, sys, time
from pathlib import Path
args = sys.argv[1:]
iters = int(args[args.index("--train-iters") + 1])
go = os.environ.get("FAKE_GO")
deadline = time.monotonic() + 60
while go and not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)
if os.environ.get("PROBE_LOCKS"):
    from hfsdp import filelock
    print("LOCKS_FREE=" + ",".join(str(filelock.is_free(Path(p))) for p in os.environ["PROBE_LOCKS"].split(os.pathsep)),
          flush=True)
shift = float(os.environ.get("FAKE_SHIFT", "0"))
for it in range(1, iters + 1):
    print(f" iteration {it:8d}/{iters:8d} | consumed samples: {8 * it} | elapsed time per iteration (ms): 50.0 | "
          f"lm loss: {10.0 - 0.25 * it + shift:.6E} | num zeros: 0 |", flush=True)
'''


def make_case(root: Path, name: str = "case", extra: str = "", model: str = "gpt") -> Path:
    trainer = root / "trainer.py"
    if not trainer.exists():
        trainer.parent.mkdir(parents=True, exist_ok=True)
        trainer.write_text(TRAINER)
    case = root / model / name
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(
        f"TRAINING_SCRIPT: {trainer}\nNPROC: 1\nTEST_TYPE: regular\nREQUIRE_GOLDEN: false\n{extra}"
        "METRICS:\n  - lm loss\nMODEL_ARGS:\n  --train-iters: 3\n")
    return case


def wait_until(test, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not test():
        if time.monotonic() > deadline:
            pytest.fail("timed out")
        time.sleep(0.05)


def test_a_second_run_in_a_busy_output_folder_is_refused_naming_the_holder(tmp_path):
    """Two runs in one output folder once gave a PASS on the other run's metrics; now the second
    is refused in one sentence, and the first keeps its folder."""
    case = make_case(tmp_path / "cases")
    out, go = tmp_path / "out", tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "HFSDP_DEBUG")}
    first = subprocess.Popen([sys.executable, "-m", "hfsdp.functional.run_case", str(case), "--output-dir", str(out),
                              "--env", f"FAKE_GO={go}", "--env", "FAKE_SHIFT=1"], cwd=REPO_ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lock = runlock.lock_path(out / "gpt" / "case")
    try:
        wait_until(lambda: lock.is_file() and lock.read_text().strip())
        with pytest.raises(UserError) as info:
            run_case(case, launch=Launch(Placement(nproc=1), timeout_s=60), output_root=out)
        cause = info.value.cause
        assert f"output folder {out / 'gpt' / 'case'} is in use by run_case gpt/case (pid {first.pid}, " \
               f"host {socket.gethostname()}, since " in cause, cause
        assert "wait for that run to end" in info.value.fix and "--output-dir" in info.value.fix
    finally:
        go.touch()
        printed, _ = first.communicate(timeout=120)
    assert first.returncode == 0 and "HFSDP-FUNCTIONAL RESULT gpt/case: PASS" in printed, printed
    metrics = json.loads((out / "gpt" / "case" / "metrics.json").read_text())
    assert metrics["lm loss"]["values"]["1"] == pytest.approx(10.75)  # its own numbers (FAKE_SHIFT=1)
    assert lock.read_text() == "" and filelock.is_free(lock)  # released, no holder named


HOLD_AND_DIE = '''\
import os, signal, sys
from pathlib import Path
from hfsdp.functional import runlock

@runlock.holding
def run():
    runlock.hold(Path(sys.argv[1]), "gpt/case")
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

run()
'''


def test_the_lock_of_a_holder_that_died_is_taken_by_the_next_run(tmp_path):
    case = make_case(tmp_path / "cases")
    folder = tmp_path / "out" / "gpt" / "case"
    dead = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, str(folder)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert dead.returncode == -signal.SIGKILL and dead.stdout == "held\n", dead.stderr
    lock = runlock.lock_path(folder)
    assert "run_case gpt/case (pid " in lock.read_text()  # the dead holder's line is left behind
    log = tmp_path / "run1.log"
    log.write_text("".join(f" iteration {i:8d}/       3 | lm loss: {10.0 - i:.6E} | num zeros: 0 |\n"
                           for i in (1, 2, 3)))
    assert run_case(case, output_root=tmp_path / "out", evaluate_log=log).status == "PASS"
    assert lock.read_text() == ""


RACER = '''\
import os, sys, time
from pathlib import Path
from hfsdp.functional import runlock
from hfsdp.usererror import UserError

@runlock.holding
def run():
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
    try:
        runlock.hold(Path(sys.argv[1]), "gpt/case")
    except UserError as exc:
        print("REFUSED", exc.cause, flush=True)
        return
    print("WON", flush=True)
    time.sleep(3)

run()
'''


def test_of_runs_racing_for_a_dead_holders_lock_exactly_one_wins(tmp_path):
    folder = tmp_path / "out" / "gpt" / "case"
    dead = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, str(folder)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert dead.returncode == -signal.SIGKILL, dead.stderr
    go = tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(folder), str(go)], cwd=REPO_ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(4)]
    time.sleep(2.0)  # every racer imported and waits for the start
    go.touch()
    said = [r.communicate(timeout=60)[0] for r in racers]
    assert sorted(s.split()[0] for s in said) == ["REFUSED"] * 3 + ["WON"], said
    assert all("is in use by run_case gpt/case (pid" in s for s in said if s.startswith("REFUSED")), said


def test_a_re_run_twin_holds_its_folder_and_the_case_its_own(tmp_path):
    cases, out = tmp_path / "cases", tmp_path / "out"
    locks = os.pathsep.join(str(runlock.lock_path(out / "gpt" / n)) for n in ("case", "twin"))
    make_case(cases, "twin", extra=f"ENV_VARS:\n  PROBE_LOCKS: '{locks}'\n")
    case = make_case(cases, "case", extra=f"COMPARE_TO: ../twin\nENV_VARS:\n  PROBE_LOCKS: '{locks}'\n")
    result = run_case(case, launch=Launch(Placement(nproc=1), timeout_s=60), output_root=out)
    assert result.status == "PASS", result.reasons
    assert "LOCKS_FREE=False,True" in (out / "gpt" / "case" / "run1.log").read_text()  # the twin was not running yet
    assert "LOCKS_FREE=False,False" in (out / "gpt" / "twin" / "run1.log").read_text()  # both, during the twin's run
    assert all(filelock.is_free(Path(p)) for p in locks.split(os.pathsep))


def test_a_twin_that_would_write_into_its_cases_folder_is_refused(tmp_path):
    """A twin of another folder with the case's <model>/<case> name would clear the case's outputs."""
    twin = make_case(tmp_path / "elsewhere", "case")
    where = os.path.relpath(twin, tmp_path / "cases" / "gpt" / "case")
    case = make_case(tmp_path / "cases", "case", extra=f"COMPARE_TO: {where}\n")
    with pytest.raises(UserError) as info:
        run_case(case, launch=Launch(Placement(nproc=1), timeout_s=60), output_root=tmp_path / "out")
    assert "which this same run is writing for gpt/case" in info.value.cause, info.value.cause
    assert filelock.is_free(runlock.lock_path(tmp_path / "out" / "gpt" / "case"))


def test_a_lock_file_that_is_not_a_regular_file_is_refused(tmp_path):
    case = make_case(tmp_path / "cases")
    folder = tmp_path / "out" / "gpt" / "case"
    folder.parent.mkdir(parents=True)
    os.mkfifo(runlock.lock_path(folder))
    log = tmp_path / "run1.log"
    log.write_text(" iteration        1/       1 | lm loss: 9.0E+00 |\n")
    with pytest.raises(UserError, match=r"lock .*\.case\.lock is a named pipe, not a regular file"):
        run_case(case, output_root=tmp_path / "out", evaluate_log=log)
    assert not folder.exists()


def test_hold_outside_a_run_is_a_bug_not_a_user_error(tmp_path):
    with pytest.raises(RuntimeError, match="outside a @runlock.holding run"):
        runlock.hold(tmp_path / "out", "gpt/case")
