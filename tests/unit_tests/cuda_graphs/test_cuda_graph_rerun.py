"""Full-iteration graphs turn Megatron's default result validation off, and keep an explicit mode.

Runs Megatron's real parser and ``validate_args`` (CPU, world of 1), then the rerun state
machine itself, to show what the mode changes per step: the host-synchronizing all-reduce.
"""

import warnings

import pytest
from graph_flags import BASE, FULL

from megatron.training.cuda_graph_rerun import given_on_command_line, rerun_mode_for_graphs


@pytest.fixture
def validate(megatron_validator):
    run = megatron_validator(BASE, world_size=1)

    def validate_and_warnings(extra):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args = run(extra)
        return args, [str(w.message) for w in caught if "--rerun-mode" in str(w.message)]

    return validate_and_warnings


def test_full_iteration_disables_default_validation_and_says_so(validate):
    args, said = validate(FULL)
    assert args.rerun_mode == "disabled"
    assert len(said) == 1 and "Setting --rerun-mode to disabled" in said[0], said


def test_eager_training_keeps_megatrons_default(validate):
    args, said = validate([])
    assert args.rerun_mode == "validate_results"
    assert said == []


@pytest.mark.parametrize("spelling", [["--rerun-mode", "validate_results"],
                                      ["--rerun-mode=validate_results"]])
def test_explicit_validate_results_is_kept_with_its_cost_named(validate, spelling):
    args, said = validate(FULL + spelling)
    assert args.rerun_mode == "validate_results"
    assert len(said) == 1 and "host sync per step" in said[0] and "--rerun-mode disabled" in said[0], said


def test_explicit_report_stats_is_kept_with_its_cost_named(validate):
    args, said = validate(FULL + ["--rerun-mode", "report_stats"])
    assert args.rerun_mode == "report_stats"
    assert len(said) == 1 and "--rerun-mode report_stats" in said[0] and "host sync per step" in said[0], said


def test_explicit_disabled_is_silent(validate):
    args, said = validate(FULL + ["--rerun-mode", "disabled"])
    assert args.rerun_mode == "disabled"
    assert said == []


def test_given_on_command_line_matches_whole_flags_only():
    assert given_on_command_line("--rerun-mode", ["--x", "--rerun-mode", "disabled"])
    assert given_on_command_line("--rerun-mode", ["--rerun-mode=disabled"])
    assert not given_on_command_line("--rerun-mode", ["--rerun-modes", "x", "--rerun-mode-x=1"])
    assert not given_on_command_line("--rerun-mode", [])


def test_the_hook_reports_what_it_did_without_a_distributed_world(megatron_args):
    said: list[str] = []
    args = megatron_args(BASE + FULL)
    assert args.rerun_mode == "validate_results"  # Megatron's default
    assert rerun_mode_for_graphs(args, said.append, argv=[]) == said[0]
    assert args.rerun_mode == "disabled"
    assert rerun_mode_for_graphs(args, said.append, argv=[]) is None and len(said) == 1


def _step_collectives(mode, monkeypatch):
    """All-reduces one training step's rerun loop issues in ``mode`` (CPU, reduce stubbed)."""
    import torch

    from megatron.core import rerun_state_machine as rsm

    machine = rsm.RerunStateMachine(mode=rsm.RerunMode(mode))
    calls: list[object] = []

    def fake_reduce_any(value):
        calls.append(value)  # the real one all-reduces on the GPU and reads the result back
        return False if not isinstance(value, list) else tuple(False for _ in value)

    monkeypatch.setattr(machine, "_reduce_any", fake_reduce_any)
    monkeypatch.setattr(machine, "_save_state", lambda: None)  # RNG snapshot (CUDA) for replays
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    passes = 0
    while machine.should_run_forward_backward(None):
        passes += 1
    return passes, calls


def test_disabled_mode_drops_the_per_step_reduce_and_keeps_one_pass(monkeypatch):
    # What the flip buys: validate_results reduces (and syncs) after every forward-backward;
    # disabled runs the same single pass with no collective.
    validating = _step_collectives("validate_results", monkeypatch)
    disabled = _step_collectives("disabled", monkeypatch)
    assert validating[0] == disabled[0] == 1, (validating, disabled)
    assert len(validating[1]) >= 1, validating
    assert disabled[1] == [], disabled
