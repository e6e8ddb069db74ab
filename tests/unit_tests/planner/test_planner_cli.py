"""End-to-end planner on a tiny hybrid (real Megatron parser, meta-device model, no GPU)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core.distributed.fsdp.src.megatron_fsdp.maxpool_plan")
pytest.importorskip("megatron.core.models.hybrid.hybrid_local_layer_specs")

from hfsdp.planner import cli  # noqa: E402

TINY = ("--hybrid-layer-pattern M*EM*E --hidden-size 64 --num-attention-heads 4 "
        "--ffn-hidden-size 128 --num-experts 4 --moe-ffn-hidden-size 48 --moe-router-topk 2 "
        "--mamba-num-heads 4 --mamba-head-dim 32 --mamba-num-groups 2 "
        "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --bf16 "
        "--normalization RMSNorm --no-persist-layer-norm --position-embedding-type none "
        "--transformer-impl local --disable-mamba-mem-eff-path --no-gradient-accumulation-fusion "
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
        "--use-distributed-optimizer --ckpt-format fsdp_dtensor --tokenizer-type NullTokenizer "
        "--vocab-size 1000 --mock-data").split()


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(TINY + ["--plan-json", str(out)]) == 0
    return buf.getvalue(), json.loads(out.read_text())


def test_units_follow_the_fork_default(planned):
    _, doc = planned
    assert [u["cls"] for u in doc["units"]] == [
        "MambaLayer", "TransformerLayer", "MoETransformerLayer"] * 2
    moe = [b for b in doc["buckets"] if b["unit_id"] == 2]
    assert any(b["is_expert"] for b in moe) and any(not b["is_expert"] for b in moe)
    assert all(b["numel"] % 2 == 0 and b["numel"] >= b["unpadded_numel"] for b in doc["buckets"])


def test_pool_ordering_and_fixed_pool_outliers(planned):
    text, doc = planned
    for name in ("weight", "grad"):
        a = doc["allocators"][name]
        assert a["analytic_minimum_bytes"] <= a["maxpool_pool_bytes"] <= a["rank_matched_pool_bytes"] + 2 * 256 * 4
        # Three unit shapes, two of each: FixedPool pools one pair, the other four fall out.
        assert len(a["fixed_pool_pooled_units"]) == 2
        assert len(a["fixed_pool_outlier_units"]) == 4
    assert doc["allocators"]["grad"]["maxpool_arena_numel"].keys() == {"torch.float32"}
    assert "0.18.2 FixedPool" in text and "MoETransformerLayer" in text


def test_adjacent_pair_bound(planned):
    text, doc = planned
    for name in ("weight", "grad"):
        a = doc["allocators"][name]
        # One arena that fits the largest unit next to its neighbour: more than one largest unit,
        # less than two (the MoE unit's neighbours are smaller).
        assert a["maxpool_pool_bytes"] // 2 < a["adjacent_pair_bound_bytes"] < a["maxpool_pool_bytes"]
    assert "adjacent-pair bound" in text


def test_adjacent_pair_bytes_arithmetic():
    from hfsdp.planner.report import _plan_mod, adjacent_pair_bytes

    pm = _plan_mod()
    spec = pm.BucketSpec
    # Units 0..3 of 100, 1000, 300, 50 bf16 elements; alignment 256 B = 128 elements.
    plan = pm.plan_max_pool([spec(i, i, "torch.bfloat16", n, 2) for i, n in
                             enumerate((100, 1000, 300, 50))], align_bytes=256)
    assert plan.pool_bytes() == 2 * 1000 * 2
    # Largest consecutive pair: units 1 + 2 = 1024 + 384 elements after rounding to 128.
    assert adjacent_pair_bytes(plan) == (1024 + 384) * 2
    single = pm.plan_max_pool([spec(0, 0, "torch.bfloat16", 1000, 2)], align_bytes=256)
    assert adjacent_pair_bytes(single) == 1024 * 2


def test_unit_override_0182():
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        cli.main(TINY + ["--fsdp-unit-modules", "megatron-0.18.2"])
    text = buf.getvalue()
    assert "units=4" in text  # attention + MoE layers only; Mamba layers are not units
    assert "MambaLayer" not in text.split("unit classes:")[1].splitlines()[0]


def test_three_lane_bound(planned):
    text, doc = planned
    for name in ("weight", "grad"):
        a = doc["allocators"][name]
        # Tiny model is M*E x2: one lane per layer kind, so less than two MoE units.
        assert a["adjacent_pair_bound_bytes"] <= a["three_lane_bound_bytes"] < a["maxpool_pool_bytes"]
    assert "3-lane bound" in text


def test_lane_bytes_arithmetic():
    from hfsdp.planner.report import _plan_mod, lane_bytes

    pm = _plan_mod()
    spec = pm.BucketSpec
    # Units 0..5 of 100, 50, 1000, 120, 60, 900 bf16 elements; rounding to 128 elements.
    plan = pm.plan_max_pool([spec(i, i, "torch.bfloat16", n, 2) for i, n in
                             enumerate((100, 50, 1000, 120, 60, 900))], align_bytes=256)
    assert plan.pool_bytes() == 2 * 1000 * 2
    # Lanes {0,3}: max(128, 128); {1,4}: 128; {2,5}: 1024.
    assert lane_bytes(plan, 3) == (128 + 128 + 1024) * 2
    # Two lanes by parity: {0,2,4} -> 1024, {1,3,5} -> 1024: the current pool, with each unit
    # rounded to the alignment (the current arena only rounds bucket offsets).
    assert lane_bytes(plan, 2) == 2 * 1024 * 2
    assert lane_bytes(plan, 1) == 1024 * 2
    with pytest.raises(ValueError, match="lanes must be >= 1"):
        lane_bytes(plan, 0)
