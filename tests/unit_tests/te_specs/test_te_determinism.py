"""The deterministic TE settings (hfsdp/te_determinism.py): one place, consistent with the
argument checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfsdp import te_determinism as D

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_environment_by_triton_choice() -> None:
    pin, cache = D.env("pin"), D.env("cache")
    assert pin["HFSDP_TRITON_PIN_AUTOTUNE"] == "1" and "TRITON_CACHE_AUTOTUNING" not in pin
    assert cache["TRITON_CACHE_AUTOTUNING"] == "1" and "HFSDP_TRITON_PIN_AUTOTUNE" not in cache
    for env in (pin, cache):
        assert env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0" and env["NCCL_ALGO"] == "Ring"
        assert env["CAUSAL_CONV1D_DETERMINISTIC"] == "1" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    with pytest.raises(AssertionError, match="unknown Triton choice"):
        D.env("fastest")  # type: ignore[arg-type]


def test_flags_as_mapping_and_argv() -> None:
    assert D.flags() == {"--deterministic-mode": True, "--attention-backend": "fused"}
    assert D.argv() == ["--deterministic-mode", "--attention-backend", "fused"]


def test_the_attention_backend_is_chosen_by_flag_never_by_environment() -> None:
    from megatron.training.te_arg_checks import ATTN_ENV

    assert not set(ATTN_ENV) & set(D.env()), "Megatron sets these from --attention-backend"


def test_the_settings_pass_the_te_argument_checks() -> None:
    from hfsdp.training.entry import megatron_parser
    from megatron.training.te_arg_checks import te_arg_problems

    flags = ["--transformer-impl", "transformer_engine", "--hybrid-layer-pattern", "M*E", *D.argv()]
    args = megatron_parser().parse_known_args(flags)[0]
    assert te_arg_problems(args, environ=D.env()) == []
    assert te_arg_problems(args, environ={}), "without the environment the checks must object"


def test_every_setting_says_why_and_is_described() -> None:
    text = D.describe()
    for s in (*D.ENV, *D.TRITON.values(), *D.FLAGS, *D.NOT_SET):
        assert len(s.why) > 40, s
        assert s.name in text, s.name


def test_docs_list_every_setting() -> None:
    doc = (REPO_ROOT / "docs/transformer-engine.md").read_text()
    for name in (*D.env(), *D.env("cache"), *D.flags()):
        assert name in doc, f"docs/transformer-engine.md does not list {name}"
