"""The explicit FSDP-unit override (HFSDP_FSDP_UNIT_MODULES) used to emulate 0.18.2 checkpoints."""

from __future__ import annotations

import pytest

from hfsdp.training import fsdp_units


def test_preset_matches_0_18_2_rule() -> None:
    assert fsdp_units.describe_units("megatron-0.18.2", "optim_grads_params") == ["TransformerLayer"]
    assert fsdp_units.describe_units("megatron-0.18.2", "optim_grads") == []
    assert fsdp_units.describe_units("none", "optim_grads_params") == []
    assert fsdp_units.unit_resolver("") is None and fsdp_units.unit_resolver(None) is None


def test_explicit_class_list_and_bad_paths() -> None:
    got = fsdp_units.describe_units("collections.OrderedDict, fractions.Fraction", "no_shard")
    assert got == ["OrderedDict", "Fraction"]
    with pytest.raises(ValueError, match="does not name a class"):
        fsdp_units.unit_resolver("os.path.join")("optim_grads_params")


def test_override_is_the_trees_unit_rule_and_the_adapter_asks_it() -> None:
    """The override sets the tree's rule (no class swap); the adapter takes its units from that
    rule when its caller names none, and the tree holds the one default list."""
    import collections
    import fractions

    from megatron.core.distributed.fsdp import fsdp_units as tree

    try:
        assert fsdp_units.install_unit_override("fractions.Fraction") == ["fractions.Fraction"]
        assert tree.unit_modules("optim_grads_params") == [fractions.Fraction]
        fsdp_units.install_unit_override("collections.OrderedDict")  # replaces, not stacks
        assert tree.unit_modules("no_shard") == [collections.OrderedDict]
        assert fsdp_units.install_unit_override("") is None
        assert tree.unit_modules("optim_grads_params") == [collections.OrderedDict]
    finally:
        tree.set_unit_modules_override(None)
    names = [c.__name__ for c in tree.unit_modules("optim_grads_params")]
    assert names == ["TransformerLayer", "MoETransformerLayer", "MambaLayer"]
    assert tree.unit_modules("optim_grads") == []
    assert fsdp_units.default_unit_paths() == tree.DEFAULT_UNIT_MODULES
    import inspect

    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    source = inspect.getsource(mcore_fsdp_adapter.FullyShardedDataParallel.__init__)
    assert "fsdp_units.unit_modules(" in source and "MambaLayer" not in source
    assert "megatron_FSDP" not in inspect.getsource(fsdp_units)  # no module-global swap any more


# Units per model chunk from the flags ([Note: FSDP units from the flags]) -----------------------

HYBRID = ("--hybrid-layer-pattern M*EM*E --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
          "--num-experts 4 --moe-ffn-hidden-size 48 --moe-router-topk 2 --mamba-num-heads 4 --mamba-head-dim 32 "
          "--mamba-num-groups 2 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 1 --bf16 "
          "--normalization RMSNorm --no-persist-layer-norm --position-embedding-type none --transformer-impl local "
          "--disable-mamba-mem-eff-path --no-gradient-accumulation-fusion --use-megatron-fsdp "
          "--data-parallel-sharding-strategy optim_grads_params --use-distributed-optimizer --ckpt-format "
          "fsdp_dtensor --tokenizer-type NullTokenizer --vocab-size 1000 --mock-data").split()
GPT = [a for a in HYBRID if a not in ("--disable-mamba-mem-eff-path",)]
GPT[GPT.index("--hybrid-layer-pattern"):GPT.index("--hybrid-layer-pattern") + 2] = ["--num-layers", "4"]
UNTIED = ["--untie-embeddings-and-output-weights"]


def _with(flags: list[str], **values: str) -> list[str]:
    out = list(flags)
    for dest, value in values.items():
        flag = "--" + dest.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


@pytest.mark.parametrize(("flags", "units", "chunk"), [
    (HYBRID, None, ""),
    (HYBRID, "megatron-0.18.2", ""),
    (_with(GPT), None, ""),
    (_with(GPT, num_experts="4"), None, ""),
    # (untied: the planner cannot build tied embeddings across pipeline stages without a GPU)
    (_with(GPT, pipeline_model_parallel_size="2") + UNTIED, None, "pipeline stage 1 of 2"),
    (_with(GPT, pipeline_model_parallel_size="2", decoder_first_pipeline_num_layers="1") + UNTIED, None,
     "pipeline stage 1 of 2"),
    (_with(HYBRID, hybrid_layer_pattern="M*|EM*E", pipeline_model_parallel_size="2") + UNTIED, None,
     "pipeline stage 1 of 2"),
    (_with(HYBRID, hybrid_layer_pattern="M|*|E|M", pipeline_model_parallel_size="2") + UNTIED, None,
     "pipeline stage 1 of 2, virtual stage 1 of 2"),
])
def test_the_rule_counts_the_units_the_planner_finds(flags, units, chunk):
    """The planner builds the model chunk of pipeline stage 1 on the meta device and counts its
    units with Megatron-FSDP's own discovery; the rule reads the same number off the flags."""
    from hfsdp.planner import cli, setup

    argv = [*flags, "--plan-dp-size", "1", *(["--fsdp-unit-modules", units] if units else [])]
    args = setup.parse(setup.model_argv(argv))
    counts = fsdp_units.units_per_chunk(args, units)
    assert counts is not None and chunk in counts, counts
    layout, _ = cli.plan_from_args(args)
    assert counts[chunk] == len(layout.units) > 0


@pytest.mark.parametrize(("extra", "units", "expected"), [
    (["--megatron-fsdp-max-pool-lanes", "7"], None, "--megatron-fsdp-max-pool-lanes asks for 7 lanes, more than "
     "the 6 FSDP units of this model chunk, so 1 lane(s) would hold no unit; use at most 6 lanes."),
    (["--megatron-fsdp-max-pool-lanes", "6"], None, None),
    (["--megatron-fsdp-max-pool-lanes", "5"], "megatron-0.18.2", "more than the 4 FSDP units"),
    (["--megatron-fsdp-max-pool-lanes", "1000"], "none", None),  # no units: no pools
    (["--megatron-fsdp-max-pool-lanes", "1000"], "fractions.Fraction", None),  # classes of the user's: not told
    (["--megatron-fsdp-max-pool-lanes", "4", "--hybrid-layer-pattern", "M*E|M*E|M*|E",
      "--pipeline-model-parallel-size", "2"], None, "[pipeline stage 2 of 2, virtual stage 2 of 2] "
     "--megatron-fsdp-max-pool-lanes asks for 4 lanes, more than the 1 FSDP units"),
    (["--megatron-fsdp-max-pool-lanes", "4", "--hybrid-layer-pattern", "M*EM/*E"], None, None),  # MTP chunk left out
])
def test_lanes_problem_names_the_chunk_with_the_fewest_units(extra, units, expected):
    from hfsdp.planner import setup

    args = setup.parse(setup.model_argv([*HYBRID, "--megatron-fsdp-max-pool-double-buffer", *extra]))
    problem = fsdp_units.lanes_problem(args, units)
    assert problem == expected if expected is None or expected.endswith(".") else expected in (problem or ""), problem
