"""The fsdp_dtensor load's dummy optimizer step (``DistributedOptimizer._init_optimizer_states_with_dummy_values``)
creates the optimizer's state and leaves no gradient behind (patch optimizer-fsdp-dtensor-dummy-step-drops-grads).

An optimizer that reads ``decoupled_grad`` (Transformer Engine's FusedAdam under
``--use-precision-aware-optimizer``) clears only that attribute in ``zero_grad``, and Megatron-FSDP leaves
``param.grad`` alone under a full-iteration CUDA graph: the step's zero gradients, as large as the fp32 main
weight shards, stayed allocated for the whole resumed run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


class DecoupledAdamStandIn(torch.optim.Optimizer):
    """TE FusedAdam's behaviour that matters here: the step initialises every parameter's state whether or
    not it has a gradient, reads ``decoupled_grad`` (never ``grad``), and ``zero_grad`` clears
    ``decoupled_grad`` only."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 1e-3})
        self.use_decoupled_grad = True

    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                if getattr(p, "decoupled_grad", None) is not None:
                    raise AssertionError("the dummy step was given a decoupled gradient")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.decoupled_grad = None


def params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(n)) for n in (4, 0, 7)]  # one empty shard, skipped by the step


@pytest.mark.parametrize("make", [DecoupledAdamStandIn, lambda ps: torch.optim.Adam(ps, lr=1e-3)],
                         ids=["decoupled-grad optimizer", "torch Adam"])
def test_the_dummy_step_makes_state_and_leaves_no_gradient(make) -> None:
    ps = params()
    optimizer = make(ps)
    DistributedOptimizer._init_optimizer_states_with_dummy_values(SimpleNamespace(optimizer=optimizer))
    assert [p.grad for p in ps] == [None, None, None], "the dummy step left a gradient allocated"
    for p in (ps[0], ps[2]):
        assert set(optimizer.state[p]) >= {"exp_avg", "exp_avg_sq"}, f"no state for a {tuple(p.shape)} parameter"
