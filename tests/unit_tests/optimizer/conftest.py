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
