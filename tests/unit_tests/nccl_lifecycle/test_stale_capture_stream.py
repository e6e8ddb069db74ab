"""FullCudaGraphWrapper enables the stale-capture-stream override before capturing.

Runs the real ``FullCudaGraphWrapper.__call__`` capture branch on CPU with the CUDA pieces
(graph, capture context, stream, barrier, synchronize) replaced by recorders, so the test sees
the order of events around capture.
"""

import logging
from typing import Any

import pytest
import torch

from megatron.core import full_cuda_graph as fcg

FEATURE = "set_override_stale_capture_stream"


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []


@pytest.fixture
def capture_env(monkeypatch):
    rec = _Recorder()

    class FakeGraph:
        def register_generator_state(self, state: Any) -> None:
            pass

        def replay(self) -> None:
            rec.events.append("replay")

    class FakeCapture:
        def __init__(self, graph: Any, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> None:
            rec.events.append("capture_begin")

        def __exit__(self, *exc: Any) -> None:
            rec.events.append("capture_end")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: rec.events.append("sync"))
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: rec.events.append("barrier"))
    monkeypatch.setattr(fcg, "get_all_rng_states", lambda: {})
    monkeypatch.setattr(fcg, "get_shared_capture_stream", lambda: "capture-stream")
    monkeypatch.setattr(fcg, "get_graph_pool", lambda single: None)
    monkeypatch.setattr(fcg, "_warned_missing_stale_stream_override", False)
    for name in ("curr_iteration", "cuda_graph", "result"):
        monkeypatch.setattr(
            fcg.FullCudaGraphWrapper,
            name,
            {"training": 0 if name == "curr_iteration" else None,
             "validation": 0 if name == "curr_iteration" else None},
        )
    return rec


def _wrapper(rec: _Recorder) -> fcg.FullCudaGraphWrapper:
    def forward_backward(**kwargs: Any) -> str:
        rec.events.append("forward_backward")
        return "loss"

    # __new__ skips StaticBufferLoader(), which creates a CUDA stream.
    wrapper = fcg.FullCudaGraphWrapper.__new__(fcg.FullCudaGraphWrapper)
    wrapper.forward_backward_func = forward_backward
    wrapper.cuda_graph_warmup_steps = 0  # capture on the first call
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
    assert ev.index("capture_begin") < ev.index("forward_backward") < ev.index("capture_end")


def test_real_api_call_succeeds():
    assert fcg.enable_stale_capture_stream_override() is True
    torch.autograd.graph.set_override_stale_capture_stream(False)  # restore process default


def test_missing_api_warns_once_and_capture_proceeds(capture_env, monkeypatch, caplog):
    monkeypatch.delattr(torch.autograd.graph, FEATURE)
    wrapper = _wrapper(capture_env)
    with caplog.at_level(logging.WARNING, logger=fcg.logger.name):
        _capture(wrapper, forward_only=False)  # training capture
        _capture(wrapper, forward_only=True)  # validation capture
        assert fcg.enable_stale_capture_stream_override() is False
    warnings = [r for r in caplog.records if FEATURE in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "pytorch/pytorch#180090" in warnings[0].getMessage()
    assert capture_env.events.count("capture_begin") == 2
