"""The memory planner on inconsistent model flags: one sentence naming the flag, exit status 2."""

from __future__ import annotations

import pytest

from hfsdp.planner import cli


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own usage errors
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(("argv", "expected"), [
    (["--hidden-size", "1000"], "--hidden-size 1000 is not a multiple of --num-attention-heads 16"),
    (["--num-attention-heads", "7"], "--hidden-size 1024 is not a multiple of --num-attention-heads 7"),
    (["--num-layers", "-2", "--num-attention-heads", "16", "--hidden-size", "1024", "--seq-length", "64",
      "--micro-batch-size", "1"], "--num-layers must be >= 1, got -2"),
    (["--hybrid-layer-pattern", "", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
      "--micro-batch-size", "1"], "--hybrid-layer-pattern is empty"),
    (["--hybrid-layer-pattern", "M*X", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
      "--micro-batch-size", "1"], "--hybrid-layer-pattern 'M*X' has 'X'"),
    (["--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["--num-experts", "4", "--moe-router-topk", "8"], "--moe-router-topk 8 is larger than --num-experts 4"),
    (["--plan-dp-size", "0"], "--plan-dp-size: must be > 0"),
    (["--plan-dp-size", "-1"], "--plan-dp-size: must be > 0"),
    (["--plan-align-bytes", "0"], "--plan-align-bytes: must be > 0"),
    (["--seq-length", "2048"], "Megatron rejects these flags"),  # > --max-position-embeddings 1024
    (["--mamba-num-groups", "3"], "Megatron cannot build this model: nheads must be evenly divisible by ngroups"),
])
def test_inconsistent_flags_are_one_sentence(capsys, argv, expected):
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (rc, out[-500:], err[-2000:])
    assert expected in err, err
    assert "Traceback" not in err and "AssertionError" not in err and "ZeroDivisionError" not in err


def test_one_model_flag_keeps_the_other_defaults(capsys):
    rc, out, err = run(capsys, "--hidden-size", "2048")
    assert rc == 0, err[-2000:]
    assert "FixedPool" in out and "planning the default model" in err and "--hidden-size" in err


def test_a_model_of_your_own_gets_no_defaults_and_names_what_it_lacks(capsys):
    rc, _, err = run(capsys, "--num-layers", "4", "--hidden-size", "2048")
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert "lacks --num-attention-heads, --seq-length, --micro-batch-size" in err


def test_a_layer_that_refuses_this_machine_is_one_sentence(capsys, monkeypatch):
    """The fused Mamba path without causal-conv1d: the local hybrid stack raises a ValueError while
    the model is built, which the planner says in one sentence, naming the flag that avoids it."""
    import megatron.core.ssm.mamba_mixer as mamba_mixer
    from hfsdp.planner.setup import DEFAULT_MODEL_FLAGS

    monkeypatch.setattr(mamba_mixer, "causal_conv1d_fn", None)
    argv = [f for f in DEFAULT_MODEL_FLAGS if f != "--disable-mamba-mem-eff-path"]
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (rc, out[-500:], err[-2000:])
    assert "Megatron cannot build this model: Mamba layers with use_mamba_mem_eff_path=True need the causal_conv1d" \
        in err and "--disable-mamba-mem-eff-path" in err, err
    assert "Traceback" not in err, err
