"""CPU tests of the peak live-set replay (hfsdp/trace/memtrace.py)."""

from hfsdp.trace.memtrace import MIB, categorize, format_summary, peak_live_set

POOL = [{"filename": "/x/megatron_fsdp/double_buffer/allocator.py", "name": "_arena"},
        {"filename": "/x/megatron_fsdp/param_and_grad_buffer.py", "name": "fetch_bucket"}]
TEMP = [{"filename": "/x/megatron_fsdp/param_and_grad_buffer.py", "name": "allocate"}]
ACT = [{"filename": "/usr/lib/torch/nn/functional.py", "name": "linear"},
       {"filename": "/x/megatron/core/ssm/mamba_mixer.py", "name": "forward"}]


def alloc(addr, mib, frames):
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "frames": frames}


def free(addr, completed=False):
    return {"action": "free_completed" if completed else "free_requested", "addr": addr}


def test_categories_prefer_the_pool_and_name_megatron_frames():
    assert categorize(POOL) == "max-pool arena"
    assert categorize(TEMP) == "FSDP bucket (non-pooled)"
    assert categorize(ACT) == "mamba_mixer.py:forward"
    assert categorize([]) == "other (no Megatron frame)"


def test_replay_finds_the_peak_and_its_live_set():
    trace = [
        alloc(1, 100, POOL),       # pool arena, lives forever
        alloc(2, 50, ACT),         # activation
        alloc(3, 30, TEMP),        # temp bucket
        free(3),                   # 150 live
        alloc(4, 80, ACT),         # peak: 100 + 50 + 80 = 230
        free(4), free(4, completed=True),  # completion of an already-requested free: no change
        alloc(5, 60, TEMP),        # 210 < peak
    ]
    s = peak_live_set(trace, baseline_bytes=10 * MIB)
    assert s["peak_bytes"] == 240 * MIB and s["peak_index"] == 4 and s["entries"] == 8
    cats = dict(s["categories"])
    assert cats == {"max-pool arena": 100 * MIB, "mamba_mixer.py:forward": 130 * MIB,
                    "allocated before recording (params, optimizer, ...)": 10 * MIB}
    assert s["categories"][0][0] == "mamba_mixer.py:forward"  # largest first
    assert "240.0 MiB" in format_summary(s)


def test_frees_of_blocks_allocated_before_recording_shrink_the_baseline():
    pre_free = {"action": "free_requested", "addr": 99, "size": 4 * MIB}
    s = peak_live_set([pre_free, alloc(1, 5, ACT)], baseline_bytes=10 * MIB)
    assert s["peak_bytes"] == 11 * MIB
    assert dict(s["categories"])["allocated before recording (params, optimizer, ...)"] == 6 * MIB


def test_a_full_trace_buffer_is_flagged():
    s = peak_live_set([alloc(1, 1, ACT), alloc(2, 1, ACT)], max_entries=2)
    assert s["truncated"] and format_summary(s).startswith("WARNING: trace truncated")
    assert not peak_live_set([alloc(1, 1, ACT)], max_entries=2)["truncated"]


def test_snapshot_pickle_opens_in_torchs_memory_viz(tmp_path):
    """The written file is what torch.cuda.memory._dump_snapshot writes: memory_viz reads it."""
    import pickle

    from torch.cuda import _memory_viz

    from hfsdp.trace.memtrace import write_snapshot

    entry = {"action": "alloc", "addr": 4096, "size": 2 * MIB, "stream": 0,
             "frames": [{"filename": "/x/megatron_fsdp/double_buffer/allocator.py", "name": "_arena",
                         "line": 1}]}
    snap = {"segments": [], "device_traces": [[entry, {**entry, "action": "free_requested"}]]}
    path = tmp_path / "maxpool-r0-rank0.snapshot.pickle"
    write_snapshot(snap, str(path))
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    assert loaded == snap
    text = _memory_viz.trace(loaded)
    assert "2 entries" in text and "2.0MiB" in text, text
