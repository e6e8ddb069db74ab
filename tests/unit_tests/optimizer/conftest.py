"""Fixtures shared by the optimizer tests."""

from collections.abc import Callable

import pytest
import torch


@pytest.fixture
def step_fails(monkeypatch: pytest.MonkeyPatch) -> Callable[[torch.optim.Optimizer, list[torch.Tensor]], None]:
    """``step_fails(opt, params)``: torch's AdamW step raises inside ``opt.step()``; the parameter
    list ``opt`` showed it must be back in its first group afterwards."""

    def run(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        def boom(self, closure=None):
            raise RuntimeError("boom")

        monkeypatch.setattr(torch.optim.AdamW, "step", boom)
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        assert opt.param_groups[0]["params"] == params

    return run


class PairBuffer:
    """A Megatron-FSDP ParamAndGradBuffer as adam_model_writes sees it: its (model, main) pairs, one
    list object while its storage stays, and the record an optimizer hands it."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = pairs
        self.model_weight_writes = None

    def main_to_model_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.pairs


@pytest.fixture
def pair_buffer() -> type[PairBuffer]:
    return PairBuffer
