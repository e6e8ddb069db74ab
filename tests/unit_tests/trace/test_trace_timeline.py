"""CPU tests of the step-timeline reduction (hfsdp/trace/timeline.py)."""

import gzip
import importlib
import json

import pytest

from hfsdp.trace import timeline


def k(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


EVENTS = [
    k("ampere_bf16_gemm", 0, 100),                      # compute 0-100
    k("ncclDevKernel_AllGather_RING_LL", 50, 100),      # nccl 50-150: 50 hidden, 50 exposed
    k("Memcpy DtoD", 160, 10, cat="gpu_memcpy"),        # device work, not idle
    k("triton_ssd_chunk_scan", 200, 100),               # compute 200-300; idle 150-160, 170-200
    k("cudaStreamSynchronize", 120, 70, cat="cuda_runtime"),
    k("cudaLaunchKernel", 0, 5, cat="cuda_runtime"),    # not a sync
    {"ph": "i", "name": "marker", "ts": 10},            # not a span
]


def test_exposed_nccl_idle_and_syncs():
    s = timeline.summarize(EVENTS)
    assert s["kernel_window_ms"] == 0.300
    assert s["compute_busy_ms"] == 0.210
    assert s["nccl_busy_ms"] == 0.100
    assert s["exposed_nccl_ms"] == 0.050
    assert s["gpu_idle_ms"] == 0.040
    assert s["gpu_busy_ms"] == 0.260  # 0-150, 160-170, 200-300: window minus idle
    assert s["host_sync_ms"] == 0.070 and s["host_sync_calls"] == {"cudaStreamSynchronize": 1}


def test_per_step_division_and_gz_loading(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    s = timeline.summarize(timeline.load_events(str(path)), steps=2)
    assert s["per_step"] and s["exposed_nccl_ms"] == 0.025
    assert "ms/step" in timeline.format_summary(s)


def test_union_and_intersection():
    assert timeline.union([(5, 6), (0, 2), (1, 3)]) == [(0, 3), (5, 6)]
    assert timeline.intersection_length([(0, 3), (5, 6)], [(2, 5.5)]) == 1.5


def test_busy_report_names_rank_0_and_the_busiest_rank(tmp_path, capsys):
    rank0, rank1 = tmp_path / "rank0.json", tmp_path / "rank1.json"
    rank0.write_text(json.dumps({"traceEvents": EVENTS}))
    rank1.write_text(json.dumps({"traceEvents": [*EVENTS, k("ncclDevKernel_ReduceScatter", 300, 140)]}))
    assert timeline.main([str(rank0), str(rank1), "--steps", "2", "--step-ms", "0.22"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == f"GPU busy: {rank0} 0.13 ms/step; busiest {rank1} 0.20 ms/step"
    assert out[-1] == "step 0.22 ms = 1.100 x the busiest rank's GPU-busy time"


def test_kernel_classes_and_the_longest_kernels(tmp_path, capsys):
    from hfsdp.trace.kernels import kernel_class, kernel_time

    assert [kernel_class(n) for n in (
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "void multi_tensor_apply_kernel<TensorListMetadata<4>>",
        "_chunk_scan_fwd_kernel", "triton_poi_fused_add_0", "void causal_conv1d_fwd_kernel<128>",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>",
        "void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel", "Memcpy DtoD")] == [
        "nccl", "gemm", "attention", "optimizer", "triton", "triton", "conv1d", "torch elementwise",
        "transformer engine", "other"]
    classes, names = kernel_time(EVENTS, steps=2)
    assert classes == {"gemm": 0.05, "nccl": 0.05, "triton": 0.05}  # the memcpy is no kernel event
    assert names[0][1:] == (0.05, 0.5)
    trace = tmp_path / "rank0.json"
    trace.write_text(json.dumps({"traceEvents": [*EVENTS, k("ampere_bf16_gemm", 400, 100)]}))
    assert timeline.main([str(trace), "--steps", "2", "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].endswith("(ms/step): gemm 0.1, nccl 0.1, triton 0.1")
    assert out[-1].split() == ["0.10", "ms/step", "1.0", "launches", "ampere_bf16_gemm"]
    with pytest.raises(SystemExit):
        timeline.main([str(trace), "--top", "-1"])


@pytest.mark.parametrize("content, words", [
    (None, "does not exist"),
    ("folder", "is a folder"),
    ("{broken", "is not a readable Chrome trace"),
    ('{"traceEvents": 3}', "holds no list of trace events"),
    ('{"other": []}', "holds no list of trace events"),
    ('[{"ph": "X", "cat": "kernel", "name": "k", "ts": "soon", "dur": 1}]', "has ts 'soon', not a finite number"),
])
def test_a_file_that_is_no_trace_is_one_sentence(tmp_path, capsys, content, words):
    path = tmp_path / "t.json"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    assert timeline.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.parametrize("tool", ["timeline", "idle", "waits", "hostdiff"])
def test_every_trace_reader_says_what_is_wrong_with_its_file(tmp_path, capsys, tool):
    module = importlib.import_module(f"hfsdp.trace.{tool}")
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"traceEvents": EVENTS}))
    bad.write_text("{broken")
    files = [str(good), str(bad)] if tool == "hostdiff" else [str(bad)]
    assert module.main(files) == 2
    err = capsys.readouterr().err
    assert f"trace {bad} is not a readable Chrome trace" in err and "Traceback" not in err
    assert module.main([str(good)] * (2 if tool == "hostdiff" else 1)) == 0
