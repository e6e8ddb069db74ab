"""The functional-test driver's pieces: recipes, log parsing, golden comparison, resume prep.

(Lives with the SLURM tests because the driver is what each sbatch job runs.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hfsdp.functional import golden, logparse
from hfsdp.functional.recipe import RecipeError, args_to_argv, load_recipe, merged_args
from hfsdp.functional.run_case import Launch, build_command, prepare_resume
from hfsdp.launch.torchrun import Placement
from hfsdp.usererror import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]
CASES = REPO_ROOT / "tests/functional_tests/test_cases"

LOG = """\
 [2026-11-21 10:00:00.1] iteration        1/       3 | consumed samples:            8 | elapsed time per iteration (ms): 912.3 | learning rate: 1.500000E-04 | global batch size:     8 | lm loss: 9.123457E+00 | loss scale: 1.0 | grad norm: 3.210 | num zeros: 12 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 100.50 | max allocated: 200.25 | reserved: 300.00 | max reserved: 300.00
[Rank 1] (after 1 iterations) memory (MB) | allocated: 999.00 | max allocated: 999.00 | reserved: 999.00 | max reserved: 999.00
 [2026-11-21 10:00:00.2] iteration        2/       3 | consumed samples:           16 | elapsed time per iteration (ms): 80.0 | lm loss: 8.000001E+00 | num zeros: 0 |
 [2026-11-21 10:00:00.3] iteration        3/       3 | consumed samples:           24 | elapsed time per iteration (ms): 82.0 | lm loss: 7.5E+00 | num zeros: 1 |
"""


def test_parse_megatron_stdout() -> None:
    m = logparse.parse_log(LOG.splitlines())
    assert m["lm loss"] == {1: 9.123457, 2: 8.000001, 3: 7.5}
    assert m["iteration-time"][1] == pytest.approx(0.9123)
    assert m["num-zeros"] == {1: 12.0, 2: 0.0, 3: 1.0}
    assert m["mem-allocated-bytes"] == {1: 100.5 * 2**20}  # rank 0 only
    assert m["mem-max-allocated-bytes"][1] == 200.25 * 2**20
    assert m["grad-norm"] == {1: 3.21}


# Two ranks on one stdout: rank 0's memory record and the last rank's step record share a line
# (print writes a record and its newline separately), the newlines landing elsewhere.
INTERLEAVED_LOG = """\
 [t] iteration        6/      20 | consumed samples:           48 | elapsed time per iteration (ms): 571.8 | lm loss: 8.328976E+00 | num zeros: 796.0 |

[Rank 0] (after 7 iterations) memory (MB) | allocated: 138.69 | max allocated: 259.07 | reserved: 326.00 | max reserved: 326.00 [2026-11-25 16:08:19.194505] iteration        7/      20 | consumed samples:           56 | elapsed time per iteration (ms): 365.6 | lm loss: 8.116722E+00 | num zeros: 676.0 | number of nan iterations:   0 |
 [t] iteration        8/      20 | consumed samples:           64 | elapsed time per iteration (ms): 398.8 | lm loss: 7.973492E+00 | num zeros: 840.0 |[Rank 0] (after 8 iterations) memory (MB) | allocated: 138.69 | max allocated: 259.07 | reserved: 326.00 | max reserved: 326.00
"""


def test_parse_records_that_ranks_wrote_onto_one_line() -> None:
    m = logparse.parse_log(INTERLEAVED_LOG.splitlines())
    assert m["lm loss"] == {6: 8.328976, 7: 8.116722, 8: 7.973492}
    assert m["num-zeros"] == {6: 796.0, 7: 676.0, 8: 840.0}
    assert m["mem-allocated-bytes"] == {7: 138.69 * 2**20, 8: 138.69 * 2**20}
    assert m["mem-max-reserved-bytes"] == {7: 326.0 * 2**20, 8: 326.0 * 2**20}


VALID_LOG = """\
 [t] iteration        4/       8 | consumed samples:           32 | elapsed time per iteration (ms): 80.0 | lm loss: 8.250000E+00 | num zeros: 0 |
----------------------------------------------------------------------------------------------------
 validation loss at iteration 4 | lm loss value: 8.312500E+00 | lm loss PPL: 4.076221E+03 |
----------------------------------------------------------------------------------------------------
 [t] iteration        8/       8 | consumed samples:           64 | elapsed time per iteration (ms): 80.0 | lm loss: 7.250000E+00 | num zeros: 0 |
 validation loss at iteration 8 | lm loss value: 7.375000E+00 | lm loss PPL: 1.596200E+03 |
 validation loss at iteration 8 on validation set | lm loss value: 7.380000E+00 | lm loss PPL: 1.604200E+03 |
 validation loss at iteration 8 on test set | lm loss value: 7.125000E+00 | lm loss PPL: 1.243000E+03 |
"""


def test_parse_validation_losses() -> None:
    m = logparse.parse_log(VALID_LOG.splitlines())
    assert m["lm loss"] == {4: 8.25, 8: 7.25}
    # The loop's lines have no set name; Megatron evaluates again after the last step ("on
    # validation set"), and that later line of step 8 wins. Neither the test set nor PPL is a metric.
    assert m["lm loss validation"] == {4: 8.3125, 8: 7.38}
    assert not any("PPL" in name for name in m)
    # Evenly spaced (the final evaluation lands on a loop step): a golden can hold them.
    assert golden.incomplete_metrics(m, ["lm loss", "lm loss validation"]) == []
    uneven = {**m, "lm loss validation": {3: 8.5, 6: 8.0, 8: 7.5}}  # an interval that misses the last step
    assert "lie outside" in golden.incomplete_metrics(uneven, ["lm loss validation"])[0]


def test_validation_loss_is_compared_exactly() -> None:
    m = logparse.parse_log(VALID_LOG.splitlines())
    worse = {k: dict(v) for k, v in m.items()}
    worse["lm loss validation"][4] = 8.312501  # last printed digit
    problems = golden.compare(m, worse, ["lm loss", "lm loss validation"])
    assert [(p.metric, p.step, p.why) for p in problems] == [("lm loss validation", 4, "must be identical")]
    assert golden.compare(m, worse, ["lm loss validation"], loss_rtol=1e-6) == []


def test_compare_curves_holds_validation_only_where_the_reference_has_it() -> None:
    from hfsdp.functional.run_case import Result, compare_curves

    ref = logparse.parse_log(VALID_LOG.splitlines())
    no_eval = {"lm loss": dict(ref["lm loss"])}
    result = Result(case="x")
    compare_curves("vs twin", ref, no_eval, None, result)  # the twin evaluated, this run did not
    assert result.status == "FAIL"
    assert any("lm loss validation @ step 4" in r and "step missing" in r for r in result.reasons), result.reasons
    result = Result(case="y")
    compare_curves("vs twin", no_eval, ref, None, result)  # a reference without evaluation: lm loss only
    assert result.status == "PASS", result.reasons


def test_golden_roundtrip_and_thresholds(tmp_path: Path) -> None:
    m = logparse.parse_log(LOG.splitlines())
    path = tmp_path / "golden_values_dev_dgx_h200.json"
    golden.save(path, m, ["lm loss", "mem-allocated-bytes"])
    g = golden.load(path)
    assert golden.compare(g, m, ["lm loss", "mem-allocated-bytes"]) == []
    worse = {k: dict(v) for k, v in m.items()}
    worse["lm loss"][2] = 8.000002  # last printed digit differs -> must fail (exact)
    worse["mem-allocated-bytes"][1] *= 1.04  # inside rtol 0.05
    problems = golden.compare(g, worse, ["lm loss", "mem-allocated-bytes"])
    assert [(p.metric, p.step) for p in problems] == [("lm loss", 2)]
    worse["mem-allocated-bytes"][1] = m["mem-allocated-bytes"][1] * 1.06
    assert any(p.metric == "mem-allocated-bytes" for p in golden.compare(g, worse, ["mem-allocated-bytes"]))
    assert golden.compare(g, m, ["num-zeros"])[0].why == "metric missing from golden"


def _times(per_step: float, first: float | None = None) -> dict[str, dict[int, float]]:
    series = {i: per_step for i in range(1, 11)}
    if first is not None:
        series[1] = first
    return {"iteration-time": series}


def test_iteration_time_uses_post_warmup_median() -> None:
    exp = _times(0.100)
    assert golden.compare(exp, _times(0.100, first=5.0), ["iteration-time"]) == []  # warm-up outlier ignored
    # Only steps after the warm-up count: a slow step 1-3 does not fail, a slow median does.
    slow_warmup = _times(0.100)
    slow_warmup["iteration-time"].update({1: 9.0, 2: 9.0, 3: 9.0})
    assert golden.compare(exp, slow_warmup, ["iteration-time"]) == []


@pytest.mark.parametrize(("per_step", "fails"), [(0.050, False), (0.141, False), (0.199, False),
                                                   (0.201, True), (0.700, True), (float("nan"), True)])
def test_iteration_time_fails_only_above_max_ratio(per_step: float, fails: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HFSDP_ITER_TIME_MAX_RATIO", raising=False)
    problems = golden.compare(_times(0.100), _times(per_step), ["iteration-time"])
    assert bool(problems) == fails, problems
    if fails:
        assert problems[0].metric == "iteration-time" and "2.0x" in problems[0].why


def test_iteration_time_ratio_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HFSDP_ITER_TIME_MAX_RATIO", "1.15")
    assert golden.compare(_times(0.100), _times(0.120), ["iteration-time"])[0].why == \
        "median more than 1.15x the golden's"
    for bad in ("fast", "0.5", "nan"):
        monkeypatch.setenv("HFSDP_ITER_TIME_MAX_RATIO", bad)
        with pytest.raises(UserError, match="HFSDP_ITER_TIME_MAX_RATIO"):
            golden.compare(_times(0.100), _times(0.120), ["iteration-time"])


def test_iteration_time_drift_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HFSDP_ITER_TIME_MAX_RATIO", raising=False)
    assert golden.iteration_time_drift(_times(0.100), _times(0.110)) is None
    assert golden.iteration_time_drift(_times(0.100), {}) is None
    slower = golden.iteration_time_drift(_times(0.109), _times(0.165))
    assert slower is not None and "165.0 ms is 1.51x the golden's 109.0 ms" in slower
    faster = golden.iteration_time_drift(_times(0.0327), _times(0.0272))
    assert faster is not None and "0.83x" in faster and "re-record" in faster


def test_all_recipes_load_and_follow_conventions() -> None:
    recipes = [load_recipe(p.parent) for p in sorted(CASES.glob("*/*/model_config.yaml"))]
    names = {f"{r.model}/{r.name}" for r in recipes}
    assert {"hybrid/hybrid_mcore_local_fsdp_maxpool_db", "hybrid/hybrid_mcore_local_fsdp_no_db",
            "moe/moe_mcore_local_fsdp_ep2", "smoke/cpu_gloo_smoke"} <= names
    for r in recipes:
        if r.model == "smoke":
            continue
        assert r.nproc in (1, 2, 4) and r.model_args.get("--deterministic-mode") is True, r.name
        # NVLink multicast is the environment's business (our tests/gpu scripts pin it off);
        # a recipe users run under SLURM must not switch it off for them.
        assert not {"NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                    "NVSHMEM_DISABLE_NVLS"} & set(r.env_vars), r.name
        # TE cases take their deterministic settings from one place (hfsdp/te_determinism.py).
        te = r.model_args.get("--transformer-impl") == "transformer_engine"
        assert r.model_args.get("--transformer-impl") == "local" or (te and r.determinism), r.name
        assert "lm loss" in r.metrics
        if r.compare_to:
            assert (r.case_dir / r.compare_to / "model_config.yaml").is_file()
    resumes = [r for r in recipes if r.test_type == "ckpt-resume"]
    assert len(resumes) >= 3
    for r in resumes:
        assert int(r.model_args["--save-interval"]) * 2 == r.train_iters, r.name


def test_args_to_argv_conventions() -> None:
    argv = args_to_argv({"--a": True, "--b": False, "--c": None, "--d": 3, "--e": ["x", "${OUTPUT_PATH}"],
                         "--save": "${CHECKPOINT_SAVE_PATH}"},
                        {"OUTPUT_PATH": "/o", "CHECKPOINT_SAVE_PATH": "/o/ckpt"})
    assert argv == ["--a", "--d", "3", "--e", "x", "/o", "--save", "/o/ckpt"]
    assert merged_args({"--a": True, "--b": 1}, {"--a": False, "--c": 2}) == {"--a": False, "--b": 1, "--c": 2}


def test_bad_recipe_is_rejected(tmp_path: Path) -> None:
    case = tmp_path / "gpt" / "bad"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text("TEST_TYPE: ckpt-resume\nMODEL_ARGS: {--train-iters: 4}\n")
    with pytest.raises(RecipeError, match="needs --save"):
        load_recipe(case)
    (case / "model_config.yaml").write_text("MODLE_ARGS: {}\n")
    with pytest.raises(RecipeError, match="unknown keys"):
        load_recipe(case)


def test_build_command_and_resume_prep(tmp_path: Path) -> None:
    r = load_recipe(CASES / "hybrid/hybrid_mcore_local_fsdp_no_db")
    cmd = build_command(r, ["--x"], Launch(Placement(nproc=2, master_port=1234), exit_duration_in_mins=7.5))
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node"]
    assert cmd[-3:] == ["--x", "--exit-duration-in-mins", "7.5"]
    assert cmd[cmd.index("--master-port") + 1] == "1234" and cmd[-4] == str(REPO_ROOT / "pretrain_gpt.py")
    for it in (10, 20):
        (tmp_path / f"iter_{it:07d}").mkdir()
    prepare_resume(tmp_path, 10, 20)
    assert not (tmp_path / "iter_0000020").exists() and (tmp_path / "iter_0000010").is_dir()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "10"
    with pytest.raises(FileNotFoundError):
        prepare_resume(tmp_path, 5, 20)


def _case(root: Path, name: str, compare_to: str | None) -> Path:
    case = root / "hybrid" / name
    case.mkdir(parents=True)
    lines = ["TEST_TYPE: regular", "METRICS:", "  - lm loss", "CHECKS:", "  min_iterations: 3",
             "MODEL_ARGS:", "  --train-iters: 3"]
    if compare_to:
        lines.insert(1, f"COMPARE_TO: {compare_to}")
    (case / "model_config.yaml").write_text("\n".join(lines) + "\n")
    return case


def test_record_writes_no_golden_when_the_cross_case_check_fails(tmp_path: Path) -> None:
    from hfsdp.functional.run_case import run_case

    cases, out = tmp_path / "cases", tmp_path / "out"
    base = _case(cases, "base", None)
    other = _case(cases, "other", "../base")
    base_log, other_log = tmp_path / "base.log", tmp_path / "other.log"
    base_log.write_text(LOG)
    other_log.write_text(LOG.replace("lm loss: 7.5E+00", "lm loss: 7.500001E+00"))  # drifts at it 3
    assert run_case(base, record=True, output_root=out, evaluate_log=base_log).status == "PASS"
    assert list(base.glob("golden_values_*.json"))
    result = run_case(other, record=True, output_root=out, evaluate_log=other_log)
    assert result.status == "FAIL"
    assert any("lm loss @ step 3" in r for r in result.reasons), result.reasons
    assert "not recording goldens from a failing run" in result.reasons
    assert not list(other.glob("golden_values_*.json"))


# A stand-in for pretrain_gpt.py: saves/loads iter_N dirs and prints Megatron's iteration line.
# Run 2 adds FAKE_DRIFT * step to every loss after its first step (a layout-change drift).
FAKE_TRAINER = '''\
import os, sys
args = sys.argv[1:]
def arg(name):
    return args[args.index(name) + 1] if name in args else None
if os.environ.get("RANK", "0") != "0":
    sys.exit(0)
iters, save, load = int(arg("--train-iters")), arg("--save"), arg("--load")
interval = int(arg("--save-interval"))
latest = os.path.join(load, "latest_checkpointed_iteration.txt")
start = int(open(latest).read()) if os.path.exists(latest) else 0
drift = float(os.environ.get("FAKE_DRIFT", "0")) if start else 0.0
for it in range(start + 1, iters + 1):
    loss = 10.0 - 0.25 * it + (drift * it if it > start + 1 else 0.0)
    print(f" [t] iteration {it:8d}/{iters:8d} | consumed samples: {8 * it} | "
          f"elapsed time per iteration (ms): 50.0 | lm loss: {loss:.6E} | num zeros: 0 |", flush=True)
    if arg("--eval-interval") and it % int(arg("--eval-interval")) == 0:
        valid = 10.5 - 0.25 * it + (float(os.environ.get("FAKE_VALID_DRIFT", "0")) if start else 0.0)
        print(f" validation loss at iteration {it} | lm loss value: {valid:.6E} | "
              "lm loss PPL: 1.0E+04 |", flush=True)
    if it % interval == 0:
        os.makedirs(os.path.join(save, f"iter_{it:07d}"), exist_ok=True)
        open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w").write(str(it))
'''


def _resume_case(root: Path, trainer: Path, compare: str, drift: float) -> Path:
    case = root / "hybrid" / "resume"
    case.mkdir(parents=True)
    if not trainer.exists():
        trainer.write_text(FAKE_TRAINER)
    (case / "model_config.yaml").write_text(
        f"TRAINING_SCRIPT: {trainer}\nNPROC: 1\nTEST_TYPE: ckpt-resume\n{compare}"
        f"ENV_VARS_2:\n  FAKE_DRIFT: '{drift}'\nMETRICS:\n  - lm loss\nREQUIRE_GOLDEN: false\n"
        "MODEL_ARGS:\n  --train-iters: 6\n  --save-interval: 3\n"
        "  --save: ${CHECKPOINT_SAVE_PATH}\n  --load: ${CHECKPOINT_LOAD_PATH}\n")
    return case


@pytest.mark.parametrize(
    ("compare", "drift", "status", "reason"),
    [
        ("", 0.0, "PASS", None),  # default: every resumed step identical
        ("", 1e-6, "FAIL", "lm loss @ step 5"),  # the default catches the smallest drift
        ("RESUME_COMPARE: {exact_steps: 1, rtol: 5.0e-5}\n", 1e-6, "PASS", None),
        ("RESUME_COMPARE: {exact_steps: 1, rtol: 5.0e-5}\n", 1e-3, "FAIL", "rtol 5e-05"),
        ("RESUME_COMPARE: {exact_steps: 2, rtol: 5.0e-5}\n", 1e-6, "FAIL", "must be identical"),
    ],
)
def test_ckpt_resume_through_the_driver(tmp_path: Path, compare: str, drift: float, status: str,
                                        reason: str | None) -> None:
    from hfsdp.functional.run_case import run_case

    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)
    case = _resume_case(tmp_path / "cases", trainer, compare, drift)
    result = run_case(case, launch=Launch(Placement(nproc=1), timeout_s=120), output_root=tmp_path / "out")
    assert result.status == status, result.reasons
    assert len(result.runs) == 2
    if reason:
        assert any(reason in r for r in result.reasons), result.reasons


@pytest.mark.parametrize(("valid_drift", "status"), [(0.0, "PASS"), (1e-6, "FAIL")])
def test_ckpt_resume_holds_validation_losses_too(tmp_path: Path, valid_drift: float, status: str) -> None:
    from hfsdp.functional.run_case import run_case

    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)
    case = _resume_case(tmp_path / "cases", trainer, "", 0.0)
    config = case / "model_config.yaml"
    config.write_text(config.read_text().replace("ENV_VARS_2:\n", f"ENV_VARS_2:\n  FAKE_VALID_DRIFT: '{valid_drift}'\n")
                      + "  --eval-interval: 2\n")
    result = run_case(case, launch=Launch(Placement(nproc=1), timeout_s=120), output_root=tmp_path / "out")
    assert result.status == status, result.reasons
    if status == "FAIL":
        # Steps 4 and 6 were resumed (run 2 starts after the step-3 checkpoint); step 2 was not.
        assert sorted(r.split("@ step ")[1].split(":")[0] for r in result.reasons if "validation" in r) == ["4", "6"]


@pytest.mark.parametrize(
    ("block", "match"),
    [
        ("RESUME_COMPARE: {exact_steps: 0, rtol: 1.0e-5}\n", "exact_steps must be an int >= 1"),
        ("RESUME_COMPARE: {exact_steps: 1, rtol: 0.01}\n", r"rtol must be a number in \[0, 1e-3\]"),
        ("RESUME_COMPARE: {exact_steps: 1}\n", "needs both exact_steps and rtol"),
        ("RESUME_COMPARE: {exact_steps: 1, rtol: 0, atol: 1}\n", "must be a mapping with"),
    ],
)
def test_bad_resume_compare_is_rejected(tmp_path: Path, block: str, match: str) -> None:
    case = _resume_case(tmp_path, tmp_path / "t.py", block, 0.0)
    with pytest.raises(RecipeError, match=match):
        load_recipe(case)
    (case / "model_config.yaml").write_text("TEST_TYPE: regular\n" + block + "MODEL_ARGS: {--train-iters: 2}\n")
    with pytest.raises(RecipeError, match="only for TEST_TYPE ckpt-resume"):
        load_recipe(case)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ("  --eval-iters: 2\n  --eval-interval: 4\n", None),
        ("  --eval-iters: 2\n  --eval-interval: 3\n", "--eval-interval 3 does not divide --train-iters 8"),
        ("  --eval-iters: 0\n  --eval-interval: 4\n", "does not evaluate"),
        ("  --eval-iters: 2\n", "does not evaluate"),
    ],
)
def test_validation_metric_needs_an_even_eval_schedule(tmp_path: Path, args: str, match: str | None) -> None:
    case = tmp_path / "hybrid" / "evals"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(
        "TEST_TYPE: regular\nMETRICS:\n  - lm loss\n  - lm loss validation\n"
        "MODEL_ARGS:\n  --train-iters: 8\n" + args)
    if match is None:
        assert "lm loss validation" in load_recipe(case).metrics
    else:
        with pytest.raises(RecipeError, match=match):
            load_recipe(case)


def test_resume_compare_reads_yaml_floats_without_a_dot(tmp_path: Path) -> None:
    case = _resume_case(tmp_path, tmp_path / "t.py", "RESUME_COMPARE: {exact_steps: 1, rtol: 5e-5}\n", 0.0)
    assert load_recipe(case).resume_compare.rtol == 5e-5


def test_loss_rtol_relaxes_lm_loss_and_still_fails_nan() -> None:
    exp = {"lm loss": {1: 7.0, 2: 7.0}}
    near = {"lm loss": {1: 7.0 * (1 + 1e-4), 2: float("nan")}}
    assert [p.step for p in golden.compare(exp, near, ["lm loss"])] == [1, 2]
    problems = golden.compare(exp, near, ["lm loss"], loss_rtol=1e-3)
    assert [(p.step, p.why) for p in problems] == [(2, "rtol 0.001")]


CRASHING_TRAINER = '''\
import os, sys
iters = int(sys.argv[sys.argv.index("--train-iters") + 1])
for it in range(1, iters + 1):
    print(f" [t] iteration {it:8d}/{iters:8d} | consumed samples: {8 * it} | "
          f"elapsed time per iteration (ms): 50.0 | lm loss: {10.0 - it:.6E} | num zeros: 0 |", flush=True)
os._exit(int(os.environ.get("FAKE_EXIT", "0")))  # after every step was logged, like a crash at exit
'''


@pytest.mark.parametrize(("twin_exit", "status"), [(0, "PASS"), (139, "FAIL")])
def test_compare_to_a_twin_that_crashed_after_training_fails(tmp_path: Path, twin_exit: int,
                                                             status: str) -> None:
    """A twin whose run logged every step, then crashed, leaves complete metrics; they must not
    serve as the reference (a 1-GPU eager twin once exited with SIGSEGV after its last step)."""
    from hfsdp.functional.run_case import run_case

    trainer = tmp_path / "trainer.py"
    trainer.write_text(CRASHING_TRAINER)
    cases, out = tmp_path / "cases", tmp_path / "out"
    for name, extra in (("twin", f"ENV_VARS:\n  FAKE_EXIT: '{twin_exit}'\n"),
                        ("graphed", "COMPARE_TO: ../twin\n")):
        case = cases / "hybrid" / name
        case.mkdir(parents=True)
        (case / "model_config.yaml").write_text(
            f"TRAINING_SCRIPT: {trainer}\nNPROC: 1\nTEST_TYPE: regular\n{extra}METRICS:\n"
            "  - lm loss\nREQUIRE_GOLDEN: false\nMODEL_ARGS:\n  --train-iters: 3\n")
    assert run_case(cases / "hybrid" / "twin", output_root=out).status == status
    result = run_case(cases / "hybrid" / "graphed", output_root=out)
    assert result.status == status, result.reasons
    if status == "FAIL":
        assert any("is no reference" in r and "exit" in r for r in result.reasons), result.reasons


@pytest.mark.parametrize(("node_rank", "log", "status"), [
    (0, "rank 0: training\n", "PASS"),  # Megatron logs the loss on the last rank only
    (0, "rank 0: training\nTraceback (most recent call last):\n", "FAIL"),  # log_absent still holds
    (1, "rank 2: training\n", "FAIL"),  # the last node judges the loss: none logged
    (1, LOG, "PASS"),
])
def test_only_the_last_node_judges_the_loss(tmp_path: Path, node_rank: int, log: str, status: str) -> None:
    """With torchrun per node, the nodes before the last log no loss; their verdict is their exit
    status and the log patterns (every node of a multi-node job once FAILed but the last)."""
    from hfsdp.functional.run_case import run_case

    case = tmp_path / "cases" / "smoke" / "two_nodes"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(
        "TRAINING_SCRIPT: -m x\nNPROC: 1\nTEST_TYPE: smoke\nREQUIRE_GOLDEN: false\nMETRICS:\n  - lm loss\n"
        "CHECKS:\n  min_iterations: 3\n  loss_decreases: true\n  log_absent:\n    - Traceback\n"
        "MODEL_ARGS:\n  --train-iters: 3\n")
    (tmp_path / "run.log").write_text(log)
    launch = Launch(Placement(nproc=1, nnodes=2, node_rank=node_rank, master_port=29500))
    result = run_case(case, launch=launch, output_root=tmp_path / "out", evaluate_log=tmp_path / "run.log")
    assert result.status == status, result.reasons


def test_sigterm_to_the_driver_ends_its_run_and_fails_the_case(tmp_path: Path, sigterm_once_started) -> None:
    """A job's time limit, scancel or srun's --kill-on-bad-exit sends the driver SIGTERM. The run
    (torchrun and its ranks, in their own session) must end with it, and the case FAIL saying why;
    the driver once died at once and left the ranks running."""
    import os
    import signal
    import subprocess
    import sys

    pidfile = tmp_path / "rank.pid"
    trainer = tmp_path / "sleeper.py"
    trainer.write_text(f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
    case = tmp_path / "cases" / "smoke" / "sleeper"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(
        f"TRAINING_SCRIPT: {trainer}\nNPROC: 1\nTEST_TYPE: smoke\nREQUIRE_GOLDEN: false\n"
        "METRICS:\n  - lm loss\nMODEL_ARGS:\n  --train-iters: 3\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    driver = subprocess.Popen([sys.executable, "-m", "hfsdp.functional.run_case", str(case), "--output-dir",
                               str(tmp_path / "out")], cwd=REPO_ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rank, (out, _), gone = sigterm_once_started(driver, pidfile, 120, 5)
    assert driver.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM" in out and "HFSDP-FUNCTIONAL RESULT smoke/sleeper: FAIL" in out, out
    assert gone, f"rank {rank} outlived the driver:\n{out}"


# What a node's torchrun agent logged in a 4-node CI job after every rank had passed.
EXIT_BARRIER_RACE = """\
E0101 00:00:01.000000 442 torch/distributed/elastic/agent/server/api.py:1008] Error waiting on exit barrier. Elapsed: 0.0275 seconds
E0101 00:00:01.000000 442 torch/distributed/elastic/agent/server/api.py:1008] Traceback (most recent call last):
E0101 00:00:01.000000 442 torch/distributed/elastic/agent/server/api.py:1008]   File "torch/distributed/elastic/agent/server/api.py", line 994, in _exit_barrier
E0101 00:00:01.000000 442 torch/distributed/elastic/agent/server/api.py:1008]     store.wait([last_member_key])
E0101 00:00:01.000000 442 torch/distributed/elastic/agent/server/api.py:1008] torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?
"""


# The same record from a 4-node CI job whose virtual environment lies inside the checkout: torch
# names its file from there, and the barrier waits one frame deeper (torch 2.13).
EXIT_BARRIER_RACE_VENV = """\
E1125 15:06:05.232000 30982 .venv/lib/python3.12/site-packages/torch/distributed/elastic/agent/server/api.py:1008] Error waiting on exit barrier. Elapsed: 0.0265042781829834 seconds
E1125 15:06:05.232000 30982 .venv/lib/python3.12/site-packages/torch/distributed/elastic/agent/server/api.py:1008] Traceback (most recent call last):
E1125 15:06:05.232000 30982 .venv/lib/python3.12/site-packages/torch/distributed/elastic/agent/server/api.py:1008]   File "/x/.venv/lib/python3.12/site-packages/torch/distributed/elastic/agent/server/api.py", line 994, in _exit_barrier
E1125 15:06:05.232000 30982 .venv/lib/python3.12/site-packages/torch/distributed/elastic/agent/server/api.py:1008]     store_util.barrier(
E1125 15:06:05.232000 30982 .venv/lib/python3.12/site-packages/torch/distributed/elastic/agent/server/api.py:1008]   File "/x/.venv/lib/python3.12/site-packages/torch/distributed/elastic/utils/store.py", line 201, in barrier
E1125 15:06:05.232000 30982 .venv/lib/python3.12/site-packages/torch/distributed/elastic/agent/server/api.py:1008]     store.wait([last_member_key])
E1125 15:06:05.232000 30982 .venv/lib/python3.12/site-packages/torch/distributed/elastic/agent/server/api.py:1008] torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?
"""


@pytest.mark.parametrize(("extra", "status"), [
    (EXIT_BARRIER_RACE, "PASS"),  # torchrun's own race after the ranks finished: not the run's failure
    (EXIT_BARRIER_RACE_VENV, "PASS"),
    (EXIT_BARRIER_RACE_VENV + "Traceback (most recent call last):\n  File \"x.py\"\nValueError: rank 3\n", "FAIL"),
    (EXIT_BARRIER_RACE + "Traceback (most recent call last):\n  File \"x.py\"\nValueError: rank 3\n", "FAIL"),
])
def test_torchruns_exit_barrier_race_is_not_a_forbidden_traceback(tmp_path: Path, extra: str, status: str) -> None:
    """A 4-node job once FAILed on a node whose ranks all passed: its torchrun agent logged the
    exit-barrier race (the first node's agent, which holds the store, had left), with a traceback."""
    from hfsdp.functional.run_case import run_case

    case = tmp_path / "cases" / "smoke" / "race"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(
        "TRAINING_SCRIPT: -m x\nNPROC: 1\nTEST_TYPE: smoke\nREQUIRE_GOLDEN: false\nMETRICS:\n  - lm loss\n"
        "CHECKS:\n  min_iterations: 3\n  log_absent:\n    - Traceback\nMODEL_ARGS:\n  --train-iters: 3\n")
    (tmp_path / "run.log").write_text(LOG + extra)
    result = run_case(case, output_root=tmp_path / "out", evaluate_log=tmp_path / "run.log")
    assert result.status == status, result.reasons


def test_a_diverged_run_writes_strict_json_metrics_that_name_the_nan(tmp_path: Path) -> None:
    """A NaN loss is kept in metrics.json as the string "nan" (strict JSON has no NaN token), reads
    back as NaN, and is refused as a golden."""
    path = tmp_path / "metrics.json"
    golden.save(path, {"lm loss": {1: 9.5, 2: math.nan}, "grad-norm": {1: math.inf}}, ["lm loss", "grad-norm"])
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    assert doc["lm loss"]["values"] == {"1": 9.5, "2": "nan"} and doc["grad-norm"]["values"] == {"1": "inf"}
    assert golden.check_golden(doc, ["lm loss"]) == ["lm loss: value at step 2 is not a finite JSON number ('nan')"]
    assert math.isnan(golden.from_golden(doc)["lm loss"][2])
