"""Config flags, presets and availability (CPU only)."""

from __future__ import annotations

import pytest

from hfsdp.bench import configs as C


def test_override_flags_replaces_and_appends():
    base = ["--a", "1", "--flag", "--b", "x", "y"]
    assert C.override_flags(base, ["--b", "z", "--c"]) == ["--a", "1", "--flag", "--b", "z", "--c"]
    assert C.override_flags(base, []) == base


def test_presets():
    default = C.model_flags("default")
    assert default[default.index("--hybrid-layer-pattern") + 1] == "M*E" * 4
    fill = C.model_flags("fill", ["--micro-batch-size", "2"])
    assert fill[fill.index("--hidden-size") + 1] == "4096"
    assert fill[fill.index("--micro-batch-size") + 1] == "2"
    assert fill.count("--micro-batch-size") == 1
    with pytest.raises(ValueError):
        C.model_flags("nope")


def test_realistic_preset_is_fill_with_the_fused_mamba_path():
    """The realistic preset is the fill model's shape with Mamba's fused path and Megatron's default
    gradient-accumulation fusion (the default model's --disable-mamba-mem-eff-path and
    --no-gradient-accumulation-fusion dropped), experts over up to 4 ranks, and it takes only
    Transformer Engine configurations."""
    realistic, fill = C.model_flags("realistic"), C.model_flags("fill")
    dropped = ("--disable-mamba-mem-eff-path", "--no-gradient-accumulation-fusion")
    assert all(f in fill for f in dropped)
    assert realistic == [f for f in fill if f not in dropped]
    assert C.parallel_flags("realistic", 4) == C.parallel_flags("realistic", 8) == ["--expert-model-parallel-size", "4"]
    assert C.parallel_flags("realistic", 2) == ["--expert-model-parallel-size", "2"]
    assert C.parallel_flags("realistic", 1) == C.parallel_flags("realistic", 3) == C.parallel_flags("fill", 4) == []
    assert C.preset_refusal("realistic", ["te_no_db", "te_maxpool_ub_graph"]) is None
    assert "no_db, maxpool_graph use local" in C.preset_refusal("realistic", ["te_no_db", "no_db", "maxpool_graph"])
    assert C.preset_refusal("fill", ["no_db", "te_no_db"]) is None


def test_fill80_experts_fills_an_80gb_gpu_with_parameters(tmp_path):
    """fill80_experts is the default model, deeper and with more experts: same width, sequence and
    micro-batch (so the per-layer compute of the default), 2.9-3.0B parameters whose model state
    (bf16 weights + fp32 main weights, grads and two Adam moments: 18 bytes each) takes 60-70 % of
    80 GB, leaving room for activations and the graph's pool. Its MoE dispatch flags are the
    default's, which test_default_model_is_capturable checks."""
    import io
    import json
    from contextlib import redirect_stdout

    from hfsdp.planner import cli

    flags, default = C.model_flags("fill80_experts"), C.model_flags("default")
    value = lambda fl, name: fl[fl.index(name) + 1]  # noqa: E731
    assert value(flags, "--hybrid-layer-pattern") == "M*E" * 16
    for same in ("--hidden-size", "--seq-length", "--micro-batch-size", "--moe-ffn-hidden-size",
                 "--moe-token-dispatcher-type", "--moe-expert-capacity-factor", "--moe-router-topk"):
        assert value(flags, same) == value(default, same), same
    out = tmp_path / "plan.json"
    with redirect_stdout(io.StringIO()):
        assert cli.main([*flags, "--plan-dp-size", "1", "--plan-json", str(out)]) == 0
    params = json.loads(out.read_text())["total_params"]
    assert 2.9e9 < params < 3.0e9, params
    assert 0.60 < 18 * params / 80e9 < 0.70, 18 * params / 80e9


def test_configs_flags():
    assert C.CONFIGS["no_db"].flags == ()
    assert "--fsdp-double-buffer" in C.CONFIGS["fixedpool"].flags
    assert C.MAXPOOL_FLAG in C.CONFIGS["maxpool"].flags
    assert "--use-nccl-ub" in C.CONFIGS["maxpool_ub"].flags


def test_lane_configs_are_maxpool_plus_three_lanes():
    for eager, graphed in (("maxpool", "maxpool_lanes3"), ("maxpool_graph", "maxpool_lanes3_graph")):
        base, lanes = C.CONFIGS[eager].flags, C.CONFIGS[graphed].flags
        assert [f for f in lanes if f not in (C.LANES_FLAG, "3")] == list(base), graphed
        assert lanes[lanes.index("--megatron-fsdp-max-pool-lanes") + 1] == "3"
        assert C.CONFIGS[graphed].lanes == 3 and C.CONFIGS[eager].lanes == 2
        assert C.CONFIGS[graphed].plan == "lanes"
    assert C.CONFIGS["maxpool_lanes3_graph"].graphed and not C.CONFIGS["maxpool_lanes3"].graphed
    assert C.availability("maxpool_lanes3") is None


def test_pools_from_plan_take_each_configs_figure():
    from hfsdp.bench.run import pools_from_plan

    alloc = {"maxpool_pool_bytes": 400, "fixed_pool_pool_bytes": 100, "analytic_minimum_bytes": 400,
             "lane_plans": {"3": {"pool_bytes": 275}}}
    pools = pools_from_plan({"allocators": {"weight": alloc, "grad": dict(alloc)}})
    assert pools["maxpool"] == pools["maxpool_graph"] == {"pool_bytes": 800, "analytic_minimum_bytes": 800}
    assert pools["fixedpool"]["pool_bytes"] == 200
    assert pools["maxpool_lanes3"] == pools["maxpool_lanes3_graph"] == {"pool_bytes": 550}
    assert "no_db" not in pools and "no_db_graph" not in pools
    # Only the configurations asked for; a plan without their lane count is not needed.
    only = pools_from_plan({"allocators": {"weight": {**alloc, "lane_plans": {}}}}, ["no_db", "maxpool"])
    assert only == {"maxpool": {"pool_bytes": 400, "analytic_minimum_bytes": 400}}


@pytest.mark.parametrize("nvls", ["0", "1", None])
def test_nccl_ub_configs_leave_nvls_to_the_environment(monkeypatch, nvls):
    """The product does not impose the lab's NVLS rule: user-buffer configs run whatever the
    caller set (tests/gpu scripts pin it off on shared machines)."""
    if nvls is None:
        monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NCCL_NVLS_ENABLE", nvls)
    for name in ("maxpool_ub", "maxpool_ub_graph", "maxpool"):
        assert C.availability(name) is None
    assert C.availability("unknown").startswith("unknown")


def test_te_configs_are_the_local_ones_on_te_specs():
    for name in ("no_db", "maxpool", "no_db_graph", "maxpool_graph"):
        local, te = C.CONFIGS[name], C.CONFIGS["te_" + name]
        assert te.flags == (*C.TE_FLAGS, *local.flags) and te.spec == "te" and local.spec == "local"
        assert te.plan == local.plan and te.graphed == local.graphed
    assert C.TE_COMPARISON == (*C.DEFAULT_CONFIGS, "te_no_db", "te_maxpool", "te_no_db_graph",
                               "te_maxpool_graph")
    assert C.loss_groups(["no_db", "te_maxpool", "maxpool_graph", "te_no_db"]) == {
        "no_db": ["no_db", "maxpool_graph"], "te_no_db": ["te_maxpool", "te_no_db"]}
    flags = C.override_flags(C.model_flags("default"), C.CONFIGS["te_maxpool_graph"].flags)
    assert flags[flags.index("--transformer-impl") + 1] == "transformer_engine"


def test_default_configs_are_eager_and_graphed_without_nccl_ub():
    assert C.DEFAULT_CONFIGS == ("no_db", "maxpool", "no_db_graph", "maxpool_graph")
    assert "maxpool_ub" in C.CONFIGS and "fixedpool" in C.CONFIGS
    assert [n for n in C.CONFIGS if C.CONFIGS[n].graphed] == ["maxpool_ub_graph", "no_db_graph",
                                                              "maxpool_graph", "maxpool_lanes3_graph",
                                                              "te_no_db_graph", "te_maxpool_graph",
                                                              "te_maxpool_ub_graph",
                                                              "te_maxpool_graph_bf16rs",
                                                              "te_maxpool_ub_graph_bf16rs",
                                                              "te_maxpool_ub_graph_bf16rs_fused",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_fill",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_smc",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_ppc",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_pgw",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_sclip",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_teadam",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_tenorm",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_hre",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_prev",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_bf16m",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_fp8_delayed",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_fp8_tensorwise",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_fp8_blockwise",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_fp8_delayed_pg",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_fp8_tensorwise_pg",
                                                              "te_maxpool_ub_graph_bf16rs_fused_pao_fp8_blockwise_pg",
                                                              "te_maxpool_ub_lanes3_graph_bf16rs",
                                                              "te_maxpool_ub_nosymm_graph_bf16rs",
                                                              "no_db_graph_validate",
                                                              "te_no_db_graph_validate"]
    assert C.CONFIGS["maxpool_graph"].flags[:2] == C.CONFIGS["maxpool"].flags
    nosymm = C.CONFIGS["te_maxpool_ub_nosymm_graph_bf16rs"]
    assert [f for f in nosymm.flags if f != "--disable-symmetric-registration"] == list(
        C.CONFIGS["te_maxpool_ub_graph_bf16rs"].flags)
    assert nosymm.user_buffers and nosymm.graphed and nosymm.spec == "te" and nosymm.plan == "maxpool"


def test_validate_configs_are_their_graphed_twins_with_megatrons_default_rerun_mode():
    for name in ("no_db_graph", "te_no_db_graph"):
        twin, validate = C.CONFIGS[name], C.CONFIGS[name + "_validate"]
        assert validate.flags == (*twin.flags, "--rerun-mode", "validate_results")
        assert validate.graphed and validate.spec == twin.spec and validate.plan is None
    assert C.loss_groups(["te_no_db", "te_no_db_graph_validate", "no_db", "no_db_graph_validate"]) == {
        "no_db": ["no_db", "no_db_graph_validate"],
        "te_no_db": ["te_no_db", "te_no_db_graph_validate"]}


def test_default_model_is_capturable(megatron_args):
    """The default model's MoE dispatch passes the full-iteration capture checks."""
    from megatron.training.cuda_graph_checks import cuda_graph_arg_problems

    args = megatron_args([*C.model_flags("default"), "--cuda-graph-impl", "full_iteration"])
    assert args.num_experts and args.use_megatron_fsdp, "the default model: MoE on Megatron-FSDP"
    assert cuda_graph_arg_problems(args, {}) == []


@pytest.mark.parametrize("preset", ["default", "fill"])
def test_no_db_d1_prefetches_exactly_the_next_unit(preset, tmp_path):
    """no_db_d1's AG prefetch budget (D1_UNIT_SIZE // 2 elements) ends each forward prefetch at
    a unit boundary: a unit's leading bucket groups in bucket order (an MoE layer's small
    non-expert bucket) stay below it, the whole unit reaches it. Backward (downward) order
    reaches it at the MoE unit's expert bucket, leaving the small one for its hook; the test
    pins that too, so a layout change that alters either shows up. Both presets, DP=2 and 4."""
    import io
    import json
    from contextlib import redirect_stdout

    from hfsdp.planner import cli

    budget = C.D1_UNIT_SIZE // 2
    for dp in (2, 4):
        out = tmp_path / f"plan{dp}.json"
        with redirect_stdout(io.StringIO()):
            assert cli.main(C.model_flags(preset) + ["--plan-dp-size", str(dp),
                                                     "--plan-json", str(out)]) == 0
        doc = json.loads(out.read_text())
        groups: dict = {}  # unit -> {is_expert: numel}, in bucket-id order (dicts keep order)
        for b in sorted(doc["buckets"], key=lambda b: b["bucket_id"]):
            if b["unit_id"] is not None:  # bucket groups are (unit, expert or not)
                unit = groups.setdefault(b["unit_id"], {})
                unit[b["is_expert"]] = unit.get(b["is_expert"], 0) + b["numel"]
        assert len(groups) == len(doc["units"]) > 0
        for unit_id, sizes in groups.items():
            forward = list(sizes.values())
            assert sum(forward[:-1]) < budget <= sum(forward), (preset, dp, unit_id, forward)
            backward = forward[::-1]
            assert backward[0] >= budget, (preset, dp, unit_id, backward)  # stops after one group


def test_the_bf16_reduce_scatter_rows_are_their_fp32_twins_plus_megatrons_flag():
    for name in ("te_maxpool_graph", "te_maxpool_ub_graph"):
        twin, bf16 = C.CONFIGS[name], C.CONFIGS[f"{name}_bf16rs"]
        assert bf16.flags == (*twin.flags, "--grad-reduce-in-bf16")
        assert (bf16.plan, bf16.spec, bf16.user_buffers) == (twin.plan, twin.spec, twin.user_buffers)


def test_planned_pools_plan_each_configs_gradient_dtype():
    """A configuration whose own flags change the plan (--grad-reduce-in-bf16: bf16 gradient buffers)
    gets its own planner run: its grad pool is half the fp32 one, its weight pool the same."""
    from hfsdp.bench.run import planned_pools

    pools = planned_pools(C.model_flags("default"), 4, names=["maxpool_graph", "te_maxpool_graph_bf16rs", "no_db"])
    fp32, bf16 = pools["maxpool_graph"], pools["te_maxpool_graph_bf16rs"]
    assert C.plan_flags("te_maxpool_graph_bf16rs") == ("--grad-reduce-in-bf16",) and C.plan_flags("maxpool_graph") == ()
    assert "no_db" not in pools
    # The default model's pools (docs/results.md): weights 128.08 MiB, grads 256.16 in fp32 and 128.08 in bf16.
    assert fp32["pool_bytes"] == 3 * (fp32["pool_bytes"] - bf16["pool_bytes"]) > 0
    assert bf16["analytic_minimum_bytes"] == bf16["pool_bytes"] < fp32["analytic_minimum_bytes"] == fp32["pool_bytes"]


def test_fused_configs_add_the_same_fusions_to_their_twins():
    for fused, twin in (("te_no_db_fused", "te_no_db"),
                        ("te_maxpool_ub_graph_bf16rs_fused", "te_maxpool_ub_graph_bf16rs")):
        assert C.CONFIGS[fused].flags == (*C.CONFIGS[twin].flags, *C.FUSION_FLAGS)
        assert (C.CONFIGS[fused].spec, C.CONFIGS[fused].plan, C.CONFIGS[fused].graphed) == (
            C.CONFIGS[twin].spec, C.CONFIGS[twin].plan, C.CONFIGS[twin].graphed)
    assert C.loss_groups(["te_no_db", "te_no_db_fused"]) == {"te_no_db": ["te_no_db"],
                                                               "te_no_db_fused": ["te_no_db_fused"]}


@pytest.mark.parametrize("name, twin", [
    ("maxpool_lanes3_graph", "no_db"), ("no_db_d1", "no_db"), ("te_maxpool_graph", "te_no_db"),
    ("te_maxpool_graph_bf16rs", "te_no_db_bf16rs"), ("te_maxpool_ub_nosymm_graph_bf16rs", "te_no_db_bf16rs"),
    ("te_maxpool_ub_lanes3_graph_bf16rs", "te_no_db_bf16rs"), ("te_no_db_bf16rs", "te_no_db_bf16rs"),
    # No eager twin among the configurations: held to its own repeats.
    ("te_maxpool_ub_graph_bf16rs_fused", "te_maxpool_ub_graph_bf16rs_fused"),
    ("te_maxpool_ub_graph_bf16rs_fused_pao", "te_maxpool_ub_graph_bf16rs_fused_pao"),
])
def test_losses_are_held_to_the_eager_twin_with_the_same_numerics_flags(name, twin):
    assert C.loss_baseline(name) == twin
    baseline = C.CONFIGS[twin]
    assert not baseline.graphed and not baseline.user_buffers and baseline.plan is None or twin == name
    assert set(baseline.flags) & C.NUMERICS_FLAGS == set(C.CONFIGS[name].flags) & C.NUMERICS_FLAGS


def test_every_configuration_has_a_loss_baseline_of_its_spec():
    for name, config in C.CONFIGS.items():
        assert C.CONFIGS[C.loss_baseline(name)].spec == config.spec, name


def test_step_path_configs_switch_back_one_change_each():
    """_fill, _smc, _ppc, _pgw, _sclip, _teadam, _tenorm, _hre and _prev differ from their configuration only by the
    product's diagnostic switches, named and valued as the product reads them (the product never imports the
    benchmark)."""
    from megatron.core import step_host_reads
    from megatron.core.distributed.fsdp.src.megatron_fsdp import foreach_copy, single_rank_grads
    from megatron.core.optimizer import adam_model_writes, triton_adam, triton_l2norm

    best = C.CONFIGS["te_maxpool_ub_graph_bf16rs_fused_pao"]
    fill, ppc = single_rank_grads.ZERO_GRAD_FILL_ENV, foreach_copy.PER_PARAM_ENV
    pgw, smc = foreach_copy.PER_PARAM_GRAD_WRITES_ENV, adam_model_writes.SEPARATE_COPIES_ENV
    sclip, teadam = adam_model_writes.SEPARATE_CLIP_ENV, triton_adam.TE_KERNEL_ENV
    want = {"fill": {fill}, "smc": {smc}, "ppc": {smc, ppc}, "pgw": {pgw}, "prev": {fill, smc, ppc, pgw},
            "sclip": {sclip}, "teadam": {teadam, sclip}, "hre": {step_host_reads.ENV}}
    want_env = {suffix: dict.fromkeys(switches, "1") for suffix, switches in want.items()}
    want_env["tenorm"] = {triton_l2norm.ENV: "0"}  # on by default: the switch turns it off
    assert best.env == ()
    for suffix, env in want_env.items():
        config = C.CONFIGS[f"te_maxpool_ub_graph_bf16rs_fused_pao_{suffix}"]
        assert config.flags == best.flags, suffix
        assert dict(config.env) == env, suffix


def test_realistic_1gpu_preset_is_the_realistic_model_cut_to_12_layers():
    flags = C.model_flags("realistic_1gpu")
    assert flags[flags.index("--hybrid-layer-pattern") + 1] == "M*E" * 4
    assert flags.count("--hybrid-layer-pattern") == 1 and flags[flags.index("--global-batch-size") + 1] == "2"
    realistic = C.model_flags("realistic")
    assert flags[-2:] == ["--global-batch-size", "2"]
    assert [f if f != "M*E" * 4 else "M*E" * 8 for f in flags[:-2]] == realistic
    assert C.PRESET_NEEDS["realistic_1gpu"] == C.PRESET_NEEDS["realistic"]
    assert C.parallel_flags("realistic_1gpu", 1) == []


def test_fp8_configurations_are_the_best_bf16_one_plus_a_hopper_recipe():
    best = C.CONFIGS["te_maxpool_ub_graph_bf16rs_fused_pao"].flags
    for recipe in ("delayed", "tensorwise", "blockwise"):
        flags = C.CONFIGS[f"te_maxpool_ub_graph_bf16rs_fused_pao_fp8_{recipe}"].flags
        assert flags[:len(best)] == best and flags[flags.index("--fp8-recipe") + 1] == recipe
        assert C.loss_baseline(f"te_maxpool_ub_graph_bf16rs_fused_pao_fp8_{recipe}").endswith(recipe)  # its own
    for recipe in ("delayed", "tensorwise", "blockwise"):
        pg = C.CONFIGS[f"te_maxpool_ub_graph_bf16rs_fused_pao_fp8_{recipe}_pg"].flags
        assert pg == (*C.CONFIGS[f"te_maxpool_ub_graph_bf16rs_fused_pao_fp8_{recipe}"].flags, "--fp8-param-gather")




def test_bf16_moments_config_is_the_best_one_with_megatrons_moment_dtypes(megatron_args):
    best = C.CONFIGS["te_maxpool_ub_graph_bf16rs_fused_pao"]
    bf16m = C.CONFIGS["te_maxpool_ub_graph_bf16rs_fused_pao_bf16m"]
    assert bf16m.flags == (*best.flags, *C.BF16_MOMENTS_FLAGS) and bf16m.env == ()
    assert (bf16m.spec, bf16m.plan, bf16m.graphed) == (best.spec, best.plan, best.graphed)
    # Other numbers than the best configuration's: its repeats are held to each other.
    assert C.loss_baseline(bf16m.name) == bf16m.name != C.loss_baseline(best.name)
    args = megatron_args([*C.model_flags("realistic_1gpu"), *bf16m.flags])
    assert (args.exp_avg_dtype, args.exp_avg_sq_dtype, args.use_precision_aware_optimizer) == ("bf16", "bf16", True)
