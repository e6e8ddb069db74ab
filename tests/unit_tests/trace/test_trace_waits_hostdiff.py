"""Blocking-call attribution (hfsdp.trace.waits) and host-time diffs (hfsdp.trace.hostdiff)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from chrome_trace import X  # noqa: E402  (sibling helper; tests dir is on sys.path)

from hfsdp.trace import hostdiff, waits

WAIT_TRACE = [
    X("python_function", "token_dispatcher.py(284): dispatch_postprocess", 0, 3000),
    X("cpu_op", "aten::_to_copy", 10, 2900),
    X("cuda_runtime", "cudaMemcpyAsync", 100, 2000),  # [100, 2100): blocked
    X("cuda_runtime", "cudaStreamSynchronize", 5000, 400),  # under min_us: ignored
    X("cuda_runtime", "cudaLaunchKernel", 2200, 5),  # not blocking
    # Device: a long all-gather that started before the wait, a second one overlapping it on
    # another stream (wall time counts once), compute after part of it.
    X("kernel", "ncclDevKernel_AllGather_RING_LL", 0, 1500, tid=27, stream=27),  # 1400 under
    X("kernel", "ncclSymkDevKernel_AllGather_ST", 1000, 800, tid=31, stream=31),  # +300 under
    X("kernel", "ampere_gemm", 1500, 1000, tid=7, stream=7),  # 600 under
    X("gpu_memcpy", "Memcpy DtoH", 2100, 10, tid=7, stream=7),  # starts at the end: 0
    X("kernel", "ncclDevKernel_ReduceScatter_Sum_f32", 5000, 400, tid=35, stream=35),
]


def test_waits_split_by_device_class_and_charged_to_the_frame() -> None:
    r = waits.attribute(WAIT_TRACE, min_us=500)
    assert r.calls == 1 and r.wait_us == pytest.approx(2000)
    # All-gathers ran over [0, 1800) on two streams: 1700 us of the wait, counted once.
    assert dict(r.under) == pytest.approx({
        ("cudaMemcpyAsync", "nccl:AllGather"): 1700,
        ("cudaMemcpyAsync", "compute"): 600,
    })
    assert r.streams["nccl:AllGather"] == {27, 31}
    site = "token_dispatcher.py(284): dispatch_postprocess"
    assert dict(r.site_under) == pytest.approx({(site, "nccl:AllGather"): 1700, (site, "compute"): 600})
    assert dict(r.by_site) == pytest.approx(
        {("cudaMemcpyAsync", "token_dispatcher.py(284): dispatch_postprocess"): 2000})
    text = waits.format_report(r, steps=2, min_us=500)
    assert "host blocked 1.00 ms/step in 1 blocking" in text and "nccl:AllGather" in text


def test_wait_without_enclosing_event_and_device_classes() -> None:
    r = waits.attribute([X("cuda_runtime", "cudaDeviceSynchronize", 0, 1000)], min_us=10)
    assert dict(r.by_site) == {("cudaDeviceSynchronize", "(no enclosing event)"): 1000}
    assert waits.device_class({"name": "ncclSymkDevKernel_AllGather_ST", "cat": "kernel"}) == "nccl:AllGather"
    assert waits.device_class({"name": "Memset", "cat": "gpu_memset"}) == "copy"
    assert waits.device_class({"name": "ncclDevKernel_ReduceScatter_Sum_f32", "cat": "kernel"}) == "nccl:ReduceScatter"
    assert waits.device_class({"name": "ncclDevKernel_Generic_1", "cat": "kernel"}) == "nccl:other"
    # Driver-level syncs count too; an empty trace gives an empty report.
    r = waits.attribute([X("cuda_driver", "cuStreamSynchronize", 0, 900)], min_us=500)
    assert r.calls == 1 and r.wait_us == 900
    assert waits.attribute([]).calls == 0


def _frames(extra: float) -> list[dict]:
    # hook [0, 100+extra) > gather [10, 10+extra) ; recursion f > f counted once; a child
    # outliving its parent is clipped; thread 3 ran no cpu_op (background) and is skipped.
    return [
        X("cpu_op", "aten::add", 400, 1),
        X("python_function", "hook at 0x7f01", 0, 100 + extra),
        X("python_function", "gather", 10, extra),
        X("python_function", "f", 200, 50),
        X("python_function", "f", 210, 20),
        X("python_function", "g", 240, 30),  # [240, 270) inside f [200, 250): counts 10
        X("cpu_op", "aten::mm", 300, 5, tid=2),  # another thread with ops: counted
        X("python_function", "threading.py: wait", 0, 1000 + extra, tid=3),
    ]


def test_hostdiff_inclusive_recursion_and_under(tmp_path: Path, capsys) -> None:
    a, b = hostdiff.inclusive(_frames(0)), hostdiff.inclusive(_frames(30))
    assert a[0]["hook"] == 100 and b[0]["hook"] == 130  # address stripped
    assert b[0]["f"] == 50 and b[1]["f"] == 2  # recursion: time once, calls twice
    assert b[0]["g"] == 10 and b[0]["aten::mm"] == 5
    assert "threading.py: wait" not in b[0]
    assert hostdiff.inclusive(_frames(30), all_threads=True)[0]["threading.py: wait"] == 1030
    assert hostdiff.inclusive([]) == ({}, {})
    rows = hostdiff.diff_rows(a, b)
    # gather and hook both grew by 30 us; ties sort by name.
    assert [r[0] for r in rows[:2]] == ["gather", "hook"] and rows[0][2] - rows[0][1] == 30
    under = hostdiff.inclusive(_frames(30), under="^hook$")
    assert set(under[0]) == {"gather"}
    assert hostdiff.diff_rows(a, b, match="^f$") == [("f", 50, 50, 2, 2)]
    pa, pb = tmp_path / "a.json.gz", tmp_path / "b.json.gz"
    for path, evs in ((pa, _frames(0)), (pb, _frames(30))):
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": evs}, f)
    assert hostdiff.main([str(pa), str(pb), "--steps", "1", "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[1].split()[:3] == ["0.03", "0.00", "0.03"]  # gather: +30 us
