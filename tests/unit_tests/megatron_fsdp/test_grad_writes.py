"""Batched gradient writes into one-rank buffers ([Note: one-rank gradient groups], invariant 5), on CPU.

The reference is upstream's per-parameter path: at each write, ``copy_`` for the cycle's first
write and ``add_`` after. The batched writes must give the same buffer bit for bit, in as many
multi-tensor launches as there are dtype pairs, and write nothing before ``flush``.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp import single_rank_grads
from megatron.core.distributed.fsdp.src.megatron_fsdp.foreach_copy import PER_PARAM_GRAD_WRITES_ENV
from megatron.core.distributed.fsdp.src.megatron_fsdp.single_rank_grads import GradWrites


def held(environ=None) -> GradWrites:
    """Writes whose every parameter is held (one-rank buffers); the parameter is its main grad."""
    return GradWrites(lambda param: True, {} if environ is None else environ)

SHAPES = [(4, 3), (7,), (2, 5), (1,)]


def _views(buffer: torch.Tensor) -> list[torch.Tensor]:
    """Disjoint views of ``buffer``, one a parameter, a pad element between."""
    views, offset = [], 0
    for shape in SHAPES:
        n = int(torch.Size(shape).numel())
        views.append(buffer[offset:offset + n].view(shape))
        offset += n + 1
    return views


def _cycles(buffer_dtype: torch.dtype, writes: GradWrites | None, micro_batches: int = 3,
            flush_each: bool = True) -> torch.Tensor:
    """Two cycles of ``micro_batches`` hooks over every parameter; ``writes`` None: per parameter.
    ``flush_each`` False flushes once a cycle, so later micro-batches meet their main grads queued."""
    buffer = torch.full((sum(int(torch.Size(s).numel()) + 1 for s in SHAPES),), 7.0, dtype=buffer_dtype)
    views = _views(buffer)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        for micro_batch in range(micro_batches):
            for view in views:
                grad = torch.randn(view.shape, generator=gen).to(torch.bfloat16)
                first = micro_batch == 0
                if writes is None:
                    (view.copy_ if first else view.add_)(grad)
                else:
                    writes.write(view, view, grad, first)
            if writes is not None and flush_each:
                writes.flush()
        if writes is not None:
            writes.flush()
    return buffer


@pytest.mark.parametrize("flush_each", [True, False])
@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16])
def test_batched_writes_equal_per_parameter_writes_bit_for_bit(buffer_dtype, flush_each):
    want = _cycles(buffer_dtype, None)
    got = _cycles(buffer_dtype, held(), flush_each=flush_each)
    assert torch.equal(got, want), (got, want)
    assert torch.equal(got[4 * 3], torch.tensor(7.0, dtype=buffer_dtype)), "padding is not written"


def test_one_multi_tensor_launch_per_kind_and_nothing_before_flush(monkeypatch):
    calls = []
    real_copy, real_add = torch._foreach_copy_, torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (calls.append(("copy", len(d))), real_copy(d, s)))
    monkeypatch.setattr(torch, "_foreach_add_", lambda d, s: (calls.append(("add", len(d))), real_add(d, s)))
    writes = held()
    main = [torch.zeros(3), torch.zeros(2), torch.ones(4)]
    writes.write(main[0], main[0], torch.ones(3), True)
    writes.write(main[1], main[1], torch.ones(2), True)
    writes.write(main[2], main[2], torch.ones(4), False)
    assert not calls and torch.equal(main[0], torch.zeros(3)), "written before flush"
    writes.flush()
    assert calls == [("copy", 2), ("add", 1)]
    assert torch.equal(main[2], torch.full((4,), 2.0))
    writes.flush()
    assert len(calls) == 2, "flush empties the queue"


def test_switch_writes_at_once(monkeypatch):
    monkeypatch.setattr(torch, "_foreach_add_", lambda d, s: pytest.fail("a multi-tensor add under the switch"))
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: pytest.fail("a multi-tensor copy under the switch"))
    writes = held({PER_PARAM_GRAD_WRITES_ENV: "1"})
    main = torch.ones(3)
    writes.write(main, main, torch.full((3,), 2.0), False)
    assert torch.equal(main, torch.full((3,), 3.0)), "the switch writes at once"
    writes.write(main, main, torch.full((3,), 5.0), True)
    assert torch.equal(main, torch.full((3,), 5.0))
    writes.flush()


def test_a_main_grad_queued_again_is_written_first(monkeypatch):
    """Two writes to one main grad never share a multi-tensor launch (they would race)."""
    launches = []
    real_add = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda d, s: (launches.append(len(d)), real_add(d, s)))
    writes = held()
    main = torch.zeros(3)
    writes.write(main, main, torch.ones(3), True)
    writes.write(main, main, torch.ones(3), False)
    writes.write(main, main, torch.ones(3), False)
    writes.flush()
    assert torch.equal(main, torch.full((3,), 3.0))
    assert launches == [1, 1]


def test_large_gradients_are_written_at_once_and_the_queue_is_bounded(monkeypatch):
    monkeypatch.setattr(GradWrites, "LARGE", 8)
    monkeypatch.setattr(GradWrites, "CAP_BYTES", 40)
    writes = held()
    big = torch.zeros(8)
    writes.write(big, big, torch.ones(8), True)
    assert torch.equal(big, torch.ones(8)) and len(writes) == 0, "a large gradient is written at once"
    small = [torch.zeros(4) for _ in range(3)]
    writes.write(small[0], small[0], torch.ones(4), True)
    writes.write(small[1], small[1], torch.ones(4), True)
    assert len(writes) == 2 and torch.equal(small[0], torch.zeros(4)), "32 bytes queued, under the cap"
    writes.write(small[2], small[2], torch.ones(4), True)
    assert len(writes) == 0, "48 bytes: over the cap, written"
    assert all(torch.equal(t, torch.ones(4)) for t in small)


def test_writes_of_parameters_not_held_are_done_at_once(monkeypatch):
    """A buffer that is not held may be reduced right after its hook (no_shard and optim at DP > 1,
    hybrid FSDP): its writes must have landed by then."""
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: pytest.fail("a write of a reduced buffer queued"))
    alone, shared = torch.zeros(3), torch.zeros(3)
    writes = GradWrites(lambda param: param is alone, {})
    writes.write(shared, shared, torch.ones(3), True)
    assert torch.equal(shared, torch.ones(3)) and len(writes) == 0
    writes.write(alone, alone, torch.ones(3), True)
    assert torch.equal(alone, torch.zeros(3)) and len(writes) == 1


def test_discard_drops_what_an_interrupted_backward_left():
    writes = held()
    main = torch.zeros(3)
    writes.write(main, main, torch.ones(3), True)
    writes.discard()
    writes.flush()
    assert len(writes) == 0 and torch.equal(main, torch.zeros(3))
    writes.write(main, main, torch.ones(3), False)  # the same main grad, queued afresh
    writes.flush()
    assert torch.equal(main, torch.ones(3))


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))

    def __repr__(self) -> str:
        return self.name


def test_writes_are_done_on_the_stream_that_queued_them(monkeypatch):
    """Each hook's writes run on its gradient's stream, as upstream's per-parameter writes did: a
    write from another stream flushes the queue first, a flush runs on the queue's stream, and the
    caller's stream then waits for it."""
    log: list = []
    a, b, caller = FakeStream("a", log), FakeStream("b", log), FakeStream("caller", log)
    current = [a]
    monkeypatch.setattr(single_rank_grads, "_current_stream", lambda device: current[0])

    class OnStream:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            self.saved, current[0] = current[0], self.stream

        def __exit__(self, *exc):
            current[0] = self.saved

    monkeypatch.setattr(single_rank_grads, "_on_stream", OnStream)
    real_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (log.append(("copy", current[0].name, len(d))),
                                                               real_copy(d, s)))
    writes = held()
    mains = [torch.zeros(2) for _ in range(3)]
    writes.write(mains[0], mains[0], torch.ones(2), True)
    writes.write(mains[1], mains[1], torch.ones(2), True)
    current[0] = b
    writes.write(mains[2], mains[2], torch.ones(2), True)
    assert log == [("copy", "a", 2), ("wait", "b", "a")], "b's write flushed a's queue on a first"
    log.clear()
    current[0] = caller
    writes.flush()
    assert log == [("copy", "b", 1), ("wait", "caller", "b")]
    assert all(torch.equal(m, torch.ones(2)) for m in mains)


def test_the_cap_counts_the_scratch_an_add_widens_into(monkeypatch):
    """bf16 gradients added into fp32 main grads hold 2 bytes an element queued and 4 more in the
    scratch at the flush: 6 a element against the cap; a first write (a cast copy) holds 2."""
    monkeypatch.setattr(GradWrites, "CAP_BYTES", 40)
    writes = held()
    mains = [torch.zeros(4) for _ in range(4)]
    writes.write(mains[0], mains[0], torch.ones(4, dtype=torch.bfloat16), True)
    writes.write(mains[1], mains[1], torch.ones(4, dtype=torch.bfloat16), False)
    assert len(writes) == 2, "8 + 24 bytes: under the cap"
    writes.write(mains[2], mains[2], torch.ones(4, dtype=torch.bfloat16), False)
    assert len(writes) == 0, "8 + 24 + 24 bytes: over the cap, written"
    assert all(torch.equal(m, torch.ones(4)) for m in mains[:3])
