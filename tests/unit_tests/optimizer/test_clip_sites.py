"""Megatron's two gradient-clip sites offer the coefficient to defer_clip first (patch
optimizer-clip-in-adam-update): a step that takes it leaves the gradients unscaled; otherwise Megatron scales them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core.optimizer import optimizer as mo

NORM = torch.tensor([4.0])


def config(**extra):
    return SimpleNamespace(clip_grad=1.0, grad_norm_skip_threshold=math.inf, log_num_zeros_in_grad=False,
                           use_precision_aware_optimizer=False, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False,
                           timers=None, **extra)


class Part(SimpleNamespace):
    """What the clip sites read of a Megatron optimizer (0.18.2's and 0.19.2's)."""

    def get_parameters(self):
        return [torch.zeros(3)]

    def get_main_grads_for_grad_norm(self):
        return []

    get_grads_for_grad_norm = get_main_grads_for_grad_norm

    def get_grad_stats_parallel_group(self):
        return None

    def _compute_grad_norms_by_group(self):
        self.grad_norms_by_group = {}
        return {}

    def has_grad_norm_group(self, group):
        return False

    def prepare_grads(self):
        return False

    def get_grad_norm(self):
        return NORM

    def step_with_ready_grads(self):
        return True

    def count_zeros(self):
        return 0


@pytest.fixture
def calls(monkeypatch):
    seen: dict[str, list] = {"scaled": [], "offered": []}
    monkeypatch.setattr(mo, "get_grad_norm_fp32", lambda *a, **k: NORM)
    monkeypatch.setattr(mo, "clip_grad_by_total_norm_fp32", lambda params, *a, **k: seen["scaled"].append(params))

    def defer_clip(inner, max_norm, total_norm):
        seen["offered"].append((inner, max_norm, total_norm))
        return inner == "takes it"

    monkeypatch.setattr(mo, "defer_clip", defer_clip)
    return seen


@pytest.mark.parametrize("inner", ["takes it", "does not"])
def test_clip_grad_norm_offers_the_coefficient_first(inner, calls):
    part = Part(optimizer=inner, config=config(), grad_norms_by_group={})
    assert mo.MegatronOptimizer.clip_grad_norm(part, 1.0) is NORM
    assert calls["offered"] == [(inner, 1.0, NORM)]
    assert len(calls["scaled"]) == (0 if inner == "takes it" else 1)


@pytest.mark.parametrize("inner", ["takes it", "does not"])
def test_the_chained_step_offers_each_part_its_coefficient(inner, calls):
    chained = Part(chained_optimizers=[Part(optimizer=inner, config=config(), is_stub_optimizer=False)],
                   config=config(), grad_norms_by_group={})
    assert mo.ChainedOptimizer.step(chained)[0] is True
    assert calls["offered"] == [(inner, 1.0, NORM)]
    assert len(calls["scaled"]) == (0 if inner == "takes it" else 1)
