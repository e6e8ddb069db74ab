"""The NCCL message-size sweep (hfsdp/bench/collectives.py): its arithmetic, its table and its
refusals on CPU; its ranks on 2 or more GPUs (marked gpu)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from hfsdp.bench import collectives as C


def test_sizes_are_powers_of_1024_and_checked():
    assert [C.parse_size(t) for t in ("4096", "64K", "16M", "1G", "2MiB", "3mb")] == [
        4096, 64 * 2**10, 16 * 2**20, 2**30, 2 * 2**20, 3 * 2**20]
    for bad in ("0", "-1", "1T", "M", "1.5M", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a size > 0"):
            C.parse_size(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="one size more than once"):
        C.parse_sizes("1M,1024K")
    assert C.human(3 * 2**30) == "3G" and C.human(1536 * 2**10) == "1536K" and C.human(100) == "100"


def test_choices_keep_order_and_refuse_unknown_or_repeated_names():
    ops = C.parse_choices("--ops", C.OPS, "collective")
    assert ops("reduce_scatter,all_gather") == ("reduce_scatter", "all_gather")
    for bad, said in (("allgather", "--ops names 'allgather', not a collective; use all_gather, reduce_scatter"),
                      (",", "--ops names no collective; name one or more of all_gather, reduce_scatter"),
                      ("all_gather,all_gather", "--ops names all_gather more than once; name each collective once")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            ops(bad)


def test_bus_bandwidth_is_nccl_tests_convention():
    # 1 GB gathered by 4 ranks in 10 ms: algorithm bandwidth 100 GB/s, bus bandwidth 3/4 of it.
    assert C.bus_bandwidth(10**9, 0.01, 4) == pytest.approx(75.0)
    assert C.bus_bandwidth(10**9, 0.01, 2) == pytest.approx(50.0)


def test_a_size_that_does_not_shard_into_whole_elements_is_refused():
    assert C.check_case(C.Case("all_gather", "fp32", "plain", 2**20), 4) is None
    said = C.check_case(C.Case("reduce_scatter", "fp32", "plain", 4100), 4)
    assert said and "multiples of 16 bytes" in said
    assert C.check_case(C.Case("reduce_scatter", "bf16", "plain", 24), 3) is None


def test_cases_cover_every_combination_with_buffer_kinds_adjacent():
    found = C.cases(C.OPS, ("bf16",), C.BUFFERS, (2**20, 2**22))
    assert len(found) == 2 * 1 * 2 * 3
    assert [c.buffer for c in found[:3]] == list(C.BUFFERS) and len({(c.op, c.size_bytes) for c in found[:3]}) == 1


def test_table_shows_each_kind_against_plain():
    rows = [C.Row("all_gather", "fp32", "plain", 2**26, 400.0, 125.0),
            C.Row("all_gather", "fp32", "symmetric", 2**26, 300.0, 166.0),
            C.Row("reduce_scatter", "fp32", "plain", 2**26, 500.0, 100.0)]
    text = C.table(rows)
    lines = text.splitlines()
    assert "plain us (GB/s)" in lines[0] and "symmetric us (GB/s)" in lines[0] and "registered" not in lines[0]
    ag = next(line for line in lines if line.startswith("all_gather"))
    assert "400.0 (125)" in ag and "300.0 (166) 0.75x" in ag and "64M" in ag
    rs = next(line for line in lines if line.startswith("reduce_scatter"))
    assert "500.0 (100)" in rs and rs.rstrip().endswith("-")


def test_without_gpus_the_sweep_says_so_and_writes_nothing(monkeypatch, tmp_path, capsys):
    from hfsdp.launch import fit

    monkeypatch.setattr(fit, "gpu_memory", lambda *a, **k: [])
    out = tmp_path / "sweep.json"
    assert C.main(["--out-json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "this machine has 0 GPU(s) visible" in err and "2 or more NVIDIA GPUs" in err
    monkeypatch.setattr(fit, "gpu_memory", lambda *a, **k: [80 * 2**30] * 2)
    assert C.main(["--nproc", "4", "--out-json", str(out)]) == 2
    assert "--nproc 4: the sweep runs one rank per GPU, and 2 GPUs are visible" in capsys.readouterr().err
    assert C.main(["--sizes", "4100", "--out-json", str(out)]) == 2
    assert "multiples of 8 bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        C.parse(["--warmup", "0"])  # NCCL connects on first use: at least one untimed collective
    assert C.main(["--sizes", "4100", "--out-json", str(out)]) == 2
    assert "multiples of 8 bytes" in capsys.readouterr().err
    assert not out.exists()


def test_the_launcher_passes_its_choices_to_the_ranks_and_keeps_their_rows(monkeypatch, tmp_path, capsys):
    """The ranks' command line parses back to the caller's choices; their rows become the table and
    --out-json (with the command), in a folder made for it."""
    from hfsdp import proc
    from hfsdp.launch import fit

    monkeypatch.setattr(fit, "gpu_memory", lambda *a, **k: [80 * 2**30] * 4)
    seen = {}

    def ranks(cmd, **kwargs):
        args = cmd[cmd.index("hfsdp.bench.collectives") + 1:]
        seen["opts"] = C.parse(args)
        seen["nproc"] = cmd[cmd.index("--nproc-per-node") + 1]
        rows = [C.Row(c.op, c.dtype, c.buffer, c.size_bytes, 100.0 if c.buffer == "plain" else 80.0, 50.0)
                for c in C.cases(seen["opts"].ops, seen["opts"].dtypes, seen["opts"].buffers, seen["opts"].sizes)]
        with open(seen["opts"].worker_json, "w") as f:
            json.dump({"meta": {"world": 2}, "rows": [r.__dict__ for r in rows]}, f)
        return proc.GroupResult(0, False, 1.0, [], [])

    monkeypatch.setattr(proc, "run_group", ranks)
    out = tmp_path / "new" / "sweep.json"
    assert C.main(["--nproc", "2", "--sizes", "64K,1M", "--ops", "reduce_scatter", "--dtypes", "bf16",
                   "--buffers", "plain,symmetric", "--graph", "--iters", "7", "--out-json", str(out)]) == 0
    opts = seen["opts"]
    assert seen["nproc"] == "2" and opts.sizes == (64 * 2**10, 2**20) and opts.ops == ("reduce_scatter",)
    assert opts.dtypes == ("bf16",) and opts.buffers == ("plain", "symmetric") and opts.graph and opts.iters == 7
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 4 and "command" in doc["meta"]
    assert "80.0 (50) 0.80x" in capsys.readouterr().out


@pytest.mark.gpu
def test_the_sweep_runs_on_two_gpus(tmp_path, capsys):
    """Two ranks, small messages, eager and graphed: a row per case with a time and bandwidth > 0."""
    import os

    import torch

    if torch.cuda.device_count() < 2 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        pytest.skip("needs 2 GPUs, and one process (the sweep starts its own ranks)")
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        assert os.environ.get(key) == ("0" if key == "NCCL_NVLS_ENABLE" else "1"), f"{key} must keep NVLS off"
    for graph in ([], ["--graph"]):
        out = tmp_path / f"sweep{len(graph)}.json"
        assert C.main(["--nproc", "2", "--sizes", "1M,4M", "--iters", "3", "--warmup", "1",
                       "--out-json", str(out), *graph]) == 0
        doc = json.loads(out.read_text())
        assert len(doc["rows"]) == 2 * 2 * 2 * 3 and doc["meta"]["graph"] == bool(graph)
        assert all(r["time_us"] > 0 and r["bus_gbps"] > 0 for r in doc["rows"])
    assert re.search(r"\) \d+\.\d\dx", capsys.readouterr().out)  # the registered kinds against plain
