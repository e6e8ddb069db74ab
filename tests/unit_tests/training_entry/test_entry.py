"""CPU tests of our training entry points (pretrain_gpt.py / pretrain_hybrid.py, hfsdp.training).

Megatron keeps global state (args, process groups), so each scenario runs in a fresh Python
subprocess with a 1-rank gloo process group. They run against the materialized fork, guard included, on
whatever ``megatron`` is on PYTHONPATH (the materialized fork in CI, a pristine tree locally).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY = [
    "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--use-cpu-initialization", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4", "--lr", "1e-4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
]
PRELUDE = """
import os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from rendezvous import init_one_rank_gloo  # tests/unit_tests/rendezvous.py ([Note: no picked ports])
init_one_rank_gloo()
from hfsdp.training.entry import parse_args
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = (str(REPO_ROOT), str(REPO_ROOT / "tests" / "unit_tests"), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _py(body: str, timeout: int = 300) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=timeout, cwd="/")


def _megatron_has(module: str) -> bool:
    proc = subprocess.run([sys.executable, "-c", f"import importlib.util as u; "
                           f"print(u.find_spec({module!r}) is not None)"],
                          env=_env(), capture_output=True, text=True, cwd="/")
    return proc.stdout.strip() == "True"


def test_help_lists_megatron_flags() -> None:
    for script in ("pretrain_gpt.py", "pretrain_hybrid.py"):
        proc = subprocess.run([sys.executable, str(REPO_ROOT / script), "--help"], env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for flag in ("--use-megatron-fsdp", "--hybrid-layer-pattern", "--mock-data",
                     "--num-experts", "--transformer-impl", "--moe-paged-stash-buffer-size-factor-cuda",
                     *sorted(FORK_FLAGS)):  # the fork's flags, added to Megatron's parser by the series
            assert flag in proc.stdout, f"{script} --help lacks {flag}"


def test_transformer_engine_missing_is_a_clear_error() -> None:
    if _megatron_has("transformer_engine"):
        pytest.skip("transformer_engine is installed here")
    argv = [a for a in TINY if a not in ("--transformer-impl", "local")]
    proc = _py(f"""
        from hfsdp.training.specs import SpecError
        try:
            parse_args({argv!r})
        except SpecError as e:
            print("SPEC-ERROR:", e)
    """)
    assert "SPEC-ERROR:" in proc.stdout, proc.stderr[-3000:]
    assert "needs Transformer Engine (transformer_engine), which is not importable" in proc.stdout
    assert ".[te" in proc.stdout and "--transformer-impl local" in proc.stdout


@pytest.mark.parametrize("family,extra,layer_check", [
    ("gpt", [], "type(m.decoder.layers[0].mlp).__name__ == 'MLP'"),
    ("moe", ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather"],
     "type(m.decoder.layers[0].mlp).__name__ == 'MoELayer'"),
])
def test_model_provider_builds_on_cpu(family: str, extra: list[str], layer_check: str) -> None:
    proc = _py(f"""
        args, family = parse_args({TINY + extra!r})
        assert family == {family!r}, family
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(1, 1)
        from hfsdp.training.model_provider import make_model_provider
        m = make_model_provider(family)(pre_process=True, post_process=True)
        assert type(m).__name__ == "GPTModel", type(m)
        assert len(m.decoder.layers) == 2
        assert {layer_check}, m.decoder.layers[0]
        assert m.embedding.word_embeddings.weight.shape[0] == 128
        print("BUILT", sum(p.numel() for p in m.parameters()))
    """)
    assert "BUILT" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.mamba  # MambaMixer needs mamba_ssm even on CPU
def test_hybrid_provider_builds_on_cpu() -> None:
    argv = TINY + ["--hybrid-layer-pattern", "M*-", "--mamba-head-dim", "16", "--mamba-num-groups", "1",
                   "--disable-mamba-mem-eff-path"]
    proc = _py(f"""
        args, family = parse_args({argv!r}, forced_family="hybrid")
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(1, 1)
        from hfsdp.training.model_provider import make_model_provider
        import contextlib
        from unittest import mock
        # MambaMixer forks the CUDA RNG tracker at init; on CPU hand it a no-op tracker.
        tracker = mock.MagicMock()
        tracker.fork.side_effect = lambda *a, **k: contextlib.nullcontext()
        with mock.patch("torch.cuda.current_device", return_value="cpu"), \
             mock.patch("megatron.core.ssm.mamba_mixer.get_cuda_rng_tracker", return_value=tracker):
            m = make_model_provider(family)(pre_process=True, post_process=True)
        print("BUILT", type(m).__name__, [type(l).__name__ for l in m.decoder.layers])
    """)
    assert "BUILT HybridModel" in proc.stdout, proc.stderr[-3000:]
    assert "MambaLayer" in proc.stdout


def test_hybrid_without_local_spec_is_a_clear_error() -> None:
    # This tree always has the spec (a patch of the series); hide it, as a stale tree would.
    proc = _py(f"""
        sys.modules["megatron.core.models.hybrid.hybrid_local_layer_specs"] = None
        args, family = parse_args({TINY + ["--hybrid-layer-pattern", "M*-", "--disable-mamba-mem-eff-path"]!r})
        from hfsdp.training.specs import SpecError, hybrid_stack_spec
        try:
            hybrid_stack_spec(args)
        except SpecError as e:
            print("SPEC-ERROR:", e)
    """)
    assert "SPEC-ERROR:" in proc.stdout and "hybrid_local_stack_spec" in proc.stdout, proc.stderr[-3000:]


def test_mock_dataset_provider_builds_on_cpu() -> None:
    proc = _py(f"""
        args, family = parse_args({TINY!r})
        from megatron.training import get_tokenizer
        from hfsdp.training.data import build_datasets
        train, valid, test = build_datasets(args, get_tokenizer(), [8, 4, 4],
                                            is_built_on_rank=lambda: True)
        sample = train[0]
        assert type(train).__name__ == "MockGPTDataset", type(train)
        assert tuple(sample["tokens"].shape) == (32,), sample["tokens"].shape
        assert (sample["labels"][:-1] == sample["tokens"][1:]).all()
        print("DATA", len(train), sorted(sample))
    """)
    assert "DATA" in proc.stdout, proc.stderr[-3000:]


def test_family_resolution(megatron_args) -> None:
    from hfsdp.training.specs import SpecError, resolve_family

    assert resolve_family(megatron_args()) == "gpt"
    assert resolve_family(megatron_args(["--num-experts", "8"])) == "moe"
    assert resolve_family(megatron_args(["--hybrid-layer-pattern", "M*", "--num-experts", "8"])) == "hybrid"
    with pytest.raises(SpecError, match="--hybrid-layer-pattern"):
        resolve_family(megatron_args(), forced="hybrid")


FORK_FLAGS = {"--megatron-fsdp-max-pool-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail",
              "--nccl-comm-warmup"}


@pytest.mark.parametrize("case", sorted(
    str(p.parent.relative_to(REPO_ROOT / "tests/functional_tests/test_cases"))
    for p in (REPO_ROOT / "tests/functional_tests/test_cases").glob("*/*/model_config.yaml")
))
def test_recipe_args_pass_megatron_validation(case: str) -> None:
    """Every recipe's MODEL_ARGS (and MODEL_ARGS_2) parse and validate with Megatron's parser.

    The fork's own flags are dropped only when this megatron tree predates them (pristine
    upstream); on the materialized fork they must parse too.
    """
    case_dir = REPO_ROOT / "tests/functional_tests/test_cases" / case
    proc = _py(f"""
        from pathlib import Path
        from hfsdp.functional.recipe import load_recipe, args_to_argv, merged_args
        from hfsdp.functional.run_case import path_variables
        from hfsdp.training.entry import megatron_parser
        import megatron.training.arguments as A
        A.get_device_arch_version = lambda: 9  # validate_args asks the GPU; pretend Hopper
        import torch
        torch.cuda.get_device_capability = lambda *a: (9, 0)  # --moe-grouped-gemm asks it too
        # The optional kernels a TE or fused-Mamba recipe needs are GPU packages; their checks
        # have their own tests (test_requirements.py).
        from hfsdp.training import requirements
        requirements.importable = lambda package: True
        r = load_recipe({str(case_dir)!r})
        os.environ["WORLD_SIZE"] = str(r.nproc)
        os.environ.update({{k: v for k, v in r.env_vars.items() if v is not None}})
        known = {{s for a in megatron_parser()._actions for s in a.option_strings}}
        from hfsdp.training import entries
        from hfsdp.training.reference_flags import flag_parser
        example = entries.training_entry(r.training_script.split()[0]) == entries.REFERENCE_EXAMPLE
        own = {{s for a in flag_parser()._actions for s in a.option_strings}} if example else set()
        for extra in (r.model_args_2,):
            margs = {{k: v for k, v in merged_args(r.model_args, extra).items() if k not in own}}
            unknown = [k for k in margs if k not in known]
            assert set(unknown) <= {FORK_FLAGS!r}, unknown
            argv = args_to_argv({{k: v for k, v in margs.items() if k in known}},
                                path_variables(Path("/tmp/hfsdp-recipe-check")))
            args, family = parse_args(argv)
            print("VALID", family, "dropped:", unknown)
    """)
    assert "VALID" in proc.stdout, proc.stderr[-3000:]
