"""The planner's first line: which model it plans, at which data-parallel size, in sentences."""

from __future__ import annotations

import pytest

from hfsdp.planner import setup


def note(*user: str) -> str:
    return setup.plan_note(user, setup.parse_flags(setup.model_argv(user)))


def test_the_default_model_names_its_shape_and_the_data_parallel_size():
    text = note("--plan-dp-size", "2")
    assert text.startswith("planning the default model (hybrid layers M*EM*EM*EM*E, hidden size 1024, 16 experts;")
    assert "for data-parallel size 2." in text
    # A value is no flag: "--plan-dp-size 2" replaces nothing of the default model.
    assert "Your" not in text and "your 2" not in text
    assert text.endswith("give --num-layers or --hybrid-layer-pattern.")


def test_replaced_defaults_are_named_once_each():
    text = note("--hidden-size", "2048", "--micro-batch-size=4", "--plan-dp-size", "4")
    assert "hidden size 2048" in text and "for data-parallel size 4." in text
    assert "Your --hidden-size, --micro-batch-size replace the default's values." in text
    assert "Your --hidden-size replaces the default's value." in note("--hidden-size", "2048")


def test_model_parallel_ranks_are_counted():
    assert "data-parallel size 4 (8 ranks with model parallelism)" in note(
        "--plan-dp-size", "4", "--tensor-model-parallel-size", "2")


def test_a_model_of_your_own_adds_no_defaults():
    text = note("--num-layers", "4", "--hidden-size", "2048")
    assert text.startswith("planning the model your flags define (4 layers, hidden size 2048) "
                           "for data-parallel size 2;")
    assert "DEFAULT_MODEL_FLAGS" not in text


@pytest.mark.parametrize("user", [(), ("--hidden-size", "2048"), ("--num-layers", "4")])
def test_the_note_is_whole_sentences(user):
    text = note(*user)
    assert text.endswith(".") and "  " not in text and "None" not in text
