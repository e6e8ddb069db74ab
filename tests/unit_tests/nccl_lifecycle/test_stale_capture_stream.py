"""FullCudaGraphWrapper: stale-capture-stream override and warm-up on the capture stream.

Runs the real ``FullCudaGraphWrapper.__call__`` (eager warm-up steps, the capture branch,
replays) on CPU with the CUDA pieces (graph, capture context, streams, barrier, synchronize)
replaced by recorders, so the tests see the order of events and which stream each step ran on.
"""

import logging
from typing import Any

import pytest
import torch

from megatron.core import full_cuda_graph as fcg
from megatron.core import full_cuda_graph_warmup as fcg_warmup

FEATURE = "set_override_stale_capture_stream"


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.current: Any = None  # the stream torch.cuda.current_stream() returns


class FakeStream:
    def __init__(self, name: str, rec: _Recorder) -> None:
        self.name, self.rec = name, rec

    def wait_stream(self, other: "FakeStream") -> None:
        self.rec.events.append(f"{self.name}.wait({other.name})")


@pytest.fixture
def capture_env(monkeypatch):
    rec = _Recorder()

    class FakeGraph:
        def register_generator_state(self, state: Any) -> None:
            pass

        def replay(self) -> None:
            rec.events.append("replay")

    class FakeCapture:
        def __init__(self, graph: Any, stream: Any = None, **kwargs: Any) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            rec.events.append("capture_begin")
            self.prev, rec.current = rec.current, self.stream

        def __exit__(self, *exc: Any) -> None:
            rec.current = self.prev
            rec.events.append("capture_end")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: rec.events.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: rec.events.append("empty_cache"))
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: rec.events.append("barrier"))
    monkeypatch.setattr(fcg, "get_all_rng_states", lambda: {})
    streams = {"default": FakeStream("default", rec), "capture": FakeStream("capture", rec)}
    rec.current = streams["default"]

    class StreamContext:
        def __init__(self, stream: FakeStream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            self.prev, rec.current = rec.current, self.stream

        def __exit__(self, *exc: Any) -> None:
            rec.current = self.prev

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: rec.current)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(fcg, "get_shared_capture_stream", lambda: streams["capture"])
    monkeypatch.setattr(fcg, "get_graph_pool", lambda single: None)
    monkeypatch.setattr(fcg_warmup, "_warned_missing_stale_stream_override", False)
    for name in ("curr_iteration", "cuda_graph", "result"):
        monkeypatch.setattr(
            fcg.FullCudaGraphWrapper,
            name,
            {"training": 0 if name == "curr_iteration" else None,
             "validation": 0 if name == "curr_iteration" else None},
        )
    return rec


def _wrapper(rec: _Recorder, warmup_steps: int = 0) -> fcg.FullCudaGraphWrapper:
    def forward_backward(**kwargs: Any) -> str:
        rec.events.append(f"forward_backward@{rec.current.name}")
        return "loss"

    # __new__ skips StaticBufferLoader(), which creates a CUDA stream.
    wrapper = fcg.FullCudaGraphWrapper.__new__(fcg.FullCudaGraphWrapper)
    wrapper.forward_backward_func = forward_backward
    wrapper.cuda_graph_warmup_steps = warmup_steps  # 0: capture on the first call
    wrapper.use_single_mempool = False
    return wrapper


def _capture(wrapper: fcg.FullCudaGraphWrapper, forward_only: bool) -> Any:
    return wrapper(
        model=[torch.nn.Linear(1, 1)],
        data_iterator=None,
        num_microbatches=1,
        seq_length=1,
        forward_only=forward_only,
    )


def test_override_enabled_before_capture_barrier(capture_env, monkeypatch):
    assert hasattr(torch.autograd.graph, FEATURE), "this torch should have the API"
    monkeypatch.setattr(
        torch.autograd.graph, FEATURE, lambda enabled: capture_env.events.append(f"override={enabled}")
    )
    assert _capture(_wrapper(capture_env), forward_only=False) == "loss"
    ev = capture_env.events
    assert ev.count("override=True") == 1
    assert ev.index("override=True") < ev.index("barrier") < ev.index("capture_begin")
    fb = ev.index("forward_backward@capture")
    assert ev.index("capture_begin") < fb < ev.index("capture_end")


def test_real_api_call_succeeds():
    assert fcg.enable_stale_capture_stream_override() is True
    torch.autograd.graph.set_override_stale_capture_stream(False)  # restore process default


def test_missing_api_is_said_once_at_info_and_capture_proceeds(capture_env, monkeypatch, caplog):
    """Without the override (torch 2.11) the warm-up on the capture stream covers it, so the
    one line says so at INFO: no warning that capture may fail or that torch must change."""
    monkeypatch.delattr(torch.autograd.graph, FEATURE)
    wrapper = _wrapper(capture_env)
    with caplog.at_level(logging.INFO, logger=fcg_warmup.logger.name):
        _capture(wrapper, forward_only=False)  # training capture
        _capture(wrapper, forward_only=True)  # validation capture
        assert fcg.enable_stale_capture_stream_override() is False
    lines = [r for r in caplog.records if FEATURE in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert lines[0].levelno == logging.INFO, lines[0].levelname
    assert "pytorch/pytorch#180090" in lines[0].getMessage()
    assert "warm-up steps ran on the capture stream" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    assert capture_env.events.count("capture_begin") == 2


def test_warmup_steps_run_on_the_capture_stream_in_order(capture_env):
    """Every eager warm-up step runs on the capture stream, which first waits for the caller's
    stream; the caller's stream waits for it before anything after the step, and the step's
    cache is handed back. Then capture (on the capture stream) and replays follow; nothing
    runs eagerly on the default stream."""
    wrapper = _wrapper(capture_env, warmup_steps=2)
    for _ in range(4):  # 2 warm-up steps, the capture step (capture + replay), 1 replay
        assert _capture(wrapper, forward_only=False) == "loss"
    one_warmup = ["capture.wait(default)", "forward_backward@capture", "default.wait(capture)",
                  "empty_cache"]
    ev = [e for e in capture_env.events if e not in ("sync", "barrier")]
    assert ev == one_warmup * 2 + ["capture_begin", "forward_backward@capture", "capture_end",
                                   "replay", "replay"], ev
    assert capture_env.current.name == "default", "the caller's stream must be current again"


def test_warmup_context_restores_the_stream_when_the_step_raises(capture_env):
    """A failing warm-up step leaves the caller's stream current (no half-switched state)."""
    from megatron.core.full_cuda_graph_warmup import warmup_on_capture_stream

    capture = fcg.get_shared_capture_stream()
    with pytest.raises(RuntimeError, match="boom"):
        with warmup_on_capture_stream(capture):
            assert capture_env.current is capture
            raise RuntimeError("boom")
    assert capture_env.current.name == "default"


def test_warmup_context_without_a_stream_runs_the_body_unchanged(capture_env):
    from megatron.core.full_cuda_graph_warmup import warmup_on_capture_stream

    with warmup_on_capture_stream(None):
        assert capture_env.current.name == "default"
    assert capture_env.events == []  # no stream switch, no cache release
