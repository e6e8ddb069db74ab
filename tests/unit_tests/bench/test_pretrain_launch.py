"""Timing runs through pretrain: command line, log + run-report parsing, failures (CPU)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from hfsdp.bench import pretrain_launch as P
from hfsdp.bench import run as B
from hfsdp.bench import run_logs
from hfsdp.launch import pretrain as L
from hfsdp.proc import GroupResult
from hfsdp.training import run_report
from hfsdp.usererror import UserError

MODEL = ["--micro-batch-size", "2", "--seq-length", "1024", "--num-layers", "2"]


def _log_line(step: int, total: int, ms: float, loss: float) -> str:
    return (f" [2026-11-23 10:00:00] iteration {step:8d}/{total:8d} | consumed samples: {4 * step} | "
            f"elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.000000E-04 | "
            f"global batch size:     4 | lm loss: {loss:.6E} | loss scale: 1.0 | "
            f"number of skipped iterations:   0 | number of nan iterations:   0 |\n")


def _write_run(tmp_path, steps: int, ms: float = 70.0, skip: int | None = None,
               captured: bool = True, ranks: int = 1):
    log = tmp_path / "run.log"
    log.write_text("".join(_log_line(s, steps, ms + s, 10.0 - s / 10) for s in range(1, steps + 1)
                           if s != skip))
    report = tmp_path / "run.report.json"
    for rank in range(ranks):
        path = run_report.rank_path(str(report), rank)
        with open(path, "w") as f:
            json.dump({"torch": "2.11.0+cu130", "device": "NVIDIA H100 80GB HBM3",
                       "peak_allocated_bytes": 100 + rank, "peak_reserved_bytes": 200 - rank,
                       "pool_bytes_measured": 64, "cuda_graph_captured": captured,
                       "maxpool_stats": {"home_misses": rank, "pool_bytes_allocated": 64}}, f)
    return str(log), str(report)


def test_training_flags_add_two_micro_batches_per_rank():
    flags = L.training_flags(MODEL, nproc=2, steps=26)
    assert L.flag_value(flags, "--global-batch-size") == "8"  # 2 (mbs) x 2 ranks x 2
    assert L.flag_value(flags, "--train-iters") == "26" and L.flag_value(flags, "--log-interval") == "1"
    assert "--no-check-for-nan-in-loss-and-grad" in flags
    mine = L.training_flags(MODEL + ["--global-batch-size", "16"], nproc=2, steps=26)
    assert L.flag_value(mine, "--global-batch-size") == "16" and mine.count("--global-batch-size") == 1


def test_the_callers_log_interval_stands():
    flags = L.training_flags(MODEL + ["--log-interval", "4"], nproc=1, steps=16)
    assert L.flag_value(flags, "--log-interval") == "4" and L.log_interval(flags) == 4
    assert L.log_interval(L.training_flags(MODEL, nproc=1, steps=16)) == 1


def test_command_runs_megatrons_training_loop():
    cmd = L.command(MODEL, nproc=1, steps=8)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    script = next(a for a in cmd if a.endswith("pretrain_gpt.py"))
    assert script == str(L.TRAINING_SCRIPT) and L.TRAINING_SCRIPT.is_file()
    assert cmd[cmd.index(script) + 1:] == L.training_flags(MODEL, 1, 8)


def test_command_with_several_ranks_per_gpu():
    cmd = L.command(MODEL, nproc=4, steps=8, ranks_per_gpu=4)
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd.index("hfsdp.launch.shared_gpu") < cmd.index(str(L.TRAINING_SCRIPT))
    assert L.flag_value(cmd, "--global-batch-size") == "16"  # 2 (mbs) x 4 ranks x 2, as on 4 GPUs


def test_result_times_only_the_timed_steps(tmp_path):
    log, report = _write_run(tmp_path, steps=8, ranks=2)
    run = P.result("maxpool_graph", 1, log, report, warmup_steps=5, timed_steps=3, nproc=2,
                   flags=MODEL)
    assert run.step_times_s == pytest.approx((0.076, 0.077, 0.078))
    assert run.lm_loss == pytest.approx(tuple(10.0 - s / 10 for s in range(1, 9)))
    assert run.tokens_per_step == 8 * 1024  # global batch 2 x 2 x 2, seq 1024
    # Peaks and home misses: the worst rank.
    assert (run.peak_allocated_bytes, run.peak_reserved_bytes) == (101, 200)
    assert run.maxpool_stats["home_misses"] == 1 and run.cuda_graph_captured is True


def test_result_with_a_log_interval_times_its_intervals(tmp_path):
    """With --log-interval 4 Megatron logs steps 1, 4, 8, 12: the timed values are the intervals' means."""
    log = tmp_path / "run.log"
    log.write_text("".join(_log_line(s, 12, 70.0 + s, 10.0 - s / 10) for s in (1, 4, 8, 12)))
    (tmp_path / "report").mkdir()
    _, report = _write_run(tmp_path / "report", steps=1)
    run = P.result("maxpool_graph", 0, str(log), report, warmup_steps=4, timed_steps=8, nproc=1,
                   flags=MODEL + ["--log-interval", "4"])
    assert run.step_times_s == pytest.approx((0.078, 0.082))
    assert run.lm_loss[3] == pytest.approx(9.6) and run.lm_loss[4] is None
    with pytest.raises(P.RunFailed, match=r"no step time logged for steps \[6, 10\]"):
        P.result("maxpool_graph", 0, str(log), report, warmup_steps=4, timed_steps=8, nproc=1,
                 flags=MODEL + ["--log-interval", "2"])
    every_step, _ = _write_run(tmp_path, steps=12)  # a log of --log-interval 1, read as one of 4
    with pytest.raises(P.RunFailed, match="logs step 2: it was not written with --log-interval 4"):
        P.result("maxpool_graph", 0, every_step, report, warmup_steps=4, timed_steps=8, nproc=1,
                 flags=MODEL + ["--log-interval", "4"])


@pytest.mark.parametrize("argv, words", [
    (["--warmup-steps", "6", "--timed-steps", "8", "--", "--log-interval", "4"], "must be multiples of it"),
    (["--warmup-steps", "8", "--timed-steps", "6", "--", "--log-interval", "4"], "give multiples of 4"),
    (["--", "--log-interval", "0"], "not a whole number of steps"),
    (["--", "--log-interval", "x"], "not a whole number of steps"),
])
def test_a_log_interval_that_cannot_time_steps_is_refused(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(B, "launch", lambda *a, **k: pytest.fail("nothing may run"))
    assert B.main(["--configs", "no_db", "--no-plan", "--no-chart", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("benchmark_double_buffer: error: ") and words in err, err


def test_result_names_missing_steps_and_reports(tmp_path):
    log, report = _write_run(tmp_path, steps=8, skip=7)
    with pytest.raises(P.RunFailed, match=r"no step time logged for steps \[7\]"):
        P.result("no_db", 0, log, report, warmup_steps=5, timed_steps=3, nproc=1, flags=MODEL)
    log, _ = _write_run(tmp_path, steps=8)
    with pytest.raises(P.RunFailed, match="run report unreadable"):
        P.result("no_db", 0, log, str(tmp_path / "absent.json"), warmup_steps=5, timed_steps=3,
                 nproc=1, flags=MODEL)


def test_startup_is_launch_to_the_line_of_step_2(tmp_path):
    log = tmp_path / "run.log"
    launched = P.launch_line(P.datetime(2026, 11, 23, 9, 59, 15, 250000))
    assert launched == "[hfsdp-bench] launched at [2026-11-23 09:59:15.250000]\n"
    body = "".join(_log_line(s, 4, 70.0, 9.0) for s in range(1, 5))
    # Megatron stamps its lines with microseconds; step 2's line is the first that counts.
    step2 = " iteration        2/"
    body = body.replace(f" [2026-11-23 10:00:00]{step2}", f" [2026-11-23 10:00:00.500000]{step2}")
    log.write_text(launched + "some start-up output\n" + body)
    assert P.startup_seconds(str(log)) == 45.2
    log.write_text(body)  # a log from before launch lines: no start-up, not a failure
    assert P.startup_seconds(str(log)) is None
    log.write_text(launched + _log_line(1, 4, 70.0, 9.0))  # ended before step 2
    assert P.startup_seconds(str(log)) is None


def _fake_pretrain(monkeypatch, tmp_path, captured: bool, returncode: int = 0, said: str = ""):
    seen = []

    def fake_run(cmd, *, timeout_s, env, stdout):
        seen.append((cmd, env))
        steps = int(L.flag_value(cmd, "--train-iters"))
        src_log, src_report = _write_run(tmp_path, steps=steps, captured=captured)
        stdout.write(open(src_log).read() + said)
        with open(env[run_report.ENV], "w") as f:
            f.write(open(src_report).read())
        return GroupResult(returncode=returncode, timed_out=False, seconds=0.1)

    monkeypatch.setattr(B, "run_group", fake_run)
    return seen


def test_timing_runs_go_through_pretrain_with_a_run_report(monkeypatch, tmp_path):
    seen = _fake_pretrain(monkeypatch, tmp_path, captured=True)
    opts, _ = B.parse(["--nproc", "1", "--warmup-steps", "5", "--timed-steps", "3"])
    work = tmp_path / "work"
    work.mkdir()
    run, info = B.launch(B.cfgs.CONFIGS["maxpool_graph"], 0, MODEL, opts, str(work))
    assert run is not None, info
    cmd, env = seen[0]
    assert str(L.TRAINING_SCRIPT) in cmd and "--cuda-graph-impl" in cmd
    assert env[run_report.ENV].endswith("maxpool_graph-0.report.json")
    assert len(run.step_times_s) == 3
    # The launcher stamped the log, so the run knows its start-up (the fake log's steps are
    # stamped 2026-11-23, before this launch: a negative time, but a time).
    assert run.startup_s is not None
    assert not (tmp_path / "kept").exists()
    opts.keep_logs = str(tmp_path / "kept")
    B.launch(B.cfgs.CONFIGS["maxpool_graph"], 1, MODEL, opts, str(work))
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [
        "maxpool_graph-1.log", "maxpool_graph-1.report.json"]


def test_a_graphed_run_that_captured_nothing_fails(monkeypatch, tmp_path):
    _fake_pretrain(monkeypatch, tmp_path, captured=False)
    opts, _ = B.parse(["--nproc", "1", "--warmup-steps", "5", "--timed-steps", "3"])
    work = tmp_path / "work"
    work.mkdir()
    run, info = B.launch(B.cfgs.CONFIGS["no_db_graph"], 0, MODEL, opts, str(work))
    assert run is None and "no full-iteration CUDA graph was captured" in info
    run, info = B.launch(B.cfgs.CONFIGS["no_db"], 0, MODEL, opts, str(work))
    assert run is not None, "an eager run needs no graph"


@pytest.mark.parametrize("argv, words", [
    (["--configs", "no_db,maxpool_graph", "--profile-dir", "/p"], "the profiling passes"),
    (["--configs", "no_db_graph", "--warmup-steps", "4"], "give --warmup-steps 5 or more"),
])
def test_graphed_configs_refuse_options_that_cannot_time_them(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(B, "launch", lambda *a, **k: pytest.fail("nothing may run"))
    assert B.main(argv + ["--no-plan", "--no-chart"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("benchmark_double_buffer: error: ") and words in err, err


def _keep(folder, name: str, repeat: int, steps: int, ms: float, captured: bool) -> None:
    """A --keep-logs pair (<config>-<repeat>.log and .report.json) as a timing run leaves it."""
    run_dir = folder / f"tmp-{name}-{repeat}"
    run_dir.mkdir()
    log, report = _write_run(run_dir, steps, ms=ms, captured=captured)
    (folder / f"{name}-{repeat}.log").write_text(open(log).read())
    (folder / f"{name}-{repeat}.report.json").write_text(open(run_report.rank_path(report, 0)).read())


def test_from_logs_summarizes_an_invocation_that_stopped_early(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(B, "launch", lambda *a, **k: pytest.fail("--from-logs launches nothing"))
    kept = tmp_path / "kept"
    kept.mkdir()
    for name, repeat, ms in (("no_db", 0, 500.0), ("no_db", 1, 520.0), ("maxpool_graph", 0, 60.0)):
        _keep(kept, name, repeat, steps=8, ms=ms, captured=name.endswith("graph"))
    _keep(kept, "no_db_graph", 0, steps=8, ms=70.0, captured=False)  # kept, but captured nothing
    out = tmp_path / "r.json"
    rc = B.main(["--nproc", "1", "--configs", "no_db,no_db_graph,maxpool_graph", "--repeats", "2",
                 "--warmup-steps", "5", "--timed-steps", "3", "--no-plan", "--no-chart",
                 "--from-logs", str(kept), "--out-json", str(out), "--", *MODEL])
    assert rc == 1, "an incomplete invocation is not a success"
    doc = json.loads(out.read_text())
    summary = {s["config"]: s for s in doc["summary"]}
    assert summary["no_db"]["runs"] == 2 and summary["maxpool_graph"]["runs"] == 1
    assert "no_db_graph" not in summary
    assert summary["no_db"]["median_step_s"] == pytest.approx((507.0 + 527.0) / 2 / 1e3)
    assert doc["meta"]["from_logs"] == str(kept) and doc["meta"]["wall_s"] is None
    # The machine is the runs' (their reports), not the one that summarizes them.
    assert (doc["meta"]["torch"], doc["meta"]["device"]) == ("2.11.0+cu130", "NVIDIA H100 80GB HBM3")
    assert set(doc["meta"]["failures"]) == {"no_db_graph#0", "no_db_graph#1", "maxpool_graph#1"}
    assert "no full-iteration CUDA graph" in doc["meta"]["failures"]["no_db_graph#0"]
    assert doc["meta"]["failures"]["maxpool_graph#1"] == f"not in {kept}"
    assert "3 of 6 runs read from" in capsys.readouterr().out


def test_from_logs_without_the_runs_is_a_sentence(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = B.main(["--nproc", "1", "--configs", "no_db", "--no-plan", "--from-logs",
                 str(tmp_path / "absent"), "--out-json", str(out)])
    assert rc == 2 and "no such folder" in capsys.readouterr().err and not out.exists()
    (tmp_path / "empty").mkdir()
    rc = B.main(["--nproc", "1", "--configs", "no_db", "--no-plan", "--from-logs",
                 str(tmp_path / "empty"), "--out-json", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "no usable run among the 3 asked for" in err and not out.exists()
    assert "no_db#0: not in" in err


def test_a_kept_run_that_failed_stays_failed_for_from_logs(monkeypatch, tmp_path):
    """Complete steps and a report but a bad exit (say a crash at teardown): the run did not
    count when it ran, so --from-logs must not count it either; a later good run of the same
    name into the same folder clears the marker."""
    opts, _ = B.parse(["--nproc", "1", "--warmup-steps", "5", "--timed-steps", "3",
                       "--keep-logs", str(tmp_path / "kept")])
    work = tmp_path / "work"
    work.mkdir()
    _fake_pretrain(monkeypatch, tmp_path, captured=False, returncode=-11)
    run, info = B.launch(B.cfgs.CONFIGS["no_db"], 0, MODEL, opts, str(work))
    assert run is None and info.startswith("rc=-11")
    marker = tmp_path / "kept" / "no_db-0.failed"
    assert marker.read_text() == "rc=-11\n"
    with pytest.raises(UserError, match="no_db#0: failed when it ran: rc=-11"):
        run_logs.runs_from_logs(str(tmp_path / "kept"), [(0, "no_db")], MODEL, opts)
    # A log that names its error: the marker keeps the error, so --from-logs can say it in one line.
    _fake_pretrain(monkeypatch, tmp_path, captured=False, returncode=1,
                   said="[rank0]: RuntimeError: operation not permitted when stream is capturing\n")
    B.launch(B.cfgs.CONFIGS["no_db"], 0, MODEL, opts, str(work))
    assert marker.read_text() == "rc=1: RuntimeError: operation not permitted when stream is capturing\n"
    _fake_pretrain(monkeypatch, tmp_path, captured=False, returncode=0)
    run, _ = B.launch(B.cfgs.CONFIGS["no_db"], 0, MODEL, opts, str(work))
    assert run is not None and not marker.exists()
    runs, failures = run_logs.runs_from_logs(str(tmp_path / "kept"), [(0, "no_db")], MODEL, opts)
    assert [r.config for r in runs] == ["no_db"] and failures == {}
    assert (runs[0].torch, runs[0].device) == ("2.11.0+cu130", "NVIDIA H100 80GB HBM3")


HERE = {"host": "gpu-a", "gpus": ["GPU-1", "GPU-2"]}


@pytest.fixture
def gpus(monkeypatch):
    """A machine with GPUs and every optional package, as the launch checks see it."""
    monkeypatch.setattr(B.fit, "gpu_memory", lambda *a, **k: [80 * 2**30] * 8)
    monkeypatch.setattr(B.requirements, "importable", lambda package: True)


def _resume_argv(kept, out) -> list[str]:
    return ["--nproc", "1", "--configs", "no_db,maxpool_graph", "--repeats", "2", "--warmup-steps", "5",
            "--timed-steps", "3", "--no-plan", "--no-chart", "--keep-logs", str(kept), "--resume",
            "--out-json", str(out), "--", *MODEL]


def test_resume_launches_only_the_runs_the_folder_lacks(gpus, monkeypatch, tmp_path):
    """[Note: resumed invocations]: kept runs that count are taken, the rest launched, priming skipped."""
    monkeypatch.setattr(run_logs, "machine_identity", lambda: dict(HERE))
    kept = tmp_path / "kept"
    kept.mkdir()
    run_logs.claim_machine(str(kept))
    _keep(kept, "no_db", 0, steps=8, ms=500.0, captured=False)
    _keep(kept, "maxpool_graph", 0, steps=8, ms=60.0, captured=True)
    _keep(kept, "no_db", 1, steps=8, ms=510.0, captured=False)
    (kept / "no_db-1.failed").write_text("rc=1\n")  # did not count when it ran: launched again
    launched = []

    def launch(config, repeat, flags, opts, workdir, timeout_s=None):
        launched.append((repeat, config.name))
        return None, "rc=1; log tail:\nstopped here"

    monkeypatch.setattr(B, "launch", launch)
    out = tmp_path / "r.json"
    assert B.main(_resume_argv(kept, out)) == 1  # the relaunched runs failed in this fake
    assert sorted(launched) == [(1, "maxpool_graph"), (1, "no_db")], "no priming, no kept run again"
    doc = json.loads(out.read_text())
    assert {(r["config"], r["repeat"]) for r in doc["runs"]} == {("no_db", 0), ("maxpool_graph", 0)}
    assert doc["meta"]["resumed_from"] == str(kept)


def test_resume_into_another_machines_folder_is_refused_before_any_run(gpus, monkeypatch, tmp_path, capsys):
    kept = tmp_path / "kept"
    kept.mkdir()
    run_logs.claim_machine(str(kept), here={"host": "gpu-b", "gpus": ["GPU-9"]})
    monkeypatch.setattr(run_logs, "machine_identity", lambda: dict(HERE))
    monkeypatch.setattr(B, "launch", lambda *a, **k: pytest.fail("nothing may run"))
    assert B.main(_resume_argv(kept, tmp_path / "r.json")) == 2
    err = capsys.readouterr().err
    assert "holds runs of another machine ('gpu-b', 1 GPU(s)), not of this one ('gpu-a')" in err, err
    run_logs.claim_machine(str(tmp_path / "fresh"), here=dict(HERE))  # a new folder records the machine
    assert json.loads((tmp_path / "fresh" / run_logs.MACHINE_FILE).read_text()) == HERE
    run_logs.claim_machine(str(tmp_path / "fresh"), here=dict(HERE))  # the same machine again: fine
    unrecorded = tmp_path / "unrecorded"
    unrecorded.mkdir()
    _keep(unrecorded, "no_db", 0, steps=8, ms=500.0, captured=False)
    with pytest.raises(UserError, match="holds runs whose machine is not recorded"):
        run_logs.claim_machine(str(unrecorded), here=dict(HERE))


def test_resume_needs_keep_logs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(B, "launch", lambda *a, **k: pytest.fail("nothing may run"))
    rc = B.main(["--nproc", "1", "--configs", "no_db", "--no-plan", "--resume", "--out-json", str(tmp_path / "r.json")])
    assert rc == 2 and "no --keep-logs is given" in capsys.readouterr().err


def test_an_interrupted_run_keeps_its_log_as_not_counting(monkeypatch, tmp_path):
    """Ctrl-C or a time limit during a run: what the run wrote is kept with a marker (so --resume
    launches it again, and the log says where it was), and the interruption goes on up."""
    kept = tmp_path / "kept"

    def interrupted(cmd, *, stdout, **kwargs):
        os.write(stdout.fileno(), b"step 1 took 90 s\n")  # as the ranks write: to the file's descriptor
        raise KeyboardInterrupt

    monkeypatch.setattr(B, "run_group", interrupted)
    opts = B.parse(["--nproc", "1", "--configs", "no_db", "--keep-logs", str(kept), "--", *MODEL])[0]
    with pytest.raises(KeyboardInterrupt):
        B.launch_pretrain(B.cfgs.CONFIGS["no_db"], 0, MODEL, opts, str(tmp_path))
    assert "step 1 took 90 s" in (kept / "no_db-0.log").read_text()
    assert (kept / "no_db-0.failed").read_text().startswith("interrupted (KeyboardInterrupt) before the run ended")
