"""The deterministic TE settings (hfsdp/te_determinism.py): one place, every setting reaching the
processes of the recipes and benchmark runs that ask for them, and consistent with the argument
checks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from hfsdp import te_determinism as D
from hfsdp.proc import GroupResult

REPO_ROOT = Path(__file__).resolve().parents[3]
# A caller's shell that contradicts the profile: the profile must still reach the runs.
CONTRARY_CALLER_ENV = {"NCCL_ALGO": "Tree", "CAUSAL_CONV1D_DETERMINISTIC": "0",
                       "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}


def effective(argv: Sequence[str], flag: str) -> str | bool | None:
    """What argparse takes for ``flag`` from ``argv`` (the last occurrence wins; True: bare)."""
    if flag not in argv:
        return None
    i = len(argv) - 1 - list(reversed(argv)).index(flag)
    following = argv[i + 1] if i + 1 < len(argv) else "--"
    return True if following.startswith("--") else following


def assert_deterministic(cmd: Sequence[str], env: dict[str, str], triton: D.TritonChoice) -> None:
    """Every setting of the profile, with its value, in one launched process's argv and env."""
    for s in (*D.ENV, D.TRITON[triton]):
        assert env.get(s.name) == s.value, (s.name, env.get(s.name))
    other = next(s.name for choice, s in D.TRITON.items() if choice != triton)
    assert other not in env, f"{other} set beside {D.TRITON[triton].name}"
    for s in D.FLAGS:
        assert effective(cmd, s.name) == s.value, (s.name, cmd)


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


def test_the_settings_pass_the_te_argument_checks(megatron_args) -> None:
    from megatron.training.te_arg_checks import te_arg_problems

    args = megatron_args(["--transformer-impl", "transformer_engine", "--hybrid-layer-pattern", "M*E", *D.argv()])
    assert te_arg_problems(args, environ=D.env()) == []
    assert te_arg_problems(args, environ={}), "without the environment the checks must object"


def test_nothing_is_both_set_and_deliberately_left_alone() -> None:
    left_alone = {name.strip() for s in D.NOT_SET for name in s.name.split(",")}
    set_here = {s.name for s in (*D.ENV, *D.TRITON.values(), *D.FLAGS)}
    assert not left_alone & set_here


def test_describe_gives_every_setting_its_value_and_reason() -> None:
    """What the benchmark prints under --deterministic: each line is the setting as applied."""
    lines = D.describe().splitlines()
    for s in (*D.ENV, *D.TRITON.values()):
        assert f"- {s.name}={s.value}: {s.why}" in lines, s.name
    for s in D.FLAGS:
        shown = s.name if s.value is True else f"{s.name}={s.value}"
        assert f"- {shown}: {s.why}" in lines, s.name
    left_alone = lines[lines.index("Deliberately not set:") + 1:]
    assert left_alone == [f"- {s.name} ({s.value}): {s.why}" for s in D.NOT_SET]


def _resume_recipe(root: Path) -> Path:
    case = root / "hybrid" / "deterministic"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(
        "DETERMINISM: transformer_engine\nNPROC: 1\nTEST_TYPE: ckpt-resume\nREQUIRE_GOLDEN: false\n"
        "METRICS:\n  - lm loss\nENV_VARS_2:\n  SECOND_RUN: '1'\n"
        "MODEL_ARGS:\n  --train-iters: 4\n  --save-interval: 2\n"
        "  --save: ${CHECKPOINT_SAVE_PATH}\n  --load: ${CHECKPOINT_LOAD_PATH}\n"
        "MODEL_ARGS_2:\n  --eval-iters: 0\n")
    return case


def test_every_setting_reaches_both_runs_of_a_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hfsdp.functional import run_case
    from hfsdp.functional.run_case import Launch, RunRecord
    from hfsdp.launch.torchrun import Placement

    seen: list[tuple[list[str], dict[str, str]]] = []

    def fake_run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float | None) -> RunRecord:
        """A training run: logs every step and leaves the checkpoints --save-interval asks for."""
        seen.append((cmd, env))
        iters, interval = int(str(effective(cmd, "--train-iters"))), int(str(effective(cmd, "--save-interval")))
        for it in range(interval, iters + 1, interval):
            (Path(str(effective(cmd, "--save"))) / f"iter_{it:07d}").mkdir(parents=True, exist_ok=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(f" [t] iteration {it:8d}/{iters:8d} | consumed samples: {it} | elapsed time "
                               f"per iteration (ms): 50.0 | lm loss: {10.0 - it:.6E} |\n"
                               for it in range(1, iters + 1)))
        return RunRecord(str(log), 0, False)

    for name, value in CONTRARY_CALLER_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    monkeypatch.setattr(run_case, "run_logged", fake_run_logged)
    monkeypatch.setattr(run_case, "check_gpus_for", lambda recipe, env: None)  # the runs are faked: so is the GPU
    result = run_case.run_case(_resume_recipe(tmp_path / "cases"), launch=Launch(Placement(nproc=1)),
                               output_root=tmp_path / "out")
    assert result.status == "PASS", result.reasons
    assert len(seen) == 2 and seen[1][1].get("SECOND_RUN") == "1"  # run 2 took its own settings too
    for cmd, env in seen:
        assert_deterministic(cmd, env, "pin")


@pytest.mark.parametrize("part", ["ENV_VARS", "ENV_VARS_2", "MODEL_ARGS", "MODEL_ARGS_2"])
def test_a_recipe_setting_any_of_them_is_refused(tmp_path: Path, part: str) -> None:
    from hfsdp.functional.recipe import RecipeError, load_recipe

    names = [*D.env("pin")] if part.startswith("ENV") else [*D.flags()]
    for k, name in enumerate(names):
        case = tmp_path / str(k) / "hybrid" / "c"
        case.mkdir(parents=True)
        body = {"MODEL_ARGS": {"--train-iters": 2}, part: {name: "x"}} if part != "MODEL_ARGS" else {
            "MODEL_ARGS": {"--train-iters": 2, name: "x"}}
        (case / "model_config.yaml").write_text(
            "DETERMINISM: transformer_engine\n" + "\n".join(f"{key}: {json.dumps(value)}"
                                                            for key, value in body.items()) + "\n")
        with pytest.raises(RecipeError, match=f"{name} also set by DETERMINISM"):
            load_recipe(case)


@pytest.mark.parametrize("ranks_per_gpu, triton", [(1, "cache"), (2, "pin")])
def test_every_setting_reaches_every_run_of_a_deterministic_benchmark(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranks_per_gpu: int, triton: D.TritonChoice) -> None:
    from hfsdp.bench import run as B

    seen: list[tuple[list[str], dict[str, str]]] = []

    def fake_run_group(cmd: list[str], *, timeout_s: float, env: dict[str, str], stdout: object) -> GroupResult:
        seen.append((list(cmd), dict(env)))
        return GroupResult(returncode=1, timed_out=False, seconds=0.0)

    for name, value in CONTRARY_CALLER_ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("TRITON_CACHE_AUTOTUNING", "HFSDP_TRITON_PIN_AUTOTUNE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(B, "run_group", fake_run_group)
    monkeypatch.setattr(B.requirements, "importable", lambda package: True)
    monkeypatch.setattr(B.fit, "gpu_memory", lambda *a, **k: [80 * 2**30] * 4)  # a GPU machine, faked
    monkeypatch.setattr(B.fit, "preflight", lambda placement, flags, environ=None: "preflight (test)")
    configs = ["no_db", "te_no_db", "te_maxpool_graph"]
    B.main(["--configs", ",".join(configs), "--repeats", "1", "--no-plan", "--no-chart",
            "--deterministic", "--ranks-per-gpu", str(ranks_per_gpu), "--out-json", str(tmp_path / "r.json")])
    # The priming runs as well, one per start-up class (local and TE kernels): they fill the kernel caches.
    assert len(seen) == len(configs) + 2
    for cmd, env in seen:
        assert_deterministic(cmd, env, triton)


def test_docs_list_every_setting() -> None:
    doc = (REPO_ROOT / "docs/transformer-engine.md").read_text()
    for name in (*D.env(), *D.env("cache"), *D.flags()):
        assert name in doc, f"docs/transformer-engine.md does not list {name}"


REFUSAL_BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
                "--micro-batch-size 1 --bf16 --lr 1e-4 --train-iters 2").split()


@pytest.mark.parametrize("refused", D.REFUSED, ids=lambda s: s.name)
def test_megatron_refuses_each_refused_flag_under_deterministic_mode(megatron_validator, monkeypatch, refused) -> None:
    """REFUSED is what Megatron's validate_args says: the benchmark refuses these before any run."""
    import torch

    for name, value in D.env().items():
        monkeypatch.setenv(name, value)
    message = refused.why.split('"')[1]
    run = megatron_validator(REFUSAL_BASE, world_size=1)
    try:
        run(D.argv())  # accepted alone
        with pytest.raises(AssertionError, match=message.replace(".", r"\.")):
            run([*D.argv(), refused.name])
        run([refused.name])  # and the flag alone
    finally:
        torch.use_deterministic_algorithms(False)  # validate_args turned it on for this process


def test_refused_names_each_refused_flag_once_in_order() -> None:
    flags = ["--use-flash-attn", "--bf16", "--cross-entropy-loss-fusion", "--use-flash-attn"]
    assert D.refused(flags) == ["--use-flash-attn", "--cross-entropy-loss-fusion"]
    assert D.refused(["--bf16", *D.argv()]) == []
