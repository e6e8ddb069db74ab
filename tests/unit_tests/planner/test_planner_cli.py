"""End-to-end planner on a tiny hybrid (real Megatron parser, meta-device model, no GPU)."""

from __future__ import annotations

import json

import pytest

from hfsdp.planner import cli

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


def test_lane_plans(planned):
    text, doc = planned
    for name in ("weight", "grad"):
        a = doc["allocators"][name]
        three = a["lane_plans"]["3"]
        # Tiny model is M*E x2: lane j holds the two layers of kind j, so the pool is one layer of
        # each kind, between the adjacent-pair bound and two MoE layers (the max-pool plan).
        assert a["adjacent_pair_bound_bytes"] <= three["pool_bytes"] < a["maxpool_pool_bytes"]
        assert three["homes"] == {str(u): [u % 3] for u in range(6)}
        assert sum(three["arena_numel"].values()) * (2 if name == "weight" else 4) == three["pool_bytes"]
        assert set(a["lane_plans"]) == {"3"}
    assert "[weight] 3-lane plan" in text and "[weight]   lane 2 torch.bfloat16" in text


def test_plan_lanes_flag_any_n(capsys):
    assert cli.main(TINY + ["--plan-lanes", "2,4,3"]) == 0
    text = capsys.readouterr().out
    assert text.index("2-lane plan") < text.index("4-lane plan") < text.index("3-lane plan")
    # Two lanes are today's max-pool arena plan, byte for byte.
    weight = [line for line in text.splitlines() if line.startswith("[weight]")]
    maxpool = next(line for line in weight if "max-pool arena plan :" in line).split(":")[1].split("(")[0]
    two = next(line for line in weight if "2-lane plan" in line).split(":")[1].split("(")[0]
    assert two == maxpool and "(1.000 x max-pool arena plan; 2 units live; shared" in text


@pytest.mark.parametrize("value, message", [
    ("1", "'1' is not a lane count: give whole numbers >= 2"),
    ("3,x", "'x' is not a lane count"),
])
def test_plan_lanes_bad_values(capsys, value, message):
    with pytest.raises(SystemExit) as info:
        cli.main(TINY + ["--plan-lanes", value])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_default_lanes_are_left_out_for_a_model_with_fewer_units(capsys):
    two_units = list(TINY)
    two_units[two_units.index("--hybrid-layer-pattern") + 1] = "M*"  # a Mamba and an attention unit
    assert cli.main(two_units) == 0
    assert "lane plan" not in capsys.readouterr().out
    assert cli.main(two_units + ["--plan-lanes", "2"]) == 0
    assert "[weight] 2-lane plan" in capsys.readouterr().out


def test_more_lanes_than_units_is_refused_like_the_runtime(capsys):
    assert cli.main(TINY + ["--plan-lanes", "7"]) == 2
    err = capsys.readouterr().err
    assert "--plan-lanes 7 asks for 7 lanes, more than the 6 FSDP units of this model chunk" in err
    assert "-> pass lane counts between 2 and the model's number of units" in err


def test_the_reference_example_is_planned_as_two_models(capsys, tmp_path):
    out = tmp_path / "two.json"
    assert cli.main(TINY + ["--plan-reference", "--plan-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "two models on each rank (examples/reference_kl/train.py)" in text
    models = json.loads(out.read_text())["models"]
    trained, ref = models["trained"], models["reference"]
    assert ref["weights"] == trained["weights"] > 0  # a copy of the weight shards
    assert ref["main_params"] == ref["main_grads"] == ref["optimizer"] == ref["pools"] == 0  # frozen, no pool
    assert trained["optimizer"] > 0 and trained["pools"] > 0
    assert json.loads(out.read_text())["models_total_bytes"] == trained["total"] + ref["total"]
    sums = [line for line in text.splitlines() if line.strip().startswith(("trained:", "reference:", "sum:"))]
    assert len(sums) == 3
