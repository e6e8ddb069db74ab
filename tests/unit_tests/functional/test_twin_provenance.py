"""A COMPARE_TO twin's outputs are reused only under the recipe that made them ([Note: twin
provenance] in hfsdp/functional/provenance.py): a twin whose recipe changed since runs again, and one
that cannot is no reference."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from hfsdp import filelock
from hfsdp.functional import provenance, runlock
from hfsdp.functional.recipe import load_recipe
from hfsdp.functional.run_case import Launch, run_case
from hfsdp.launch.torchrun import Placement

# Megatron's step lines; FAKE_SHIFT moves every loss (another seed), EDIT_RECIPE appends a comment
# to that file while the run goes on (a recipe edited during its run).
TRAINER = '''\
import os, sys
args = sys.argv[1:]
iters = int(args[args.index("--train-iters") + 1])
if os.environ.get("EDIT_RECIPE"):
    with open(os.environ["EDIT_RECIPE"], "a") as recipe:
        recipe.write("# edited while it ran\\n")
shift = float(os.environ.get("FAKE_SHIFT", "0"))
for it in range(1, iters + 1):
    print(f" iteration {it:8d}/{iters:8d} | consumed samples: {8 * it} | elapsed time per iteration (ms): 50.0 | "
          f"lm loss: {10.0 - 0.25 * it + shift:.6E} | num zeros: 0 |", flush=True)
'''
LAUNCH = Launch(Placement(nproc=1), timeout_s=60)


def make_case(root: Path, name: str, env: str = "", compare_to: str | None = None) -> Path:
    trainer = root / "trainer.py"
    if not trainer.exists():
        trainer.parent.mkdir(parents=True, exist_ok=True)
        trainer.write_text(TRAINER)
    case = root / "gpt" / name
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(
        f"TRAINING_SCRIPT: {trainer}\nNPROC: 1\nTEST_TYPE: regular\nREQUIRE_GOLDEN: false\n"
        + (f"COMPARE_TO: {compare_to}\n" if compare_to else "") + (f"ENV_VARS:\n{env}" if env else "")
        + "METRICS:\n  - lm loss\nMODEL_ARGS:\n  --train-iters: 3\n")
    return case


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(twin, case, output root): the twin run once, on its own."""
    cases, out = tmp_path / "cases", tmp_path / "out"
    twin = make_case(cases, "twin", env="  FAKE_SHIFT: '0'\n")
    case = make_case(cases, "case", compare_to="../twin")
    assert run_case(twin, launch=LAUNCH, output_root=out).status == "PASS"
    return twin, case, out


def twin_log_stamp(out: Path) -> int:
    return (out / "gpt" / "twin" / "run1.log").stat().st_mtime_ns


def test_an_unchanged_twin_is_reused(pair):
    twin, case, out = pair
    before = twin_log_stamp(out)
    assert run_case(case, launch=LAUNCH, output_root=out).status == "PASS"
    assert twin_log_stamp(out) == before  # not run again
    record = json.loads((out / "gpt" / "twin" / "result.json").read_text())
    assert record["recipe_hash"] == provenance.recipe_hash(load_recipe(twin))


def test_a_twin_whose_recipe_changed_runs_again_and_the_case_is_held_to_its_new_numbers(pair):
    """The twin's seed changed after its run: its old metrics.json once passed the case silently."""
    twin, case, out = pair
    recipe = twin / "model_config.yaml"
    recipe.write_text(recipe.read_text().replace("FAKE_SHIFT: '0'", "FAKE_SHIFT: '0.5'"))
    result = run_case(case, launch=LAUNCH, output_root=out)
    assert result.status == "FAIL", result.reasons
    assert any("vs gpt/twin: lm loss @ step 1" in r for r in result.reasons), result.reasons
    record = json.loads((out / "gpt" / "twin" / "result.json").read_text())
    assert record["recipe_hash"] == provenance.recipe_hash(load_recipe(twin))


@pytest.mark.parametrize("damage", ["no hash", "other metrics"])
def test_twin_outputs_that_no_record_vouches_for_are_run_again(pair, damage):
    """A result.json of an older driver (no hash), or a metrics.json that is not the one result.json
    describes (a run stopped between the two), is no reference to reuse."""
    twin, case, out = pair
    folder = out / "gpt" / "twin"
    if damage == "no hash":
        record = json.loads((folder / "result.json").read_text())
        del record["recipe_hash"]
        (folder / "result.json").write_text(json.dumps(record))
    else:
        metrics = json.loads((folder / "metrics.json").read_text())
        metrics["lm loss"]["values"]["1"] = 1.0
        (folder / "metrics.json").write_text(json.dumps(metrics))
    assert provenance.mismatch(load_recipe(twin), None, folder) is not None
    before = twin_log_stamp(out)
    assert run_case(case, launch=LAUNCH, output_root=out).status == "PASS"
    assert twin_log_stamp(out) != before and provenance.mismatch(load_recipe(twin), None, folder) is None


def test_the_twin_is_held_to_the_runs_env_but_not_to_its_gpus(pair):
    twin, case, out = pair
    recipe = load_recipe(twin)
    assert provenance.recipe_hash(recipe, {"CUDA_VISIBLE_DEVICES": "3"}) == provenance.recipe_hash(recipe)
    assert provenance.recipe_hash(recipe, {"FAKE_SHIFT": "0"}) != provenance.recipe_hash(recipe)
    before = twin_log_stamp(out)
    assert run_case(case, launch=LAUNCH, output_root=out, env={"CUDA_VISIBLE_DEVICES": "3"}).status == "PASS"
    assert twin_log_stamp(out) == before
    result = run_case(case, launch=LAUNCH, output_root=out, env={"FAKE_SHIFT": "0"})
    assert result.status == "PASS" and twin_log_stamp(out) != before  # run again under the run's --env


def test_a_stale_twin_that_cannot_run_again_refuses_the_case(pair):
    """Another run holds the twin's folder: the twin cannot be run again here, and is not reused."""
    twin, case, out = pair
    recipe = twin / "model_config.yaml"
    recipe.write_text(recipe.read_text() + "# another recipe\n")
    with filelock.exclusive(runlock.lock_path(out / "gpt" / "twin"), "run_case gpt/twin (pid 4242, host h)"):
        result = run_case(case, launch=Launch(Placement(nproc=1), timeout_s=3), output_root=out)
    assert result.status == "FAIL"
    assert any("gpt/twin was not read" in r and "in use by run_case gpt/twin (pid 4242" in r
               and "rerun this case once that run has ended" in r for r in result.reasons), result.reasons


def test_a_twin_whose_recipe_changes_while_it_runs_is_no_reference(tmp_path):
    cases, out = tmp_path / "cases", tmp_path / "out"
    twin = make_case(cases, "twin")
    recipe = twin / "model_config.yaml"
    recipe.write_text(recipe.read_text().replace("METRICS:", f"ENV_VARS:\n  EDIT_RECIPE: '{recipe}'\nMETRICS:"))
    case = make_case(cases, "case", compare_to="../twin")
    result = run_case(case, launch=LAUNCH, output_root=out)
    assert result.status == "FAIL", result.reasons
    (reason,) = [r for r in result.reasons if "is no reference" in r]
    assert "records another recipe" in reason and "run_case" in reason and str(twin) in reason, reason


def test_a_twin_another_run_is_writing_is_waited_for_and_never_read_half_written(pair):
    """Two batches on one output root once re-ran one twin while a third case read it: the case must read
    the twin only once the run writing it has ended, under the twin folder's lock."""
    twin, case, out = pair
    lock = runlock.lock_path(out / "gpt" / "twin")
    metrics = out / "gpt" / "twin" / "metrics.json"
    good = metrics.read_text()
    before = twin_log_stamp(out)
    taken, released = threading.Event(), threading.Event()

    def writer() -> None:  # another run rewriting the twin: half-written numbers, then the whole file
        with filelock.exclusive(lock, filelock.holder_line("run_case gpt/twin")):
            metrics.write_text(good[: len(good) // 2])
            taken.set()
            time.sleep(4.0)  # longer than the case's own run
            metrics.write_text(good)
            released.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert taken.wait(10)
    result = run_case(case, launch=LAUNCH, output_root=out)
    thread.join()
    assert released.is_set()
    assert result.status == "PASS", result.reasons  # read after the writer, whole: not re-run, not refused
    assert twin_log_stamp(out) == before


def test_a_twin_that_stays_busy_is_no_reference_naming_its_holder(pair):
    twin, case, out = pair
    with filelock.exclusive(runlock.lock_path(out / "gpt" / "twin"), filelock.holder_line("run_case gpt/twin")):
        result = run_case(case, launch=Launch(Placement(nproc=1), timeout_s=3), output_root=out)
    assert result.status == "FAIL"
    assert any("compare-to case gpt/twin was not read" in r and "stayed in use by run_case gpt/twin (pid" in r
               for r in result.reasons), result.reasons
