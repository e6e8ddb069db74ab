# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Torch Adam/AdamW (the fallback without Transformer Engine or Apex) with bounded temporaries.

[Note: chunked foreach Adam]
torch's multi-tensor ("foreach") Adam step works on every parameter of a parameter group at
once and allocates full-size temporaries for it (the denominator ``sqrt(v) + eps``): one fp32
copy of all parameters. Eager training hides this, since
the step reuses the cache the freed activations left behind. Under a full-iteration CUDA graph
the activations live in the graph's private pool, which eager code cannot use, so the step's
temporaries add their full size to reserved memory (the capture memory report shows it on the
default stream after the first graphed step).

``with_bounded_temporaries`` gives the optimizer class a ``step`` that updates each parameter
group in chunks of at most ``chunk_numel`` elements (a larger parameter is a chunk of its own),
so the temporaries of one chunk are freed and reused by the next. Every operation of the step
is elementwise, so the result is the same to the bit; only the list each foreach kernel
receives is shorter. Hyperparameters, state and ``state_dict`` are the parent's.
"""

from collections.abc import Callable, Iterator

import torch

from .torch_adam_local_shards import local_shards

# 32M elements: 128 MiB per fp32 temporary, a few kernel launches more per step.
DEFAULT_CHUNK_NUMEL = 2**25


def param_chunks(params: list[torch.Tensor], chunk_numel: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of ``params`` holding at most ``chunk_numel`` elements each."""
    if chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
    chunk: list[torch.Tensor] = []
    size = 0
    for p in params:
        if chunk and size + p.numel() > chunk_numel:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        yield chunk


def with_bounded_temporaries(
    cls: type[torch.optim.Optimizer], chunk_numel: int = DEFAULT_CHUNK_NUMEL
) -> type[torch.optim.Optimizer]:
    """A subclass of torch optimizer ``cls`` whose step works in parameter chunks."""

    class Chunked(cls):  # type: ignore[valid-type, misc]
        def step(self, closure: Callable[[], float] | None = None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            groups = self.param_groups
            saved = [group["params"] for group in groups]
            try:
                for index, params in enumerate(saved):
                    for chunk in param_chunks(params, chunk_numel):
                        with local_shards(self, chunk) as stepped:  # torch_adam_local_shards.py
                            for other, group in enumerate(groups):
                                # The parent's step walks every group: show it this chunk only.
                                group["params"] = stepped if other == index else []
                            super().step()
            finally:
                for group, params in zip(groups, saved, strict=True):
                    group["params"] = params
            return loss

    Chunked.__name__ = Chunked.__qualname__ = f"Chunked{cls.__name__}"
    return Chunked
