"""Blockwise-FP8 re-quantization after the optimizer step (mfsdp-blockwise-fp8-requantize-per-unit.patch), on
CPU: a double-buffered unit's weight bucket is fetched (as scratch: no home), re-quantized and freed before the
next unit fetches its own, so the pool never holds two units there; every rank quantizes, and so all-reduces
amaxes, with the same parameters, also a rank whose shard of a group is empty; groups outside a double buffer
batch as upstream does, closing each batch at the same group on every rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb


class Live:
    """The weight buckets fetched and not yet freed, and the most units they ever belonged to at once."""

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}  # id(weight buffer) -> unit
        self.most = 0
        self.strict: list[bool] = []

    def fetch(self, buf: WeightBuf, strict: bool) -> None:
        self.buckets[id(buf)] = buf.unit
        self.most = max(self.most, len(set(self.buckets.values())))
        self.strict.append(strict)


class WeightBuf:
    """One parameter group's sharded model-weight buffer, as copy_main_weights_to_model_weights reads it:
    this rank's shard is the whole parameter, or empty; the bucket a fresh unsharded copy."""

    def __init__(self, unit: int, numel: int, empty_shard: bool, live: Live, size: int) -> None:
        self.unit, self.live = unit, live
        self.data = torch.zeros(0 if empty_shard else numel)
        self.is_data_distributed = True
        self.bucket_index = SimpleNamespace(size=size)  # the unsharded bucket, the same on every rank
        self.bucket: torch.Tensor | None = None

    def get_item(self, item_id: int, only_shard: bool = False) -> torch.Tensor:
        return self.data

    def locate_item_in_global_item(self, item_id: int) -> tuple[int, int]:
        return 0, self.data.numel()

    def fetch_bucket(self, strict_assignments: bool = True) -> torch.Tensor:
        if self.bucket is None:
            self.bucket = torch.full_like(self.data, float("nan"))
            self.live.fetch(self, strict_assignments)
        return self.bucket

    def get_item_from_bucket(self, bucket: torch.Tensor, item_id: int) -> torch.Tensor:
        return bucket

    def free_bucket_storage(self) -> None:
        assert self.bucket is not None, f"unit {self.unit}: freed a bucket it did not fetch"
        self.bucket = None
        del self.live.buckets[id(self)]


# (unit, expert?) per parameter group: unit 1 has a dense and an expert group.
GROUPS = ((0, False), (1, False), (1, True), (2, False))


def buffer_of(double_buffered: bool, live: Live, empty: frozenset[int] = frozenset(), bucket_size: int = 12):
    """A ParamAndGradBuffer with one blockwise-FP8 parameter per group of GROUPS; ``empty``: the groups
    whose shard this rank does not hold; ``bucket_size``: each group's bucket, as its index counts it."""
    torch.manual_seed(0)
    buf = object.__new__(pgb.ParamAndGradBuffer)
    buf._main_to_model_pairs = None
    buf.model_weight_writes = None
    buf.param_to_name = {}
    buf.double_buf_units = sorted({unit for unit, _ in GROUPS}) if double_buffered else []
    buf.parameter_groups = []
    for index, (unit, expert) in enumerate(GROUPS):
        param = torch.nn.Parameter(torch.zeros(4, 3))
        data = torch.randn(0 if index in empty else 12)
        main = SimpleNamespace(param_idx={param: 0}, is_data_distributed=True, data=data,
                               data_parallel_group="expert-dp" if expert else "dp",
                               get_item=lambda item_id, only_shard=False, data=data: data)
        buf.parameter_groups.append(SimpleNamespace(
            main_weight_buffer=main, model_weight_buffer=WeightBuf(unit, 12, index in empty, live, bucket_size),
            transpose_weight_buffer=None, is_expert_param=expert, params=[param], fsdp_unit_id=unit))
    return buf


@pytest.fixture
def quantize_calls(monkeypatch):
    """fp8_quantize stood in by a copy of each main weight into its bucket slice (the shard model param),
    recording each call's group and parameter count (what TE's amax all-reduce packs); every parameter
    counts as blockwise FP8."""
    calls: list[tuple[str, int]] = []

    def fake_quantize(model_params, main_params, start_offsets, data_parallel_group, fsdp_shard_model_params):
        calls.append((data_parallel_group, len(model_params)))
        for main, (shard, transpose) in zip(main_params, fsdp_shard_model_params, strict=True):
            assert transpose is None
            if main is not None:
                shard.copy_(main)

    monkeypatch.setattr(pgb, "fp8_quantize", fake_quantize)
    monkeypatch.setattr(pgb, "is_blockwise_float8tensor", lambda t: isinstance(t, torch.nn.Parameter))
    monkeypatch.setattr(pgb, "is_float8tensor", lambda t: False)
    return calls


def requantize(double_buffered: bool, calls: list, empty: frozenset[int] = frozenset(), bucket_size: int = 12):
    live = Live()
    buf = buffer_of(double_buffered, live, empty, bucket_size)
    buf.copy_main_weights_to_model_weights()
    for pg in buf.parameter_groups:
        assert torch.equal(pg.model_weight_buffer.data, pg.main_weight_buffer.data)
    got = list(calls)
    calls.clear()
    return live, got


def test_double_buffered_units_are_requantized_one_at_a_time(quantize_calls):
    live, calls = requantize(True, quantize_calls)
    assert live.most == 1 and live.buckets == {}
    assert calls == [("dp", 1), ("dp", 1), ("expert-dp", 1), ("dp", 1)]
    assert live.strict == [False] * len(GROUPS)  # scratch fetches set no unit's home


@pytest.mark.parametrize("empty", [{1}, {0, 1}, {3}, {0, 1, 2, 3}])
def test_a_rank_with_empty_shards_quantizes_with_the_same_parameters(quantize_calls, empty):
    """The calls pair up across ranks in order (each all-reduces amaxes): the same sequence on every rank."""
    _, full = requantize(True, quantize_calls)
    live, partial = requantize(True, quantize_calls, empty=frozenset(empty))
    assert partial == full and live.most <= 1


def test_groups_outside_a_double_buffer_batch_as_upstream(quantize_calls):
    live, calls = requantize(False, quantize_calls)
    assert live.most == 3 and live.buckets == {}  # one batch under 5 GB: every bucket at once
    assert calls == [("dp", 3), ("expert-dp", 1)]


GIB = 1024**3


@pytest.mark.parametrize("empty", [{0}, {1}, {0, 2}, {0, 1, 2, 3}])
def test_batches_outside_a_double_buffer_close_at_the_same_groups_on_every_rank(quantize_calls, empty):
    """3 GiB buckets: the 5 GB batch closes after the second group on every rank, also on one whose shards of
    the first groups are empty (its batch fetched nothing there), so the amax all-reduces pair up."""
    live, full = requantize(False, quantize_calls, bucket_size=3 * GIB)
    assert full == [("dp", 2), ("dp", 1), ("expert-dp", 1)] and live.buckets == {}
    live, partial = requantize(False, quantize_calls, empty=frozenset(empty), bucket_size=3 * GIB)
    assert partial == full and live.buckets == {}
