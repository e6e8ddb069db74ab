"""The ``megatron_args`` fixture (conftest.py): Megatron's real parse, then only fields it defines."""

import pytest


def test_flags_defaults_and_fields_come_from_megatron(megatron_args, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")  # the caller's launcher must not leak into the args
    args = megatron_args(["--cuda-graph-impl", "full_iteration"], world_size=2, rerun_mode="disabled")
    assert (args.cuda_graph_impl, args.world_size, args.rank, args.rerun_mode) == ("full_iteration", 2, 0, "disabled")
    assert megatron_args().cuda_graph_impl == "none" and megatron_args().world_size == 1  # the parser's defaults


def test_a_field_megatron_does_not_set_is_refused(megatron_args):
    with pytest.raises(TypeError, match="sets no cuda_graph_implementation"):
        megatron_args(cuda_graph_implementation="full_iteration")
    with pytest.raises(SystemExit):  # argparse: unrecognized arguments
        megatron_args(["--cuda-graph-implementation", "full_iteration"])
