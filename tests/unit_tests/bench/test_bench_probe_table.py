"""What a new user tried on the benchmark (scripts/benchmark_double_buffer.py), row by row.

Each row is an input, the exit status it must give and a fragment of what it must say; no row
may end in a traceback, launch a run, or leave a results file behind when it fails. Runs come
from ``--from-logs`` folders written here, so nothing needs a GPU.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from hfsdp.bench import run as B
from hfsdp.bench import run_logs
from hfsdp.usererror import UserError

STEPS = 8  # --warmup-steps 5 --timed-steps 3
BASE = ["--nproc", "1", "--repeats", "1", "--warmup-steps", "5", "--timed-steps", "3", "--no-plan", "--no-chart"]
REPORT = {"torch": "2.11.0+cu130", "device": "NVIDIA H100 80GB HBM3", "peak_allocated_bytes": 100,
          "peak_reserved_bytes": 200, "pool_bytes_measured": 64, "cuda_graph_captured": False,
          "maxpool_stats": {"home_misses": 0}}


def step_line(step: int, ms: str, loss: str) -> str:
    return (f" [2026-11-23 10:00:00] iteration {step:8d}/{STEPS:8d} | consumed samples: {4 * step} | "
            f"elapsed time per iteration (ms): {ms} | learning rate: 1.000000E-04 | global batch size:     4 | "
            f"lm loss: {loss} | loss scale: 1.0 | number of skipped iterations:   0 |\n")


def keep(folder: Path, name: str = "no_db", *, ms: str = "70.0", loss: str = "1.000000E+01",
         report: object = REPORT) -> Path:
    """One run as --keep-logs leaves it: ``<name>-0.log`` and ``<name>-0.report.json``."""
    folder.mkdir(exist_ok=True)
    (folder / f"{name}-0.log").write_text("".join(step_line(s, ms, loss) for s in range(1, STEPS + 1)))
    (folder / f"{name}-0.report.json").write_text(report if isinstance(report, str) else json.dumps(report))
    return folder


def replaced_by_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def replaced_by_fifo(path: Path) -> None:
    """A named pipe in place of a run file: reading it would block forever."""
    path.unlink()
    os.mkfifo(path)


def replaced_by_link(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


class Row(NamedTuple):
    argv: Callable[[Path], list[str]]  # tmp -> arguments (files made under tmp)
    rc: int
    says: str


def from_logs(make: Callable[[Path], object], *extra: str, configs: str = "no_db") -> Callable[[Path], list[str]]:
    def argv(tmp: Path) -> list[str]:
        make(tmp / "kept")
        return [*BASE, "--configs", configs, "--from-logs", str(tmp / "kept"), "--out-json", str(tmp / "r.json"),
                *extra]
    return argv


def plain(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [a.replace("TMP", str(tmp)) for a in args]


def fifo(tmp: Path) -> str:
    os.mkfifo(tmp / "pipe")
    return str(tmp / "pipe")


def link(tmp: Path, target: str) -> str:
    (tmp / "link").symlink_to(target)
    return str(tmp / "link")


def results_file(tmp: Path, text: str) -> str:
    (tmp / "results.json").write_text(text)
    return str(tmp / "results.json")


def chart_results(tmp: Path) -> str:
    """A results JSON --chart-from can draw: one configuration's summary."""
    summary = {"config": "no_db", "runs": 1, "median_step_s": 0.07, "min_run_median_s": 0.07,
               "max_run_median_s": 0.07, "tokens_per_s": 1000.0, "peak_allocated_bytes": 100,
               "peak_reserved_bytes": 200, "pool_bytes_measured": None, "pool_bytes_planned": None,
               "analytic_minimum_bytes": None}
    return results_file(tmp, json.dumps({"summary": [summary], "meta": {"preset": "default", "nproc": 1}}))


def users_folder(tmp: Path) -> list[str]:
    """--keep-logs naming a folder the user made, which holds a file of theirs."""
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("mine\n")
    return [*BASE, "--configs", "no_db", "--keep-logs", str(tmp / "mine"), "--out-json", str(tmp / "r.json")]


ROWS: dict[str, Row] = {
    # Damaged run files in a --from-logs folder: one sentence naming the file.
    "report is a JSON list": Row(from_logs(lambda d: keep(d, report=[])), 2,
                                 "no_db-0.report.json holds a JSON list, not an object"),
    "report is {}": Row(from_logs(lambda d: keep(d, report={})), 2,
                        "no_db-0.report.json lacks peak_allocated_bytes, peak_reserved_bytes"),
    "peak is not a number": Row(from_logs(lambda d: keep(d, report={**REPORT, "peak_allocated_bytes": "lots"})), 2,
                                "no_db-0.report.json has peak_allocated_bytes 'lots', not a whole number of bytes"),
    "peak is a bool": Row(from_logs(lambda d: keep(d, report={**REPORT, "peak_reserved_bytes": True})), 2,
                          "has peak_reserved_bytes True, not a whole number of bytes"),
    "report is not JSON": Row(from_logs(lambda d: keep(d, report="{half")), 2, "no_db-0.report.json is not JSON"),
    "report is a folder": Row(from_logs(lambda d: replaced_by_folder(keep(d) / "no_db-0.report.json")), 2,
                              "no_db-0.report.json is a folder, not a regular file"),
    "report is a named pipe": Row(from_logs(lambda d: replaced_by_fifo(keep(d) / "no_db-0.report.json")), 2,
                                  "no_db-0.report.json is a named pipe, not a regular file"),
    "report holds NaN": Row(from_logs(lambda d: keep(d, report=json.dumps(REPORT).replace("64", "NaN"))), 2,
                            "no_db-0.report.json is not JSON (NaN is not a JSON number"),
    "report gives a key twice": Row(from_logs(lambda d: keep(d, report=json.dumps(REPORT)[:-1] + ', "device": "x"}')),
                                    2, "key 'device' is given twice in one object"),
    "log is a folder": Row(from_logs(lambda d: replaced_by_folder(keep(d) / "no_db-0.log")), 2,
                           "no_db-0.log is a folder, not a regular file"),
    "log is a named pipe": Row(from_logs(lambda d: replaced_by_fifo(keep(d) / "no_db-0.log")), 2,
                               "no_db-0.log is a named pipe, not a regular file"),
    "log links to /dev/zero": Row(from_logs(lambda d: replaced_by_link(keep(d) / "no_db-0.log", "/dev/zero")), 2,
                                  "no_db-0.log is a character device, not a regular file"),
    "log links to nothing": Row(from_logs(lambda d: replaced_by_link(keep(d) / "no_db-0.log", "nowhere")), 2,
                                "no_db#0: not in"),
    "failed marker is a named pipe": Row(from_logs(lambda d: os.mkfifo(keep(d) / "no_db-0.failed")), 2,
                                         "no reason recorded (" ),
    "log is binary": Row(from_logs(lambda d: (keep(d) / "no_db-0.log").write_bytes(bytes(range(256)) * 8)), 2,
                         "no step time logged for steps [6, 7, 8]"),
    "failed marker is a folder": Row(from_logs(lambda d: (keep(d) / "no_db-0.failed").mkdir()), 2,
                                     "no_db#0: failed when it ran: no reason recorded"),
    # No usable timing: a failed run, never a table of nan or a file of bare NaN tokens.
    "step times nan": Row(from_logs(lambda d: keep(d, ms="nan")), 2, "step 6 took nan ms by"),
    "step times inf": Row(from_logs(lambda d: keep(d, ms="inf")), 2, "step 6 took inf ms by"),
    "step times 0": Row(from_logs(lambda d: keep(d, ms="0.0")), 2, "step 6 took 0 ms by"),
    "loss nan": Row(from_logs(lambda d: keep(d, loss="nan")), 2, "lm loss is nan at step 1"),
    "one good run, one nan run": Row(from_logs(lambda d: (keep(d), keep(d, "maxpool", ms="nan")),
                                               configs="no_db,maxpool"), 1, "maxpool#0: step 6 took nan ms"),
    "peaks of 0 bytes": Row(from_logs(lambda d: keep(d, report={**REPORT, "peak_allocated_bytes": 0,
                                                                 "peak_reserved_bytes": 0})), 0, "1 of 1 runs read"),
    # The folder itself.
    "--from-logs missing": Row(plain(*BASE, "--from-logs", "TMP/absent", "--out-json", "TMP/r.json"), 2,
                               "no such folder"),
    "--from-logs a file": Row(plain(*BASE, "--from-logs", __file__, "--out-json", "TMP/r.json"), 2,
                              "is not a folder"),
    "--from-logs empty": Row(from_logs(lambda d: d.mkdir()), 2, "no usable run among the 1 asked for (no_db#0: not in"),
    "--from-logs with --keep-logs": Row(from_logs(keep, "--keep-logs", "kept-again"), 2,
                                        "--from-logs launches nothing, so --keep-logs would record nothing"),
    "--from-logs with --profile-dir": Row(from_logs(keep, "--profile-dir", "p"), 2, "so --profile-dir would"),
    # Malformed flag values.
    "--nproc 0": Row(plain("--nproc", "0"), 2, "argument --nproc: must be > 0, got 0"),
    "--nproc abc": Row(plain("--nproc", "abc"), 2, "argument --nproc: 'abc' is not a whole number"),
    "--repeats 0": Row(plain("--repeats", "0"), 2, "argument --repeats: must be > 0, got 0"),
    "--timed-steps 0": Row(plain("--timed-steps", "0"), 2, "argument --timed-steps: must be > 0"),
    "--warmup-steps -1": Row(plain("--warmup-steps", "-1"), 2, "argument --warmup-steps: must be >= 0, got -1"),
    "--run-timeout 0": Row(plain("--run-timeout", "0"), 2, "argument --run-timeout: must be > 0"),
    "--preset bogus": Row(plain("--preset", "bogus"), 2, "argument --preset: invalid choice: 'bogus'"),
    "--preset realistic, local configs": Row(from_logs(keep, "--preset", "realistic"), 2,
                                             "the realistic preset is built for te layer specs, and no_db uses"),
    "--preset realistic without TE": Row(plain("--preset", "realistic", "--configs", "te_no_db"), 2,
                                         "the realistic preset needs transformer_engine, causal_conv1d"),
    "--env FOO": Row(from_logs(keep, "--env", "FOO"), 2, "--env 'FOO' is not KEY=VALUE"),
    "--configs bogus": Row(from_logs(keep, configs="no_db,bogus"), 2, "--configs names 'bogus', not a configuration"),
    "--configs empty": Row(from_logs(keep, configs=","), 2, "--configs names no configuration"),
    "--configs twice": Row(from_logs(keep, configs="no_db,no_db"), 2, "--configs names no_db more than once"),
    # Megatron flags after -- that the benchmark reads itself (tokens per step, global batch).
    "-- --seq-length abc": Row(from_logs(keep, "--", "--seq-length", "abc"), 2,
                               "--seq-length abc is not a whole number > 0"),
    "-- --micro-batch-size x": Row(from_logs(keep, "--", "--micro-batch-size", "x"), 2,
                                   "--micro-batch-size x is not a whole number > 0"),
    "-- --global-batch-size 0": Row(from_logs(keep, "--", "--global-batch-size", "0"), 2, "is not a whole number > 0"),
    "-- --seq-length": Row(from_logs(keep, "--", "--seq-length"), 2, "--seq-length has no value"),
    "-- --seq-length=2048": Row(from_logs(keep, "--", "--seq-length=2048"), 0, "1 of 1 runs read"),
    # Outputs that could not be written: refused before anything is read or run.
    "--out-json a folder": Row(from_logs(keep, "--out-json", "."), 2, "--out-json . is a folder, not a file"),
    "--out-json under a file": Row(from_logs(keep, "--out-json", f"{__file__}/r.json"), 2, "which is a file"),
    "--out-json empty": Row(from_logs(keep, "--out-json", ""), 2, "--out-json is empty"),
    # A named pipe or a link to nothing would be replaced by the results file (written in one step).
    "--out-json a named pipe": Row(lambda tmp: from_logs(keep, "--out-json", fifo(tmp))(tmp), 2,
                                   "is a named pipe, not a regular file; writing it would put a regular file"),
    "--out-json links to nothing": Row(lambda tmp: from_logs(keep, "--out-json", link(tmp, "nowhere"))(tmp), 2,
                                       "is a symbolic link to nothing; writing it would put"),
    # Folders where os.access says yes to root, but no file can be made: refused before any run, not after all.
    "--out-json in /proc": Row(from_logs(keep, "--out-json", "/proc/hfsdp-r.json"), 2,
                               "--out-json /proc/hfsdp-r.json: "),
    "--out-json in /sys": Row(from_logs(keep, "--out-json", "/sys/hfsdp-r.json"), 2, "--out-json /sys/hfsdp-r.json: "),
    "--out-png in /proc": Row(lambda tmp: [a for a in from_logs(keep, "--out-png", "/proc/c.png")(tmp)
                                           if a != "--no-chart"], 2, "--out-png /proc/c.png: "),
    # Our tools write only into folders they made or empty ones.
    "--keep-logs a folder of the user's": Row(users_folder, 2,
                                              "holds notes.txt, not made by the benchmark (it writes only into"),
    "paths with a space and non-ASCII": Row(lambda tmp: [*BASE, "--configs", "no_db", "--from-logs",
                                                         str(keep(tmp / "ke pt ö")), "--out-json", str(tmp / "r.json")],
                                            0, "1 of 1 runs read"),
    "--out-png a folder": Row(lambda tmp: [a for a in from_logs(keep, "--out-png", str(tmp))(tmp)
                                           if a != "--no-chart"], 2, "is a folder, not a file"),
    "--keep-logs a file": Row(plain(*BASE, "--configs", "no_db", "--keep-logs", __file__, "--out-json", "TMP/r.json"),
                              2, "--keep-logs " + __file__ + " is a file, not a folder"),
    # --chart-from with the wrong file.
    "--chart-from missing": Row(plain("--chart-from", "TMP/absent.json"), 2, "absent.json does not exist"),
    "--chart-from a folder": Row(plain("--chart-from", "TMP"), 2, "is a folder, not a regular file"),
    "--chart-from not JSON": Row(lambda tmp: ["--chart-from", results_file(tmp, "nope")], 2, "is not JSON"),
    "--chart-from a JSON list": Row(lambda tmp: ["--chart-from", results_file(tmp, "[]")], 2,
                                    "is not a benchmark results file"),
    "--chart-from a named pipe": Row(lambda tmp: ["--chart-from", fifo(tmp)], 2, "is a named pipe, not a regular file"),
    "--chart-from /dev/null": Row(plain("--chart-from", "/dev/null"), 2, "is a character device, not a regular file"),
    "--chart-from a key twice": Row(lambda tmp: ["--chart-from", results_file(tmp, '{"summary": [], "summary": []}')],
                                    2, "key 'summary' is given twice"),
    # Where --chart-from draws: folders are made, and the path given is the one written.
    "--chart-from into a new folder": Row(lambda tmp: ["--chart-from", chart_results(tmp), "--out-png",
                                                       f"{tmp}/missing/c.png"], 0, "/missing/c.png"),
    "--chart-from, --out-png a named pipe": Row(lambda tmp: ["--chart-from", chart_results(tmp), "--out-png",
                                                             fifo(tmp)], 2, "is a named pipe, not a regular file"),
    "--chart-from, --out-png in /proc": Row(lambda tmp: ["--chart-from", chart_results(tmp), "--out-png",
                                                         "/proc/c.png"], 2, "--out-png /proc/c.png: "),
    "--chart-from NaN": Row(lambda tmp: ["--chart-from", results_file(tmp, '{"summary": NaN}')], 2,
                            "NaN is not a JSON number"),
}

@pytest.fixture(autouse=True)
def nothing_launches(monkeypatch):
    monkeypatch.delenv("HFSDP_DEBUG", raising=False)
    monkeypatch.setattr(B, "launch", lambda *a, **k: pytest.fail("a probe row launched a run"))


@pytest.mark.parametrize("name", list(ROWS))
def test_probe_row(name, tmp_path, monkeypatch, call_cli):
    row = ROWS[name]
    monkeypatch.chdir(tmp_path)
    rc, said = call_cli(B.main, row.argv(tmp_path))
    assert "Traceback" not in said, said[-3000:]
    assert rc == row.rc, (rc, said[-3000:])
    assert row.says in said, said[-3000:]
    results = tmp_path / "r.json"
    if rc == 2:
        assert not results.exists(), "a refused invocation wrote results"
    elif results.exists():
        text = results.read_text()
        assert "NaN" not in text and "Infinity" not in text
        json.loads(text)
    if os.path.lexists(tmp_path / "pipe"):
        assert stat.S_ISFIFO(os.lstat(tmp_path / "pipe").st_mode), "the named pipe was replaced"
    if os.path.lexists(tmp_path / "link"):
        assert os.path.islink(tmp_path / "link"), "the link was replaced"


def test_the_chart_is_written_at_the_path_given_and_reported_so(tmp_path, call_cli):
    """``--out-png DIR/chart`` writes DIR/chart (matplotlib alone would write DIR/chart.png, a path no
    check looked at: a named pipe there would block the writer) and says so."""
    rc, said = call_cli(B.main, ["--chart-from", chart_results(tmp_path), "--out-png", str(tmp_path / "chart")])
    assert rc == 0, said[-2000:]
    assert f"wrote {tmp_path / 'chart'}\n" in said
    assert (tmp_path / "chart").read_bytes().startswith(b"\x89PNG") and not (tmp_path / "chart.png").exists()


def test_resume_takes_a_keep_logs_folder_the_benchmark_made(tmp_path):
    """A folder the benchmark made (its machine.json, its runs) is accepted again with --resume; an
    empty one too; one of the user's is refused."""
    made = tmp_path / "made"
    run_logs.claim_machine(str(made), {"host": "h", "gpus": []})  # what a launch into it wrote first
    keep(made)
    (made / "no_db-0.failed").write_text("rc=1\n")
    (tmp_path / "empty").mkdir()
    for folder in (made, tmp_path / "empty", tmp_path / "new"):
        opts, _ = B.parse([*BASE, "--keep-logs", str(folder), "--resume", "--out-json", str(tmp_path / "r.json")])
        B.check_paths(opts, shared=False)
    users_folder(tmp_path)
    opts, _ = B.parse([*BASE, "--keep-logs", str(tmp_path / "mine"), "--out-json", str(tmp_path / "r.json")])
    with pytest.raises(UserError, match="holds notes.txt, not made by the benchmark"):
        B.check_paths(opts, shared=False)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def test_the_one_good_run_is_summarized_and_the_nan_one_listed(tmp_path, call_cli):
    rc, said = call_cli(B.main, ROWS["one good run, one nan run"].argv(tmp_path))
    assert rc == 1, said[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [s["config"] for s in doc["summary"]] == ["no_db"]
    assert set(doc["meta"]["failures"]) == {"maxpool#0"} and "1 of 2 runs read" in said


def test_zero_byte_peaks_give_no_ratio_instead_of_a_division_by_zero(tmp_path, call_cli):
    rc, said = call_cli(B.main, ROWS["peaks of 0 bytes"].argv(tmp_path))
    assert rc == 0, said[-2000:]
    summary = json.loads((tmp_path / "r.json").read_text())["summary"][0]
    assert summary["peak_allocated_ratio"] is None and summary["step_time_ratio"] == 1.0


def test_ctrl_c_during_from_logs_writes_nothing(tmp_path, monkeypatch, call_cli):
    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_logs, "read_run", interrupted)
    rc, said = call_cli(B.main, from_logs(keep)(tmp_path))
    assert rc == 130 and said.rstrip().endswith("benchmark_double_buffer: interrupted"), said[-2000:]
    assert "Traceback" not in said and not (tmp_path / "r.json").exists()
    assert os.listdir(tmp_path) == ["kept"], "nothing but the folder read"


def test_a_flag_written_with_equals_replaces_the_presets(tmp_path, call_cli):
    """``--seq-length=2048`` after -- is the sequence length the tokens per step are counted with,
    as Megatron reads it (the last spelling wins), not the preset's 1024."""
    rc, said = call_cli(B.main, ROWS["-- --seq-length=2048"].argv(tmp_path))
    assert rc == 0, said[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["runs"][0]["tokens_per_step"] == 4 * 2048  # global batch 2 (mbs) x 1 rank x 2 micro-batches
    flags = doc["meta"]["model_flags"]
    assert "--seq-length=2048" not in flags and flags[flags.index("--seq-length") + 1] == "2048"
