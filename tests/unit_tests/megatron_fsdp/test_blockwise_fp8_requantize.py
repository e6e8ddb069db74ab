"""Blockwise-FP8 re-quantization after the optimizer step (mfsdp-blockwise-fp8-requantize-per-unit.patch), on
CPU: a double-buffered unit's weight bucket is fetched, re-quantized and freed before the next unit fetches
its own, so the pool never holds two units there; groups outside the double buffer batch as upstream does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb


class Live:
    """The weight buckets fetched and not yet freed, by unit, and the most units ever held at once."""

    def __init__(self) -> None:
        self.units: set[int] = set()
        self.most = 0

    def fetch(self, unit: int) -> None:
        self.units.add(unit)
        self.most = max(self.most, len(self.units))


class WeightBuf:
    """One parameter group's sharded model-weight buffer, as copy_main_weights_to_model_weights reads it:
    the local shard is the whole parameter (one rank), the bucket a fresh unsharded copy."""

    def __init__(self, unit: int, numel: int, live: Live) -> None:
        self.unit, self.live = unit, live
        self.data = torch.zeros(numel)
        self.is_data_distributed = True
        self.bucket_index = SimpleNamespace(size=numel)
        self.bucket: torch.Tensor | None = None

    def get_item(self, item_id: int, only_shard: bool = False) -> torch.Tensor:
        return self.data

    def locate_item_in_global_item(self, item_id: int) -> tuple[int, int]:
        return 0, self.data.numel()

    def fetch_bucket(self) -> torch.Tensor:
        if self.bucket is None:
            self.bucket = torch.full_like(self.data, float("nan"))
            self.live.fetch(self.unit)
        return self.bucket

    def get_item_from_bucket(self, bucket: torch.Tensor, item_id: int) -> torch.Tensor:
        return bucket

    def free_bucket_storage(self) -> None:
        assert self.bucket is not None, f"unit {self.unit}: freed a bucket it did not fetch"
        self.bucket = None
        self.live.units.discard(self.unit)


def buffer_of(units: int, double_buffered: bool, live: Live):
    """A ParamAndGradBuffer with one blockwise-FP8 parameter per unit, units 0..units-1."""
    torch.manual_seed(0)
    buf = object.__new__(pgb.ParamAndGradBuffer)
    buf._main_to_model_pairs = None
    buf.model_weight_writes = None
    buf.param_to_name = {}
    buf.double_buf_units = list(range(units)) if double_buffered else []
    buf.parameter_groups = []
    for unit in range(units):
        param = torch.nn.Parameter(torch.zeros(4, 3))
        data = torch.randn(12)
        main = SimpleNamespace(param_idx={param: 0}, is_data_distributed=True, data_parallel_group=None, data=data,
                               get_item=lambda item_id, only_shard=False, data=data: data)
        buf.parameter_groups.append(SimpleNamespace(
            main_weight_buffer=main, model_weight_buffer=WeightBuf(unit, 12, live), transpose_weight_buffer=None,
            is_expert_param=False, params=[param], fsdp_unit_id=unit))
    return buf


@pytest.fixture
def quantize_calls(monkeypatch):
    """fp8_quantize stood in by a copy of each main weight into its bucket slice (the shard model param),
    recording how many parameters each call quantized; every parameter counts as blockwise FP8."""
    calls: list[int] = []

    def fake_quantize(model_params, main_params, start_offsets, data_parallel_group, fsdp_shard_model_params):
        calls.append(len(model_params))
        for main, (shard, transpose) in zip(main_params, fsdp_shard_model_params, strict=True):
            assert transpose is None
            shard.copy_(main)

    monkeypatch.setattr(pgb, "fp8_quantize", fake_quantize)
    monkeypatch.setattr(pgb, "is_blockwise_float8tensor", lambda t: isinstance(t, torch.nn.Parameter))
    monkeypatch.setattr(pgb, "is_float8tensor", lambda t: False)
    return calls


def test_double_buffered_units_are_requantized_one_at_a_time(quantize_calls):
    live = Live()
    buf = buffer_of(4, double_buffered=True, live=live)
    buf.copy_main_weights_to_model_weights()
    assert live.most == 1 and live.units == set()
    assert quantize_calls == [1, 1, 1, 1]
    for pg in buf.parameter_groups:
        assert torch.equal(pg.model_weight_buffer.data, pg.main_weight_buffer.data)


def test_groups_outside_a_double_buffer_batch_as_upstream(quantize_calls):
    live = Live()
    buf = buffer_of(4, double_buffered=False, live=live)
    buf.copy_main_weights_to_model_weights()
    assert live.most == 4 and live.units == set()  # one batch under 5 GB: every bucket at once
    assert quantize_calls == [4]
    for pg in buf.parameter_groups:
        assert torch.equal(pg.model_weight_buffer.data, pg.main_weight_buffer.data)
