"""The functional driver on bad input: it never deletes what it did not make, malformed goldens
and recipes fail with the file named, and the CLI prints a sentence instead of a traceback."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from fake_environments import fake_environment

from hfsdp.functional import environment, golden
from hfsdp.functional.recipe import RecipeError, load_recipe
from hfsdp.functional.run_case import Launch, run_case
from hfsdp.launch.torchrun import Placement
from hfsdp.usererror import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]

# Prints Megatron's iteration line for --train-iters steps (rank 0 only).
TRAINER = '''\
import os, sys
args = sys.argv[1:]
iters = int(args[args.index("--train-iters") + 1])
if os.environ.get("RANK", "0") == "0":
    for it in range(1, iters + 1):
        print(f" iteration {it:8d}/{iters:8d} | consumed samples: {8 * it} | "
              f"elapsed time per iteration (ms): 50.0 | lm loss: {10.0 - 0.25 * it:.6E} | num zeros: 0 |",
              flush=True)
'''


def log_text(steps: int) -> str:
    return "".join(f" iteration {it:8d}/{steps:8d} | consumed samples: {8 * it} | elapsed time per iteration "
                   f"(ms): 50.0 | lm loss: {10.0 - 0.25 * it:.6E} | num zeros: 0 |\n" for it in range(1, steps + 1))


def make_case(root: Path, name: str = "case", steps: int = 4, extra: str = "", trainer: Path | None = None) -> Path:
    case = root / "gpt" / name
    case.mkdir(parents=True)
    script = f"TRAINING_SCRIPT: {trainer}\nNPROC: 1\n" if trainer else ""
    (case / "model_config.yaml").write_text(
        f"{script}TEST_TYPE: regular\nMETRICS:\n  - lm loss\n  - num-zeros\n{extra}"
        f"MODEL_ARGS:\n  --train-iters: {steps}\n")
    return case


def digest(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# Output folders ------------------------------------------------------------------------------

def test_output_dir_that_holds_the_cases_is_refused_and_the_case_survives(tmp_path):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    cases = tmp_path / "test_cases"
    case = make_case(cases, trainer=trainer)
    (case / "golden_values_torch_dgx_h200.json").write_text(json.dumps(golden.to_golden(
        {"lm loss": {1: 9.75, 2: 9.5, 3: 9.25, 4: 9.0}, "num-zeros": {i: 0.0 for i in range(1, 5)}},
        ["lm loss", "num-zeros"])))
    before = digest(cases)
    # <output-dir>/<model>/<case> is the case folder itself.
    with pytest.raises(UserError) as info:
        run_case(case, launch=Launch(Placement(nproc=1), timeout_s=120), output_root=cases)
    assert str(case) in info.value.cause and "test case" in info.value.cause
    assert "--output-dir" in info.value.fix
    assert digest(cases) == before


def test_output_dir_inside_a_case_is_refused(tmp_path):
    case = make_case(tmp_path / "cases")
    with pytest.raises(UserError, match="inside the test case"):
        run_case(case, output_root=case / "out", evaluate_log=tmp_path / "no.log")
    assert sorted(p.name for p in case.iterdir()) == ["model_config.yaml"]


def test_existing_output_folder_not_made_by_the_driver_is_refused(tmp_path):
    case = make_case(tmp_path / "cases")
    out = tmp_path / "out" / "gpt" / "case"
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(UserError) as info:
        run_case(case, launch=Launch(Placement(nproc=1)), output_root=tmp_path / "out")
    assert "notes.txt" in info.value.cause and "not made by the functional driver" in info.value.cause
    assert (out / "notes.txt").read_text() == "mine\n"


def test_a_rerun_replaces_its_own_output(tmp_path):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    case = make_case(tmp_path / "cases", trainer=trainer, extra="REQUIRE_GOLDEN: false\n")
    launch = Launch(Placement(nproc=1), timeout_s=120)
    first = run_case(case, launch=launch, output_root=tmp_path / "out")
    assert first.status == "PASS", first.reasons
    out = tmp_path / "out" / "gpt" / "case"
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "stale").write_text("x")  # would turn the next run into a resume
    second = run_case(case, launch=launch, output_root=tmp_path / "out")
    assert second.status == "PASS" and not (out / "checkpoints" / "stale").exists()


def test_evaluate_log_never_adopts_a_folder_it_did_not_make(tmp_path):
    """A user's folder where the case's output folder would be: judging a log must neither write
    into it nor mark it as the driver's, so that a later run (which clears its own folders) refuses
    it too and the user's checkpoint survives both."""
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    case = make_case(tmp_path / "cases", trainer=trainer)
    theirs = tmp_path / "out" / "gpt" / "case"
    (theirs / "checkpoints").mkdir(parents=True)
    (theirs / "checkpoints" / "mine.pt").write_bytes(b"weights")
    (theirs / "metrics.json").write_text('{"mine": 1}')
    before = digest(theirs)
    log = tmp_path / "run1.log"
    log.write_text(log_text(4))
    with pytest.raises(UserError, match="not made by the functional driver") as info:
        run_case(case, output_root=tmp_path / "out", evaluate_log=log)
    assert "checkpoints" in info.value.cause and "metrics.json" in info.value.cause
    with pytest.raises(UserError, match="not made by the functional driver"):
        run_case(case, launch=Launch(Placement(nproc=1)), output_root=tmp_path / "out")
    assert digest(theirs) == before and sorted(p.name for p in theirs.iterdir()) == ["checkpoints", "metrics.json"]


def test_evaluate_log_writes_into_its_own_folder_and_an_empty_one(tmp_path):
    case = make_case(tmp_path / "cases")
    out = tmp_path / "out" / "gpt" / "case"
    out.mkdir(parents=True)  # empty: nothing of anyone's to lose
    log = tmp_path / "run1.log"
    log.write_text(log_text(4))
    for _ in range(2):  # the second time the folder is the driver's own
        run_case(case, output_root=tmp_path / "out", evaluate_log=log)
        assert (out / "metrics.json").is_file() and (out / ".hfsdp-functional-output").is_file()


def test_a_missing_log_makes_no_output_folder(tmp_path):
    case = make_case(tmp_path / "cases")
    with pytest.raises(UserError, match="does not exist"):
        run_case(case, output_root=tmp_path / "out", evaluate_log=tmp_path / "no.log")
    assert not (tmp_path / "out" / "gpt").exists()


def test_a_recipe_that_is_not_a_regular_file_is_named_for_what_it_is(tmp_path):
    case = tmp_path / "gpt" / "case"
    case.mkdir(parents=True)
    os.mkfifo(case / "model_config.yaml")  # reading it would block
    with pytest.raises(RecipeError, match="model_config.yaml is a named pipe, not a regular file"):
        load_recipe(case)


@pytest.mark.parametrize("record", [False, True])
def test_a_golden_that_is_not_a_regular_file_is_neither_read_nor_replaced(tmp_path, record):
    case = make_case(tmp_path / "cases")
    pipe = case / "golden_values_torch_dgx_h200.json"
    os.mkfifo(pipe)
    log = tmp_path / "run1.log"
    log.write_text(log_text(4))
    result = run_case(case, output_root=tmp_path / "out", evaluate_log=log, record=record, platform="dgx_h200")
    assert result.status == "FAIL" and any("is a named pipe, not a regular file" in r for r in result.reasons)
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)


# Goldens -------------------------------------------------------------------------------------

def judge_against(tmp_path: Path, golden_obj: object, steps: int = 4):
    case = make_case(tmp_path / "cases", steps=steps)
    (case / "golden_values_torch_dgx_h200.json").write_text(
        golden_obj if isinstance(golden_obj, str) else json.dumps(golden_obj))
    log = tmp_path / "run1.log"
    log.write_text(log_text(steps))
    return run_case(case, output_root=tmp_path / "out", evaluate_log=log)


def good_golden(steps: int = 4) -> dict:
    """A golden of the environment the driver probes in these tests (conftest's fake one)."""
    return {**golden.to_golden({"lm loss": {i: float(f"{10.0 - 0.25 * i:.6E}") for i in range(1, steps + 1)},
                                "num-zeros": {i: 0.0 for i in range(1, steps + 1)}}, ["lm loss", "num-zeros"]),
            environment.KEY: fake_environment().to_json()}


def test_a_complete_golden_passes(tmp_path):
    assert judge_against(tmp_path, good_golden()).status == "PASS"


def test_a_negative_step_time_in_a_golden_is_named(tmp_path):
    """Only the median step time is compared, so a negative value would otherwise pass unseen."""
    case = make_case(tmp_path / "cases", extra="  - iteration-time\n")
    g = good_golden()
    g.update(golden.to_golden({"iteration-time": {1: 0.05, 2: -0.05, 3: 0.05, 4: 0.05}}, ["iteration-time"]))
    (case / "golden_values_torch_dgx_h200.json").write_text(json.dumps(g))
    log = tmp_path / "run1.log"
    log.write_text(log_text(4))
    result = run_case(case, output_root=tmp_path / "out", evaluate_log=log)
    assert result.status == "FAIL"
    assert any("iteration-time: value at step 2 is negative (-0.05)" in r for r in result.reasons), result.reasons


def test_a_step_given_twice_in_a_golden_is_named(tmp_path):
    """JSON keeps the last of two equal keys without a word; the reader refuses them."""
    text = json.dumps(good_golden()).replace('"values": {"1": 9.75,', '"values": {"1": 1.0, "1": 9.75,', 1)
    assert '"1": 1.0, "1": 9.75' in text
    result = judge_against(tmp_path, text)
    assert result.status == "FAIL" and any("key '1' is given twice" in r for r in result.reasons), result.reasons


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda g: g["num-zeros"]["values"].update({k: "NaN" for k in g["num-zeros"]["values"]}),
     "num-zeros: value at step 1 is not a finite JSON number ('NaN')"),
    (lambda g: g["lm loss"].update(values={}), "lm loss: no values"),
    # The bare Infinity token Python's json writes: not strict JSON, refused as the file is read.
    (lambda g: g["lm loss"]["values"].update({"2": float("inf")}), "Infinity is not a JSON number"),
    # What the driver never writes: a number as a string, a step spelled two ways, a negative time.
    (lambda g: g["lm loss"]["values"].update({"2": "9.5"}), "lm loss: value at step 2 is not a finite JSON number"),
    (lambda g: g["lm loss"]["values"].update({"02": 9.5}), "lm loss: step '02' is not a step as the driver writes"),
    (lambda g: g.pop("num-zeros"), "num-zeros: missing"),
    (lambda g: g["lm loss"]["values"].pop("3"), "lm loss: steps 3 missing between start_step 1 and end_step 4"),
    (lambda g: g["lm loss"].update(values=[1, 2]), "lm loss: 'values' must be a mapping"),
])
def test_malformed_golden_fails_and_names_what_is_missing(tmp_path, mutate, expected):
    g = good_golden()
    mutate(g)
    result = judge_against(tmp_path, g)
    assert result.status == "FAIL"
    assert any(expected in r and "golden_values_torch_dgx_h200.json" in r for r in result.reasons), result.reasons


def test_golden_with_fewer_steps_than_the_run_fails(tmp_path):
    result = judge_against(tmp_path, good_golden(steps=2), steps=4)
    assert result.status == "FAIL"
    assert any("lm loss: the run logged steps 3-4, the golden stops at step 2" in r for r in result.reasons), \
        result.reasons


@pytest.mark.parametrize(("golden_step_s", "status", "note"), [
    (0.050, "PASS", None),      # the log's 50 ms steps: no note
    (0.030, "PASS", "1.67x"),   # another machine: noted, not failed
    (0.100, "PASS", "0.50x"),   # faster than the golden: a golden to re-record
    (0.024, "FAIL", None),      # 2.08x slower: fails
])
def test_iteration_time_fails_only_when_much_slower_and_notes_drift(tmp_path, capsys, monkeypatch,
                                                                    golden_step_s, status, note):
    monkeypatch.delenv("HFSDP_ITER_TIME_MAX_RATIO", raising=False)
    case = make_case(tmp_path / "cases", steps=6, extra="  - iteration-time\n")
    g = good_golden(steps=6)
    g.update(golden.to_golden({"iteration-time": {i: golden_step_s for i in range(1, 7)}}, ["iteration-time"]))
    (case / "golden_values_torch_dgx_h200.json").write_text(json.dumps(g))
    log = tmp_path / "run1.log"
    log.write_text(log_text(6))
    result = run_case(case, output_root=tmp_path / "out", evaluate_log=log)
    printed = capsys.readouterr().out
    assert result.status == status, result.reasons
    if status == "FAIL":
        assert any("iteration-time @ median" in r and "2.0x" in r for r in result.reasons), result.reasons
    notes = [line for line in printed.splitlines() if line.startswith("note: golden")]
    if note is None and status == "PASS":
        assert notes == [], notes
    elif note is not None:
        assert len(notes) == 1 and note in notes[0], notes


@pytest.mark.parametrize(("name", "said"), [
    ("lm_loss", "'lm_loss' (did you mean 'lm loss'?), which is no metric name the driver measures"),
    ("lm loss ", "'lm loss ' (did you mean 'lm loss'?)"),
    ("LM loss", "'LM loss'"),
    ("", "'', which is no metric name"),
    ("Environment", "'Environment'"),  # the reserved key is spelt one way
])
def test_a_golden_metric_name_the_driver_does_not_measure_fails_naming_it(tmp_path, name, said):
    """A misspelt metric in a golden was never compared, and the case passed without a word."""
    g = good_golden()
    g[name] = g["num-zeros"]
    result = judge_in_this_environment(tmp_path, g)
    assert result.status == "FAIL"
    (reason,) = [r for r in result.reasons if "golden_values_torch_dgx_h200.json" in r]
    assert said in reason and "(those are: lm loss, lm loss validation, num-zeros, iteration-time, " in reason, reason
    assert "mem-allocated-bytes" in reason and "rename or remove it" in reason, reason


def judge_in_this_environment(tmp_path: Path, golden_obj: dict):
    """The case judged against ``golden_obj`` recorded in the environment the tests' driver probes."""

    case = make_case(tmp_path / "cases")
    path = case / f"golden_values_{fake_environment().label()}_dgx_h200.json"
    path.write_text(json.dumps({golden.ENVIRONMENT_KEY: fake_environment().to_json(), **golden_obj}))
    log = tmp_path / "run1.log"
    log.write_text(log_text(4))
    return run_case(case, output_root=tmp_path / "out", evaluate_log=log)


def test_the_environment_key_of_a_golden_is_no_metric(tmp_path):
    result = judge_in_this_environment(tmp_path, good_golden())
    assert result.status == "PASS", result.reasons
    path = tmp_path / "cases" / "gpt" / "case" / "golden_values_torch_dgx_h200.json"
    g = golden.read_json(path)
    assert golden.ENVIRONMENT_KEY in g
    assert sorted(golden.load(path)) == ["lm loss", "num-zeros"]
    assert sorted(golden.read_golden(path, ["lm loss"])) == ["lm loss"]
    assert sorted(golden.from_golden(g)) == ["lm loss", "num-zeros"]
    assert golden.unknown_names(g) == [] and golden.check_golden(g, ["lm loss", "num-zeros"]) == []


def test_a_metrics_file_read_as_reference_with_an_unknown_name_is_refused(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({**good_golden(), "lm-loss": good_golden()["lm loss"]}))
    with pytest.raises(golden.GoldenError, match=r"names 'lm-loss' \(did you mean 'lm loss'\?\)"):
        golden.load(path)


def test_every_metric_name_is_one_the_log_parser_gives():
    """One list (logparse.METRIC_NAMES): what a log line yields, and nothing else."""
    from hfsdp.functional import logparse

    lines = [" iteration        1/       1 | elapsed time per iteration (ms): 50.0 | lm loss: 9.0E+00 | "
             "load_balancing_loss: 1.0E+00 | grad norm: 2.0 | num zeros: 0 | reference kl: 1.0E-02 | other: 3 |",
             "[Rank 0] (after 1 iterations) memory (MB) | allocated: 1.0 | max allocated: 2.0 | reserved: 3.0 | "
             "max reserved: 4.0",
             " validation loss at iteration 1 | lm loss value: 8.0E+00 | mtp loss value: 7.0E+00 | lm loss PPL: 1 |"]
    assert sorted(logparse.parse_log(lines)) == sorted(logparse.METRIC_NAMES)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"lm loss": 3}'])
def test_unreadable_golden_fails_naming_the_file(tmp_path, text):
    result = judge_against(tmp_path, text)
    assert result.status == "FAIL"
    assert any("golden_values_torch_dgx_h200.json" in r for r in result.reasons), result.reasons


def test_record_refuses_a_run_without_every_metric(tmp_path):
    case = make_case(tmp_path / "cases", extra="")
    (case / "model_config.yaml").write_text((case / "model_config.yaml").read_text().replace(
        "  - num-zeros\n", "  - num-zeros\n  - mem-allocated-bytes\n"))
    log = tmp_path / "run1.log"
    log.write_text(log_text(4))
    result = run_case(case, record=True, output_root=tmp_path / "out", evaluate_log=log)
    assert result.status == "FAIL" and not list(case.glob("golden_values_*"))
    assert any("mem-allocated-bytes" in r and "not recording" in r for r in result.reasons), result.reasons


# Recipes -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("MODEL_ARGS: {--a: 1\n", "is not valid YAML"),
    ("- just\n- a list\n", "must be a mapping"),
    ("", "MODEL_ARGS is missing: the case has nothing to launch"),
    ("MODEL_ARGS: {}\n", "MODEL_ARGS is missing"),
    ("MODEL_ARGS: [--train-iters, 3]\n", "MODEL_ARGS must be a mapping"),
    ("MODEL_ARGS: {train-iters: 3}\n", "MODEL_ARGS key 'train-iters' is not a flag"),
    ("MODEL_ARGS: {--a: {b: 1}}\n", "MODEL_ARGS --a: a value must be"),
    ("ENV_VARS: [A]\nMODEL_ARGS: {--a: 1}\n", "ENV_VARS must be a mapping"),
    ("METRICS: lm loss\nMODEL_ARGS: {--a: 1}\n", "METRICS must be a list"),
    ("METRICS: [lm loss, num_zeros]\nMODEL_ARGS: {--a: 1}\n",
     "METRICS names 'num_zeros' (did you mean 'num-zeros'?), which is no metric name the driver measures"),
    ("NPROC: two\nMODEL_ARGS: {--a: 1}\n", "NPROC must be an integer >= 1"),
    ("NPROC: 0\nMODEL_ARGS: {--a: 1}\n", "NPROC must be an integer >= 1"),
    ("CHECKS: [a]\nMODEL_ARGS: {--a: 1}\n", "CHECKS must be a mapping"),
    ("CHECKS: {log_absent: '('}\nMODEL_ARGS: {--a: 1}\n", "CHECKS log_absent must be a list"),
    ("CHECKS: {log_absent: ['(']}\nMODEL_ARGS: {--a: 1}\n", "is not a valid regular expression"),
    ("CHECKS: {min_iterations: many}\nMODEL_ARGS: {--a: 1}\n", "min_iterations must be an integer >= 0"),
    ("REQUIRE_GOLDEN: maybe\nMODEL_ARGS: {--a: 1}\n", "REQUIRE_GOLDEN must be true or false"),
    ("TRAINING_SCRIPT: ''\nMODEL_ARGS: {--a: 1}\n", "TRAINING_SCRIPT must name a script"),
    ("TRAINING_SCRIPT: no_such_script.py\nMODEL_ARGS: {--a: 1}\n", "no_such_script.py does not exist"),
    ("COMPARE_TO: ../nowhere\nMODEL_ARGS: {--a: 1}\n", "COMPARE_TO ../nowhere"),
    ("TEST_TYPE: ckpt-resume\nMODEL_ARGS: {--train-iters: x, --save: a, --load: a, --save-interval: 1}\n",
     "--train-iters must be an integer"),
])
def test_malformed_recipe_names_the_file(tmp_path, text, expected):
    case = tmp_path / "gpt" / "bad"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(case)
    assert expected in info.value.cause, info.value.cause
    assert str(case / "model_config.yaml") in info.value.cause
    assert info.value.fix


def test_case_folder_without_a_recipe(tmp_path):
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "nowhere")
    assert "model_config.yaml" in info.value.cause and "test_cases" in info.value.fix


@pytest.mark.parametrize("text", ["MODEL_ARGS: {--a: 1\n", "", "- a\n"])
def test_cli_prints_a_sentence_not_a_traceback(tmp_path, text):
    case = tmp_path / "gpt" / "bad"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "HFSDP_DEBUG"}
    proc = subprocess.run([sys.executable, "-m", "hfsdp.functional.run_case", str(case)], cwd=REPO_ROOT,
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "torch.distributed.run" not in proc.stdout
    assert proc.stderr.startswith("run_case: error: ") and str(case / "model_config.yaml") in proc.stderr
    debug = subprocess.run([sys.executable, "-m", "hfsdp.functional.run_case", str(case)], cwd=REPO_ROOT,
                           capture_output=True, text=True, env={**env, "HFSDP_DEBUG": "1"}, timeout=120)
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_the_golden_advice_re_records_and_then_passes(tmp_path, monkeypatch, capsys):
    """A malformed golden fails naming the way out; running that command fixes it."""
    import re

    from hfsdp.functional import run_case as driver

    monkeypatch.setenv("HFSDP_FUNCTIONAL_OUT", str(tmp_path / "out"))
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    case = make_case(tmp_path / "cases", trainer=trainer)
    g = good_golden()
    g["lm loss"]["values"] = {}
    (case / "golden_values_torch_dgx_h200.json").write_text(json.dumps(g))
    assert driver.main([str(case)]) == 1
    out = capsys.readouterr().out
    (advice,) = [c for c in re.findall(r"`([^`]+)`", out) if "--record" in c]
    assert advice == f"python -m hfsdp.functional.run_case {case} --record"
    assert driver.main(advice.split()[3:]) == 0
    assert driver.main([str(case)]) == 0


# Launch-time refusals ------------------------------------------------------------------------

def test_a_gpu_case_where_no_gpu_is_visible_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """A case that trains with pretrain_gpt.py on a machine whose ranks see no GPU: one sentence,
    before torchrun starts and before the previous run's output is cleared."""
    from hfsdp.functional import run_case as driver

    asked = []
    monkeypatch.setattr(driver.fit, "gpu_memory", lambda python=sys.executable, env=None: asked.append(env) or [])
    case = make_case(tmp_path / "cases", extra="ENV_VARS: {CUDA_VISIBLE_DEVICES: ''}\n")  # pretrain_gpt.py
    out = tmp_path / "out" / "gpt" / "case"
    from hfsdp.functional import outdir

    outdir.prepare(out, clear=False)
    (out / "run1.log").write_text("the previous run\n")
    with pytest.raises(UserError) as info:
        run_case(case, launch=Launch(Placement(nproc=1), timeout_s=60), output_root=tmp_path / "out")
    assert "gpt/case trains with pretrain_gpt.py, which needs CUDA GPUs" in info.value.cause
    assert "CUDA_VISIBLE_DEVICES=''" in info.value.cause and "cpu_gloo_smoke" in info.value.fix
    assert asked and asked[0]["CUDA_VISIBLE_DEVICES"] == ""  # asked with the ranks' environment
    assert (out / "run1.log").read_text() == "the previous run\n"


def test_evaluate_log_that_is_a_folder_is_named_a_folder(tmp_path):
    case = make_case(tmp_path / "cases")
    with pytest.raises(UserError) as info:
        run_case(case, output_root=tmp_path / "out", evaluate_log=tmp_path)
    assert info.value.cause == f"--evaluate-log {tmp_path} is a folder, not a log file"


def test_drift_note_against_a_golden_of_zero_step_times():
    """A golden whose step-time median is 0 gives no ratio; the note says so instead of dividing."""
    times = {i: 0.0 for i in range(1, 7)}
    note = golden.iteration_time_drift({"iteration-time": times}, {"iteration-time": {i: 0.05 for i in times}})
    assert note is not None and "50.0 ms against the golden's 0.0 ms" in note and "re-record" in note


@pytest.mark.parametrize(("text", "expected"), [
    ("MODEL_ARGS: {--train-iters: 2}\nMODEL_ARGS: {--train-iters: 3}\n",
     "key 'MODEL_ARGS' is given twice (lines 1 and 2), and YAML would keep only the last"),
    ("MODEL_ARGS: {--lr: 1, --lr: 2}\n", "key '--lr' is given twice (line 1)"),
    ("NPROC: 100000000000\nMODEL_ARGS: {--a: 1}\n", "NPROC 100000000000 is more ranks on one node"),
])
def test_recipe_values_that_would_be_lost_or_absurd_are_refused(tmp_path, text, expected):
    case = tmp_path / "gpt" / "bad"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(case)
    assert expected in info.value.cause and str(case / "model_config.yaml") in info.value.cause


def test_what_is_passed_instead_of_a_case_folder_is_named(tmp_path):
    case = make_case(tmp_path / "cases")
    with pytest.raises(RecipeError) as info:
        load_recipe(case / "model_config.yaml")
    assert "is the recipe file" in info.value.cause and info.value.fix == f"pass {case}"
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "cases")
    assert "is not a test case but holds 1 of them" in info.value.cause and "cases/*/*" in info.value.fix
    (tmp_path / "x" / "model_config.yaml").mkdir(parents=True)
    with pytest.raises(RecipeError, match="model_config.yaml is a folder, not a regular file"):
        load_recipe(tmp_path / "x")


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_an_output_dir_that_is_or_lies_under_a_file_is_refused(tmp_path, where):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    root = blocker if where == "file" else blocker / "out"
    case = make_case(tmp_path / "cases")
    with pytest.raises(UserError) as info:
        run_case(case, launch=Launch(Placement(nproc=1)), output_root=root)
    assert f"--output-dir {root}" in info.value.cause and str(blocker) in info.value.cause
    assert blocker.read_text() == "mine\n"


def test_a_case_output_folder_under_a_file_or_a_dead_link_is_refused_and_nothing_changes(tmp_path):
    from hfsdp.functional import outdir

    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    for out in (blocker, blocker / "gpt" / "case"):
        with pytest.raises(UserError) as info:
            outdir.prepare(out, clear=True)
        assert info.value.cause.startswith(f"output folder {out} ") and str(blocker) in info.value.cause
        assert info.value.fix == outdir.FIX
    dead = tmp_path / "dead"
    dead.symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError, match="which is a symbolic link to nothing"):
        outdir.check_root(dead / "out")
    assert blocker.read_text() == "mine\n" and not (tmp_path / "nowhere").exists()


def test_an_output_dir_in_a_folder_that_is_not_writable_is_refused_before_the_case_runs(tmp_path, lock_folder):
    from hfsdp.functional import outdir

    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    case = make_case(tmp_path / "cases", trainer=trainer, extra="REQUIRE_GOLDEN: false\n")
    locked = lock_folder(tmp_path / "locked")
    with pytest.raises(UserError) as info:
        run_case(case, launch=Launch(Placement(nproc=1), timeout_s=60), output_root=locked / "out")
    assert info.value.cause == f"--output-dir {locked / 'out'}: {locked} is not writable"
    with pytest.raises(UserError, match=f"{locked} is not writable"):
        outdir.check(locked / "gpt" / "case")
    assert list(locked.iterdir()) == []


def test_a_bad_compare_to_is_refused_before_the_case_runs(tmp_path):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    case = make_case(tmp_path / "cases", trainer=trainer, extra="REQUIRE_GOLDEN: false\n")
    with pytest.raises(UserError) as info:
        run_case(case, launch=Launch(Placement(nproc=1), timeout_s=60), compare_to=tmp_path / "nowhere",
                 output_root=tmp_path / "out")
    assert info.value.cause.startswith("--compare-to: ") and "nowhere" in info.value.cause
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


def test_batch_refuses_a_summary_path_it_cannot_write_before_running(tmp_path):
    from hfsdp.functional import batch

    case = make_case(tmp_path / "cases")
    for summary, expected in ((tmp_path, "is a folder, not a file"),
                              (case / "model_config.yaml" / "s.txt", "which is a file")):
        with pytest.raises(UserError) as info:
            batch.check_summary(summary)
        assert expected in info.value.cause
    assert batch.main([str(case), "--summary", str(tmp_path), "--output-dir", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_batch_refuses_a_summary_under_a_file_before_running(tmp_path, capsys):
    from hfsdp.functional import batch

    case = make_case(tmp_path / "cases")
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    summary = blocker / "s.txt"
    assert batch.main([str(case), "--summary", str(summary), "--output-dir", str(tmp_path / "out")]) == 2
    assert f"--summary {summary} lies under {blocker}, which is a file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and blocker.read_text() == "mine\n"


def test_batch_refuses_a_summary_in_a_folder_that_is_not_writable_before_running(tmp_path, capsys, lock_folder):
    from hfsdp.functional import batch

    case = make_case(tmp_path / "cases")
    locked = lock_folder(tmp_path / "locked")
    summary = locked / "s.txt"
    assert batch.main([str(case), "--summary", str(summary), "--output-dir", str(tmp_path / "out")]) == 2
    assert f"--summary {summary}: {locked} is not writable" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_batch_refuses_gpu_cases_where_no_gpu_is_visible_before_running_any(tmp_path, monkeypatch, capsys):
    from hfsdp.functional import batch
    from hfsdp.launch import fit

    monkeypatch.setattr(fit, "gpu_memory", lambda python=sys.executable, env=None: [])
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    cpu = make_case(tmp_path / "cases", name="cpu", trainer=trainer, extra="REQUIRE_GOLDEN: false\n")
    gpu = make_case(tmp_path / "cases", name="gpu")  # pretrain_gpt.py
    out = ["--output-dir", str(tmp_path / "out")]
    assert batch.main([str(cpu), str(gpu), *out]) == 2
    err = capsys.readouterr().err
    assert "1 of the cases train on CUDA GPUs and their ranks would see none here (gpt/gpu)" in err
    assert batch.main([str(cpu), "--ranks-per-gpu", "2", *out]) == 2
    assert "--ranks-per-gpu 2 shares CUDA GPUs between ranks, and this machine has none" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_batch_shows_why_run_case_refused_a_case(tmp_path, capsys):
    from hfsdp.functional import batch

    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    case = make_case(tmp_path / "cases", trainer=trainer, extra="REQUIRE_GOLDEN: false\n")
    (tmp_path / "out" / "gpt" / "case").mkdir(parents=True)
    (tmp_path / "out" / "gpt" / "case" / "notes.txt").write_text("mine\n")
    assert batch.main([str(case), "--output-dir", str(tmp_path / "out")]) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("rc=2"))
    assert "refused: output folder" in line and "not made by the functional driver" in line
