"""What a user tried on the trace readers (``python -m hfsdp.trace.<tool>``), row by row.

Each row is a tool, its arguments, the exit status it must give and a fragment of what it must say;
no row may end in a traceback, and none may open a named pipe (it would hang).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

KERNEL = {"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 5, "pid": 0, "tid": 0}
TRACES = {  # name -> the text of a trace file written under tmp
    "good.json": json.dumps({"traceEvents": [KERNEL]}),
    "nan.json": '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": NaN, "dur": 5}]}',
    "inf.json": '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": Infinity}]}',
    "negative.json": json.dumps({"traceEvents": [{**KERNEL, "dur": -5}]}),
    "string.json": json.dumps({"traceEvents": [{**KERNEL, "dur": "5"}]}),
    "bool.json": json.dumps({"traceEvents": [{**KERNEL, "ts": True}]}),
    "twice.json": '{"traceEvents": [], "traceEvents": 3}',
    "sp ö/t r.json": json.dumps({"traceEvents": [KERNEL]}),
}


def trace_tool(module: str) -> Callable[[list[str]], int]:
    import importlib

    return importlib.import_module(f"hfsdp.trace.{module}").main


# (tool, arguments with TMP for the folder of TRACES, exit status, fragment of the output)
TRACE_ROWS = [
    *[(tool, [name if name.startswith("/") else f"TMP/{name}"], 2, says)
      for tool in ("timeline", "idle", "waits", "launchers") for name, says in (
        ("nan.json", "event 0 ('k') has ts nan, not a finite number"),
        ("inf.json", "has dur inf, not a finite number"),
        ("negative.json", "has a negative dur (-5)"),
        ("string.json", "has dur '5', not a finite number"),
        ("bool.json", "has ts True, not a finite number"),
        ("twice.json", "holds no list of trace events"),
        ("fifo", "is a named pipe, not a regular file"),
        ("broken", "is a symbolic link to nothing"),
        ("/dev/null", "is a character device, not a regular file"),
        ("", "does not exist"),
    )],
    *[(tool, ["TMP/sp ö/t r.json"], 0, "") for tool in ("timeline", "idle", "waits", "launchers")],
    *[(tool, ["TMP/good.json", "--steps", bad], 2, "argument --steps: must be > 0")
      for tool in ("timeline", "idle", "waits", "launchers") for bad in ("0", "-1")],
    *[(tool, ["TMP/good.json", "--top", "0"], 2, "argument --top: must be > 0")
      for tool in ("idle", "waits", "launchers")],
    ("launchers", ["TMP/good.json", "--frames", "a["], 2, "argument --frames: 'a[' is not a valid regular expression"),
    ("launchers", ["TMP/good.json", "--classes", "gemm,gems"], 2, "--classes names 'gems', not a kernel class"),
    ("timeline", ["TMP/good.json", "--step-ms", "nan"], 2, "argument --step-ms: must be > 0, got nan"),
    ("timeline", ["TMP/good.json", "--step-ms", "-1"], 2, "argument --step-ms: must be > 0, got -1"),
    ("waits", ["TMP/good.json", "--min-us", "nan"], 2, "argument --min-us: must be >= 0, got nan"),
    ("waits", ["TMP/good.json", "--min-us", "0"], 0, ""),
    ("hostdiff", ["TMP/good.json", "TMP/sp ö/t r.json"], 0, ""),
    ("hostdiff", ["TMP/good.json", "TMP/fifo"], 2, "is a named pipe, not a regular file"),
    ("hostdiff", ["TMP/good.json", "TMP/nan.json"], 2, "has ts nan"),
    ("hostdiff", ["TMP/good.json", "TMP/good.json", "--top", "-1"], 2, "argument --top: must be > 0"),
    ("hostdiff", ["TMP/good.json", "TMP/good.json", "--under", "("], 2,
     "argument --under: '(' is not a valid regular expression"),
    ("hostdiff", ["TMP/good.json", "TMP/good.json", "--match", "a["], 2,
     "argument --match: 'a[' is not a valid regular expression"),
    # memtrace is read by the benchmark's workers: run by hand, it says so instead of passing silently.
    ("memtrace", ["TMP/good.json"], 2, "hfsdp.trace.memtrace has no command line"),
]


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    (tmp_path / "sp ö").mkdir()
    for name, text in TRACES.items():
        (tmp_path / name).write_text(text)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    return tmp_path


@pytest.mark.parametrize(("tool", "args", "rc", "says"), TRACE_ROWS,
                         ids=[f"{t}:{' '.join(a).replace('TMP/', '')}" for t, a, _, _ in TRACE_ROWS])
def test_trace_reader_row(tool, args, rc, says, traces, call_cli):
    argv = [a.replace("TMP", str(traces)) for a in args]
    if argv[0] == f"{traces}/":
        argv[0] = f"{traces}/absent.json"
    rc_got, said = call_cli(trace_tool(tool), argv)  # a named pipe would hang here if it were opened
    assert "Traceback" not in said, said[-3000:]
    assert rc_got == rc, (rc_got, said[-3000:])
    assert says in said, said[-3000:]
