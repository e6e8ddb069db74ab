"""The capture memory report groups segments (reserved and in use) by graph pool and stream (CPU)."""

import logging
from types import SimpleNamespace

import torch

from megatron.core import full_cuda_graph_memory as mem

MIB = 2**20


def _segments():
    return [
        {"segment_pool_id": (0, 0), "stream": 0, "total_size": 100 * MIB,  # default stream
         "allocated_size": 90 * MIB},
        {"segment_pool_id": (0, 0), "stream": 0, "total_size": 20 * MIB, "allocated_size": 1 * MIB},
        {"segment_pool_id": (0, 0), "stream": 77, "total_size": 30 * MIB,  # capture stream
         "allocated_size": 4 * MIB},
        {"segment_pool_id": (1, 0), "stream": 77, "total_size": 40 * MIB,  # a graph pool
         "allocated_size": 0},
        {"segment_pool_id": (0, 0), "stream": 5, "total_size": 2 * MIB,  # a comm side stream
         "allocated_size": 2 * MIB},
    ]


def test_memory_by_place(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_snapshot", _segments)
    places = mem.memory_by_place({"default stream": 0, "capture stream": 77})
    assert places == {"graph pools": (40 * MIB, 0), "default stream": (120 * MIB, 91 * MIB),
                      "capture stream": (30 * MIB, 4 * MIB), "other streams": (2 * MIB, 2 * MIB)}
    assert list(places) == ["graph pools", "default stream", "capture stream", "other streams"]
    assert sum(r for r, _ in places.values()) == sum(s["total_size"] for s in _segments())
    assert sum(u for _, u in places.values()) == sum(s["allocated_size"] for s in _segments())


def _fake_cuda(monkeypatch, calls):
    def snapshot():
        calls.append("snapshot")
        return _segments()

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda *a: SimpleNamespace(cuda_stream=0))
    for name, value in (("memory_reserved", 192), ("memory_allocated", 150),
                        ("max_memory_reserved", 200), ("max_memory_allocated", 160)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value: v * MIB)


def test_log_line_names_every_place(monkeypatch, caplog):
    calls = []
    _fake_cuda(monkeypatch, calls)
    with caplog.at_level(logging.INFO, logger=mem.logger.name):
        mem.log_capture_memory("training", "after capture", SimpleNamespace(cuda_stream=77))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("full-iteration CUDA graph (training) after capture: reserved 192 MiB")
    for part in ("graph pools 40 (0 in use)", "default stream 120 (91 in use)",
                 "capture stream 30 (4 in use)", "other streams 2 (2 in use)",
                 "allocated 150 MiB", "peak reserved 200 MiB", "peak allocated 160 MiB"):
        assert part in line, (part, line)


def test_no_snapshot_when_info_is_off(monkeypatch, caplog):
    calls = []
    _fake_cuda(monkeypatch, calls)
    with caplog.at_level(logging.WARNING, logger=mem.logger.name):
        mem.log_capture_memory("training", "before capture", SimpleNamespace(cuda_stream=77))
    assert calls == [] and caplog.records == []
