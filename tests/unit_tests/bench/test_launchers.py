"""Device time by launching code (hfsdp.bench.launchers) on a hand-built Chrome trace."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from chrome_trace import X  # noqa: E402  (sibling helper; tests dir is on sys.path)

from hfsdp.bench import launchers

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
