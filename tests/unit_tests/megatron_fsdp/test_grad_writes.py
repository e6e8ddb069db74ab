"""Batched gradient writes into one-rank buffers ([Note: one-rank gradient groups], invariant 5), on CPU.

The reference is upstream's per-parameter path: at each write, ``copy_`` for the cycle's first
write and ``add_`` after. The batched writes must give the same buffer bit for bit, in as many
multi-tensor launches as there are dtype pairs, and write nothing before ``flush``.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp.foreach_copy import PER_PARAM_GRAD_WRITES_ENV
from megatron.core.distributed.fsdp.src.megatron_fsdp.single_rank_grads import GradWrites

SHAPES = [(4, 3), (7,), (2, 5), (1,)]


def _views(buffer: torch.Tensor) -> list[torch.Tensor]:
    """Disjoint views of ``buffer``, one a parameter, a pad element between."""
    views, offset = [], 0
    for shape in SHAPES:
        n = int(torch.Size(shape).numel())
        views.append(buffer[offset:offset + n].view(shape))
        offset += n + 1
    return views


def _cycles(buffer_dtype: torch.dtype, writes: GradWrites | None, micro_batches: int = 3) -> torch.Tensor:
    """Two cycles of ``micro_batches`` hooks over every parameter; ``writes`` None: per parameter."""
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
                    writes.write(view, grad, first)
            if writes is not None:
                writes.flush()
    return buffer


@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16])
def test_batched_writes_equal_per_parameter_writes_bit_for_bit(buffer_dtype):
    want = _cycles(buffer_dtype, None)
    got = _cycles(buffer_dtype, GradWrites({}))
    assert torch.equal(got, want), (got, want)
    assert torch.equal(got[4 * 3], torch.tensor(7.0, dtype=buffer_dtype)), "padding is not written"


def test_one_multi_tensor_launch_per_kind_and_nothing_before_flush(monkeypatch):
    calls = []
    real_copy, real_add = torch._foreach_copy_, torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (calls.append(("copy", len(d))), real_copy(d, s)))
    monkeypatch.setattr(torch, "_foreach_add_", lambda d, s: (calls.append(("add", len(d))), real_add(d, s)))
    writes = GradWrites({})
    main = [torch.zeros(3), torch.zeros(2), torch.ones(4)]
    writes.write(main[0], torch.ones(3), True)
    writes.write(main[1], torch.ones(2), True)
    writes.write(main[2], torch.ones(4), False)
    assert not calls and torch.equal(main[0], torch.zeros(3)), "written before flush"
    writes.flush()
    assert calls == [("copy", 2), ("add", 1)]
    assert torch.equal(main[2], torch.full((4,), 2.0))
    writes.flush()
    assert len(calls) == 2, "flush empties the queue"


def test_switch_writes_at_once(monkeypatch):
    monkeypatch.setattr(torch, "_foreach_add_", lambda d, s: pytest.fail("a multi-tensor add under the switch"))
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: pytest.fail("a multi-tensor copy under the switch"))
    writes = GradWrites({PER_PARAM_GRAD_WRITES_ENV: "1"})
    main = torch.ones(3)
    writes.write(main, torch.full((3,), 2.0), False)
    assert torch.equal(main, torch.full((3,), 3.0)), "the switch writes at once"
    writes.write(main, torch.full((3,), 5.0), True)
    assert torch.equal(main, torch.full((3,), 5.0))
    writes.flush()


def test_a_main_grad_queued_again_is_written_first(monkeypatch):
    """Two writes to one main grad never share a multi-tensor launch (they would race)."""
    launches = []
    real_add = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda d, s: (launches.append(len(d)), real_add(d, s)))
    writes = GradWrites({})
    main = torch.zeros(3)
    writes.write(main, torch.ones(3), True)
    writes.write(main, torch.ones(3), False)
    writes.write(main, torch.ones(3), False)
    writes.flush()
    assert torch.equal(main, torch.full((3,), 3.0))
    assert launches == [1, 1]


def test_large_gradients_are_written_at_once_and_the_queue_is_bounded(monkeypatch):
    monkeypatch.setattr(GradWrites, "LARGE", 8)
    monkeypatch.setattr(GradWrites, "CAP_BYTES", 40)
    writes = GradWrites({})
    big = torch.zeros(8)
    writes.write(big, torch.ones(8), True)
    assert torch.equal(big, torch.ones(8)) and len(writes) == 0, "a large gradient is written at once"
    small = [torch.zeros(4) for _ in range(3)]
    writes.write(small[0], torch.ones(4), True)
    writes.write(small[1], torch.ones(4), True)
    assert len(writes) == 2 and torch.equal(small[0], torch.zeros(4)), "32 bytes queued, under the cap"
    writes.write(small[2], torch.ones(4), True)
    assert len(writes) == 0, "48 bytes: over the cap, written"
    assert all(torch.equal(t, torch.ones(4)) for t in small)
