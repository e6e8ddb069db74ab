"""Device time by launching code (hfsdp.trace.launchers) on a hand-built Chrome trace."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from chrome_trace import X  # noqa: E402  (sibling helper; tests dir is on sys.path)

from hfsdp.trace import launchers

COPY = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>"
TRACE = [
    # Host thread 1: a Megatron frame around a torch frame around aten::copy_, which launches twice.
    X("python_function", "megatron/core/distributed/fsdp/x.py(10): gather", 0, 100),
    X("python_function", "torch/nn/modules/module.py(1): _call_impl", 5, 50),
    X("cpu_op", "aten::copy_", 10, 20),
    X("cuda_runtime", "cudaLaunchKernel", 12, 1, corr=1),
    X("cuda_runtime", "cudaLaunchKernel", 20, 1, corr=2),
    # After the torch frame closed: an add under the Megatron frame only.
    X("cpu_op", "aten::add_", 60, 10),
    X("cuda_runtime", "cudaLaunchKernel", 62, 1, corr=3),
    # Thread 2: a launch outside any Python frame, and one outside any cpu_op.
    X("cpu_op", "aten::mm", 200, 10, tid=2),
    X("cuda_runtime", "cudaLaunchKernel", 202, 1, tid=2, corr=4),
    X("cuda_runtime", "cudaLaunchKernel", 300, 1, tid=2, corr=5),
    # Device.
    X("kernel", COPY, 15, 4, tid=7, corr=1),
    X("kernel", COPY, 25, 6, tid=7, corr=2),
    X("kernel", "void at::native::vectorized_elementwise_kernel<CUDAFunctor_add<float>>", 70, 3, tid=7, corr=3),
    X("kernel", "nvjet_sm90_tst_256x128", 210, 20, tid=8, corr=4),
    X("kernel", "nvjet_sm90_tst_256x128", 310, 10, tid=8, corr=5),
    X("kernel", "ncclDevKernel_AllGather", 0, 50, tid=9),  # no correlation
]


def test_kernels_are_charged_to_their_launching_op_and_the_innermost_matching_frame() -> None:
    rows = launchers.attribute(TRACE)
    gather = "megatron/core/distributed/fsdp/x.py(10): gather"
    assert rows == {
        ("torch elementwise", "aten::copy_", gather): [10.0, 2.0],
        ("torch elementwise", "aten::add_", gather): [3.0, 1.0],
        ("gemm", "aten::mm", ""): [20.0, 1.0],
        ("gemm", "(no cpu_op)", ""): [10.0, 1.0],
        ("nccl", launchers.NO_LAUNCH, ""): [50.0, 1.0],
    }
    # Every kernel is charged once: the rows add up to the trace's kernel time.
    assert sum(us for us, _ in rows.values()) == pytest.approx(
        sum(e["dur"] for e in TRACE if e["cat"] == "kernel"))
    # A pattern that matches torch's frame makes it the innermost match.
    assert ("torch elementwise", "aten::copy_", "torch/nn/modules/module.py(1): _call_impl") in launchers.attribute(
        TRACE, frames="torch/|megatron/")


def test_a_child_outliving_its_parent_is_clipped() -> None:
    trace = [X("python_function", "megatron/a.py(1): f", 0, 10),
             X("cpu_op", "aten::copy_", 5, 100),  # malformed: ends after its parent
             X("cuda_runtime", "cudaLaunchKernel", 50, 1, corr=1),
             X("kernel", "k", 60, 1, tid=7, corr=1)]
    assert launchers.attribute(trace) == {("other", "(no cpu_op)", ""): [1.0, 1.0]}


def test_cli_prints_classes_largest_first_and_refuses_bad_input(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": TRACE}, f)
    assert launchers.main([str(path), "--steps", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out if not line.startswith(" ")] == [
        "nccl", "gemm", "torch elementwise"]
    assert "torch elementwise: 0.01 ms/step" in out
    copy = next(line for line in out if "aten::copy_" in line)
    assert copy.split()[:4] == ["0.01", "ms/step", "1.0", "kernels"] and copy.endswith("gather")
    assert launchers.main([str(path), "--classes", "gemm"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")] == ["gemm: 0.03 ms"]
    assert launchers.main([str(path), "--classes", "gemms"]) == 2
    assert "--classes names 'gemms', not a kernel class" in capsys.readouterr().err
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"traceEvents": [X("cpu_op", "aten::mm", 0, 1)]}))
    assert launchers.main([str(empty)]) == 2
    assert "holds no kernel events" in capsys.readouterr().err


def _brute_sites(events: list[dict], ts: float, frames: str) -> tuple[str, str]:
    """What is open at ``ts`` (start <= ts < end, each child clipped to its parent), by brute force."""
    import re

    spans = sorted(((e["ts"], e["ts"] + e["dur"], e["cat"], e["name"]) for e in events), key=lambda s: (s[0], -s[1]))
    open_: list[tuple[float, str, str]] = []
    for start, end, cat, name in spans:
        if start > ts:
            break
        while open_ and open_[-1][0] <= start:
            open_.pop()
        open_.append((min(end, open_[-1][0]) if open_ else end, cat, name))
    live = [(c, n) for end, c, n in open_ if end > ts]
    op = next((n for c, n in reversed(live) if c == "cpu_op"), launchers.NO_CPU_OP)
    frame = next((n for c, n in reversed(live) if c == "python_function" and re.search(frames, n)), "")
    return op, frame


@pytest.mark.parametrize("seed", range(20))
def test_sites_agree_with_a_brute_force_read_at_every_boundary(seed: int) -> None:
    import random
    import re

    rng = random.Random(seed)
    events: list[dict] = []

    def nest(lo: int, hi: int, depth: int) -> None:  # properly nested children, some touching their parent's ends
        t = lo
        while depth < 6 and t < hi and rng.random() < 0.7:
            start = rng.randint(t, hi)
            end = rng.randint(start, hi)
            cat = rng.choice(["cpu_op", "python_function", "user_annotation"])
            name = rng.choice(["megatron/a.py(1): f", "torch/b.py(2): g", "aten::copy_", "aten::mm"])
            events.append(X(cat, name, start, end - start))
            nest(start, end, depth + 1)
            t = end
    nest(0, 100, 0)
    times = sorted({e["ts"] for e in events} | {e["ts"] + e["dur"] for e in events} | {-1, 50, 100, 101})
    frames = r"megatron/"
    got = launchers.sites(events, times, re.compile(frames))
    assert got == {t: _brute_sites(events, t, frames) for t in times}
