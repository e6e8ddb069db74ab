"""validate_args rejects CUDA-graph configurations that cannot be captured, naming the fix.

Runs Megatron's real parser and ``validate_args`` (CPU, world of 1) on the default hybrid
model's MoE and Megatron-FSDP flags.
"""


import pytest
from graph_flags import BASE, FULL

from megatron.training.cuda_graph_checks import DROP_AND_PAD_FLAGS, cuda_graph_arg_problems

MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64".split()
DROP_PAD = DROP_AND_PAD_FLAGS.split()
FLEX = [*MOE, "--moe-token-dispatcher-type", "flex"]


@pytest.fixture
def validate(megatron_validator):
    return megatron_validator(BASE, world_size=1)


def test_full_iteration_with_alltoall_drop_and_pad_is_accepted(validate):
    args = validate(FULL + MOE + ["--moe-token-dispatcher-type", "alltoall"] + DROP_PAD)
    assert args.cuda_graph_impl == "full_iteration"
    assert cuda_graph_arg_problems(args) == []


def test_full_iteration_dense_model_is_accepted(validate):
    assert validate(FULL).cuda_graph_impl == "full_iteration"


@pytest.mark.parametrize("extra, words", [
    (["--moe-token-dispatcher-type", "alltoall"], "alltoall MoE token dispatcher copies"),
    (["--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.0"],
     "alltoall MoE token dispatcher copies"),
    ([], "allgather MoE token dispatcher"),  # Megatron's default dispatcher
    (["--moe-token-dispatcher-type", "allgather"] + DROP_PAD, "allgather MoE token dispatcher"),
])
def test_full_iteration_rejects_moe_dispatch_that_syncs_with_the_host(validate, extra, words):
    with pytest.raises(ValueError) as err:
        validate(FULL + MOE + extra)
    msg = str(err.value)
    assert "CUDA graphs cannot be captured" in msg and words in msg, msg
    assert DROP_AND_PAD_FLAGS in msg, f"the message must name the flags that fix it: {msg}"


def test_full_iteration_rejects_batch_size_rampup(megatron_validator):
    """A replay runs the captured micro-batch count; ramp-up would silently train smaller batches."""
    at = BASE.index("--train-iters")  # ramp-up needs sample-based training
    samples = BASE[:at] + BASE[at + 2:] + ["--train-samples", "64"]
    ramp = ["--rampup-batch-size", "2", "2", "16", "--global-batch-size", "8"]
    validate = megatron_validator(samples, world_size=1)
    assert validate(ramp).rampup_batch_size == [2, 2, 16]  # eager: Megatron accepts it
    assert validate(FULL + ["--global-batch-size", "8"]).cuda_graph_impl == "full_iteration"
    with pytest.raises(ValueError) as err:
        validate(FULL + ramp)
    msg = str(err.value)
    assert "--rampup-batch-size" in msg and "constant --global-batch-size" in msg, msg


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_per_layer_graphs_with_megatron_fsdp_are_rejected(validate, impl):
    with pytest.raises(ValueError) as err:
        validate(["--cuda-graph-impl", impl])
    msg = str(err.value)
    assert f"--cuda-graph-impl {impl}" in msg and "--use-megatron-fsdp" in msg, msg
    assert "--cuda-graph-impl full_iteration" in msg, f"the message must name the way out: {msg}"


def test_every_problem_is_reported_at_once(megatron_args):
    problems = cuda_graph_arg_problems(megatron_args(BASE + FULL + FLEX), {})  # flex's default backend: deepep
    assert len(problems) == 1 and "flex MoE token dispatcher (deepep backend)" in problems[0], problems
    hybridep = megatron_args(BASE + FULL + FLEX + ["--moe-flex-dispatcher-backend", "hybridep"] + DROP_PAD)
    assert cuda_graph_arg_problems(hybridep, {}) == []
    assert cuda_graph_arg_problems(megatron_args(BASE + MOE), {}) == [], "no graphs, nothing to reject"


@pytest.mark.parametrize("world_size, environ, rejected", [
    (2, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    (8, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256, expandable_segments:True"}, True),
    (2, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_GRAPH_REGISTER": "0"}, False),
    (1, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, False),  # no collective captured
    (2, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
    (2, {}, False),
    # torch reads PYTORCH_ALLOC_CONF first, and the last entry of a key wins
    (2, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
    (2, {"PYTORCH_ALLOC_CONF": "expandable_segments:False",
         "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, False),
    (2, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,expandable_segments:False"}, False),
    (2, {"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:[256:1,512:2],expandable_segments:True"},
     True),
])
def test_expandable_segments_with_several_ranks_need_nccl_graph_register_off(megatron_args, world_size, environ,
                                                                             rejected):
    problems = cuda_graph_arg_problems(megatron_args(BASE + FULL, world_size=world_size), environ)
    assert bool(problems) == rejected, problems
    if rejected:
        assert "NCCL_GRAPH_REGISTER=0" in problems[0] and f"{world_size} ranks" in problems[0]
    eager = megatron_args(BASE, world_size=world_size)
    assert cuda_graph_arg_problems(eager, environ) == [], "eager runs have no graph to protect"
