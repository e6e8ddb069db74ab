"""GPU-idle gap attribution (hfsdp.trace.idle) on a hand-built Chrome trace."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from chrome_trace import X  # noqa: E402  (sibling helper; tests dir is on sys.path)

from hfsdp.trace import idle

TRACE = [
    # Host thread 1.
    X("cpu_op", "aten::mm", 0, 10),
    X("cuda_runtime", "cudaLaunchKernel", 2, 1, corr=1),
    X("python_function", "hook", 12, 28),  # [12, 40)
    X("cpu_op", "aten::item", 14, 16),  # [14, 30)
    X("cuda_runtime", "cudaMemcpyAsync", 15, 14),  # [15, 29): blocked
    X("cuda_runtime", "cudaLaunchKernel", 32, 1, corr=2),
    X("cuda_runtime", "cudaLaunchKernel", 36, 1, corr=3),
    # Another thread, busy during the gap: must not be charged (it launched nothing).
    X("cpu_op", "other_thread_op", 20, 10, tid=2),
    # Device (stream 7).
    X("kernel", "K1", 5, 15, tid=7, corr=1),  # [5, 20)
    X("kernel", "K2", 35, 15, tid=7, corr=2),  # gap [20, 35): host launched at 32
    X("kernel", "K3", 60, 10, tid=7, corr=3),  # gap [50, 60): launched at 36, queued
    X("kernel", "K4", 80, 10, tid=7),  # gap [70, 80): no correlation
]


def test_gaps_are_classified_and_charged_to_the_launching_thread() -> None:
    r = idle.attribute(TRACE)
    assert r.gaps == 3 and r.idle_us == pytest.approx(35)
    assert dict(r.by_kind) == pytest.approx(
        {"host_late": 12, "launch_latency": 3, "queued": 10, "unknown": 10})
    assert dict(r.by_leaf) == pytest.approx({"cudaMemcpyAsync": 9, "aten::item": 1, "hook": 2})
    assert dict(r.by_op) == pytest.approx({"aten::item": 10, "(no cpu_op)": 2})
    assert dict(r.by_frame) == pytest.approx({"hook": 12})
    assert "other_thread_op" not in r.by_leaf


def test_host_time_with_no_event_is_reported() -> None:
    trace = [X("cuda_runtime", "cudaLaunchKernel", 30, 1, corr=1),
             X("kernel", "A", 0, 10, tid=7), X("kernel", "B", 40, 5, tid=7, corr=1)]
    r = idle.attribute(trace)
    # Gap [10, 40): host launched at 30; [10, 30) has no host event at all.
    assert r.by_kind["host_late"] == pytest.approx(20)
    assert r.by_leaf["(no host event)"] == pytest.approx(20)


def test_ties_and_zero_length_device_records() -> None:
    trace = [X("cuda_runtime", "cudaLaunchKernel", 1, 1, corr=1),
             X("cuda_runtime", "cudaLaunchKernel", 30, 1, corr=2),
             X("kernel", "A", 0, 10, tid=7, corr=1),
             X("gpu_memset", "Memset", 40, 2, tid=8),  # uncorrelated, starts with B
             X("kernel", "B", 40, 5, tid=7, corr=2),
             X("kernel", "blip", 20, 0, tid=7, corr=1)]  # zero length: not device work
    for order in (trace, trace[::-1]):
        r = idle.attribute(order)
        assert r.gaps == 1
        assert dict(r.by_kind) == pytest.approx({"host_late": 20, "launch_latency": 10})


def test_flatten_nested_events() -> None:
    segs = idle.flatten([X("cpu_op", "outer", 0, 10), X("cpu_op", "inner", 2, 3),
                         X("python_function", "m.py(3): f", 10, 5),
                         X("python_function", "<built-in method item>", 11, 1)])
    assert [(s.start, s.end, s.leaf, s.op, s.frame) for s in segs] == [
        (0, 2, "outer", "outer", ""), (2, 5, "inner", "inner", ""), (5, 10, "outer", "outer", ""),
        (10, 11, "m.py(3): f", "", "m.py(3): f"),
        (11, 12, "<built-in method item>", "", "m.py(3): f"),  # built-ins name no frame
        (12, 15, "m.py(3): f", "", "m.py(3): f")]


def test_cli_per_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": TRACE}, f)
    assert idle.main([str(path), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "GPU idle 0.04 ms/step in 3 gaps" in out
    assert "host_late=0.01" in out and "queued=0.01" in out
    assert "cudaMemcpyAsync" in out
