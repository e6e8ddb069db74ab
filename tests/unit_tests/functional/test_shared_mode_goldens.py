"""The functional driver with several ranks per GPU, and the batch runner (CPU, fake trainers).

[Note: goldens of the several-ranks-per-GPU mode] in hfsdp/functional/golden.py.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fake_environments import fake_environment

from hfsdp.functional import batch, golden, run_case, selection
from hfsdp.functional.recipe import load_recipe
from hfsdp.functional.run_case import Launch, RunRecord
from hfsdp.launch.torchrun import Placement
from hfsdp.usererror import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]
METRICS = ["lm loss", "num-zeros", "mem-allocated-bytes", "iteration-time"]

# A stand-in for pretrain_gpt.py: rank 0 prints Megatron's lines; the loss depends on the world
# size (as data-parallel training's does); FAKE_SLEEP_AFTER_S keeps it alive after its last step.
FAKE_TRAINER = '''\
import os, sys, time
args = sys.argv[1:]
iters = int(args[args.index("--train-iters") + 1])
world = int(os.environ["WORLD_SIZE"])
if os.environ.get("RANK", "0") == "0":
    for it in range(1, iters + 1):
        print(f" [t] iteration {it:8d}/{iters:8d} | elapsed time per iteration (ms): 50.0 | "
              f"lm loss: {10.0 - it / world + float(os.environ.get('FAKE_LOSS_SHIFT', '0')):.6E} | num zeros: 0 |",
              flush=True)
        print(f"[Rank 0] (after {it} iterations) memory (MB) | allocated: 100.0 | max allocated: 200.0", flush=True)
time.sleep(float(os.environ.get("FAKE_SLEEP_AFTER_S", "0")))
'''


def _case(root: Path, name: str, *, nproc: int = 1, compare_to: str | None = None,
          extra: tuple[str, ...] = ()) -> Path:
    trainer = root / "fake_trainer.py"
    trainer.parent.mkdir(parents=True, exist_ok=True)
    trainer.write_text(FAKE_TRAINER)
    case = root / "hybrid" / name
    case.mkdir(parents=True)
    lines = [f"TRAINING_SCRIPT: {trainer}", f"NPROC: {nproc}", "TEST_TYPE: regular", "METRICS:",
             *[f"  - {m}" for m in METRICS], "MODEL_ARGS:", "  --train-iters: 4"]
    if compare_to:
        lines.insert(1, f"COMPARE_TO: {compare_to}")
    lines[1:1] = extra
    (case / "model_config.yaml").write_text("\n".join(lines) + "\n")
    return case


def _golden(case: Path, platform: str, loss_shift: float = 0.0, mem: float = 100.0, secs: float = 0.05) -> None:
    values = {"lm loss": {s: 10.0 - s + loss_shift for s in range(1, 5)},
              "num-zeros": dict.fromkeys(range(1, 5), 0.0),
              "mem-allocated-bytes": dict.fromkeys(range(1, 5), mem * 2**20),
              "iteration-time": dict.fromkeys(range(1, 5), secs)}
    save(case, platform, values)


def save(case: Path, platform: str, values: dict) -> None:
    """A golden of conftest's fake environment on ``platform``'s GPU kind."""
    env = fake_environment(gpu=selection.kind_of(platform))
    golden.save(load_recipe(case).golden_path(env.label(), platform), values, METRICS, env)


@pytest.mark.parametrize(("run_shared", "platform", "compared"), [
    (False, "dgx_h100", METRICS),
    (True, "dgx_h100", ["lm loss", "num-zeros"]),
    (False, "dgx_h100_shared", ["lm loss", "num-zeros"]),
    (True, "dgx_h100_shared", ["lm loss", "num-zeros", "mem-allocated-bytes"]),
])
def test_compared_metrics(run_shared, platform, compared):
    keep, skipped = golden.compared_metrics(METRICS, run_shared, platform)
    assert keep == compared and sorted(keep + skipped) == sorted(METRICS)


def test_a_shared_run_is_held_to_a_real_golden_on_losses_only(tmp_path, monkeypatch, capsys):
    """Step times 100x off and memory 10x off the real golden: not compared; losses are."""
    monkeypatch.setattr(run_case.fit, "preflight", lambda placement, flags, environ=None: "2 ranks per GPU (test)")
    case = _case(tmp_path / "cases", "c")
    _golden(case, "dgx_h200", mem=1000.0, secs=0.0005)
    result = run_case.run_case(case, launch=Launch(Placement(nproc=1, ranks_per_gpu=1)), output_root=tmp_path / "o",
                               platform="dgx_h200")
    assert result.status == "FAIL"  # on its own GPU the same run is held to the memory and step times
    shared = Launch(Placement(nproc=2, ranks_per_gpu=2))
    # NPROC 2 for the shared launch: the golden holds the recipe's rank count.
    case2 = _case(tmp_path / "cases2", "c", nproc=2)
    values = {"lm loss": {s: 10.0 - s / 2 for s in range(1, 5)}, "num-zeros": dict.fromkeys(range(1, 5), 0.0),
              "mem-allocated-bytes": dict.fromkeys(range(1, 5), 1000.0 * 2**20),
              "iteration-time": dict.fromkeys(range(1, 5), 0.0005)}
    save(case2, "dgx_h200", values)
    monkeypatch.setattr(run_case.torchrun, "command",
                        lambda placement, target, python=sys.executable: [python, *target])
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = run_case.run_case(case2, launch=shared, output_root=tmp_path / "o2", platform="dgx_h200")
    assert result.status == "PASS", result.reasons
    assert "mem-allocated-bytes, iteration-time not compared" in capsys.readouterr().out
    values["lm loss"][3] += 1e-6
    save(case2, "dgx_h200", values)
    result = run_case.run_case(case2, launch=shared, output_root=tmp_path / "o2", platform="dgx_h200")
    assert result.status == "FAIL" and any("lm loss @ step 3" in r for r in result.reasons), result.reasons


def test_recording_refuses_what_a_golden_cannot_hold(tmp_path):
    case = _case(tmp_path / "cases", "c", nproc=2)
    with pytest.raises(UserError, match="records goldens of NPROC=2 ranks, and this launch has 4"):
        run_case.run_case(case, launch=Launch(Placement(nproc=4, ranks_per_gpu=4)), record=True,
                          platform="dgx_h100_shared", output_root=tmp_path / "o")
    assert not list(case.glob("golden_values_*"))


def test_another_rank_count_compares_no_golden_and_reruns_the_twin(tmp_path, capsys):
    """NPROC=1 cases launched with 2 ranks: the goldens (1 rank) are not compared, and the twin's
    metrics from a 1-rank run are not reused: it runs again at 2."""
    cases = tmp_path / "cases"
    twin = _case(cases, "twin")
    other = _case(cases, "other", compare_to="../twin")
    _golden(twin, "dgx_h200")
    _golden(other, "dgx_h200")
    out = tmp_path / "o"
    assert run_case.run_case(twin, launch=Launch(Placement(nproc=1)), output_root=out).status == "PASS"
    twin_result = json.loads((out / "hybrid" / "twin" / "result.json").read_text())
    assert twin_result["world_size"] == 1
    result = run_case.run_case(other, launch=Launch(Placement(nproc=2)), output_root=out)
    assert result.status == "PASS", result.reasons  # twin re-run at 2 ranks: the same losses
    assert json.loads((out / "hybrid" / "twin" / "result.json").read_text())["world_size"] == 2
    assert "holds a run of NPROC=1 ranks and this one has 2: not compared" in capsys.readouterr().out


def test_a_run_that_outlives_its_last_step_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(run_case, "EXIT_AFTER_LAST_STEP_S", 1.0)
    monkeypatch.setenv("FAKE_SLEEP_AFTER_S", "3")
    case = _case(tmp_path / "cases", "c")
    _golden(case, "dgx_h200")
    result = run_case.run_case(case, launch=Launch(Placement(nproc=1), timeout_s=60), output_root=tmp_path / "o")
    assert result.status == "FAIL"
    assert any("s after its last step, more than 1 s: a hang at exit" in r for r in result.reasons), \
        result.reasons
    assert result.runs[0].exit_after_last_step_s is not None and result.runs[0].exit_after_last_step_s >= 3


def test_run_problem_names_the_hang_beside_the_exit():
    assert run_case.run_problem(RunRecord("l", 0, False, 2.0), 1) is None
    hung = RunRecord("l", -9, True, 150.0)
    assert run_case.run_problem(hung, 1) == ("run 1 exited with -9 (timeout); its ranks were still alive 150 s "
                                             "after its last step, more than 30 s: a hang at exit")


def test_master_port_from_the_environment_is_checked():
    assert run_case.env_port({}) is None and run_case.env_port({"MASTER_PORT": "29511"}) == 29511
    with pytest.raises(UserError, match="is not a TCP port"):
        run_case.env_port({"MASTER_PORT": "http"})


# ------------------------------------------------------------------------ batch runner


def test_a_shared_run_prefers_the_modes_own_golden_then_real_ones(tmp_path):
    """[Note: choosing a golden]: the mode's golden of this kind, a real one of this kind, a real one of another."""
    case = _case(tmp_path / "cases", "c", nproc=2)
    recipe = load_recipe(case)
    env = fake_environment(gpu="dgx_h100")

    def held_to() -> str:
        chosen = run_case.choose_golden(recipe, env, None, shared=True)
        return chosen.path.name if chosen.matched else f"none: record {chosen.path.name}"

    assert held_to() == "none: record golden_values_torch_dgx_h100_shared.json"
    _golden(case, "dgx_h200")
    assert held_to() == "golden_values_torch_dgx_h200.json"  # another kind's real one
    _golden(case, "dgx_h100")
    assert held_to() == "golden_values_torch_dgx_h100.json"
    _golden(case, "dgx_h100_shared")
    assert held_to() == "golden_values_torch_dgx_h100_shared.json"


def test_twins_run_first_and_are_added_when_missing(tmp_path):
    cases = tmp_path / "cases"
    _case(cases, "twin")
    a, b = _case(cases, "a", compare_to="../twin"), _case(cases, "b")
    waves = batch.ordered([a, b])
    assert [[r.name for r in w] for w in waves] == [["b", "twin"], ["a"]]


def test_a_twin_that_compares_with_its_own_twin_runs_a_wave_earlier(tmp_path):
    cases = tmp_path / "cases"
    _case(cases, "eager")
    _case(cases, "fused", compare_to="../eager")
    graphed = _case(cases, "graphed", compare_to="../fused")
    waves = batch.ordered([graphed])
    assert [[r.name for r in w] for w in waves] == [["eager"], ["fused"], ["graphed"]]


def test_a_cycle_of_twins_is_refused(tmp_path):
    cases = tmp_path / "cases"
    _case(cases, "a", compare_to="../b")
    b = _case(cases, "b", compare_to="../a")
    with pytest.raises(UserError, match="COMPARE_TO forms a cycle: hybrid/b -> hybrid/a -> hybrid/b"):
        batch.ordered([b])


@pytest.mark.parametrize(("shift", "passes"), [("0.01", True), ("0.5", False)])
def test_compare_rtol_holds_a_twin_within_the_tolerance(tmp_path, shift, passes):
    cases = tmp_path / "cases"
    _case(cases, "twin")
    near = _case(cases, "near", compare_to="../twin",
                 extra=("COMPARE_RTOL: 0.005", "ENV_VARS:", f"  FAKE_LOSS_SHIFT: '{shift}'"))
    assert load_recipe(near).compare_rtol == 0.005
    summary = tmp_path / "summary.txt"
    rc = batch.main([str(near), "--platform", "dgx_test", "--output-dir", str(tmp_path / "o"),
                     "--summary", str(summary), "--timeout-s", "60", "--record-missing"])
    lines = summary.read_text().splitlines()
    assert (rc == 0) == passes, lines
    near_line = next(line for line in lines if "[hybrid/near]" in line)
    assert (": PASS " in near_line) == passes, near_line


@pytest.mark.parametrize(("extra", "match"), [
    (("COMPARE_RTOL: 0.005",), "COMPARE_RTOL is only for a case with COMPARE_TO"),
    (("COMPARE_TO: ../twin", "COMPARE_RTOL: 0.2"), r"COMPARE_RTOL must be a number in \(0, 0.05\], got 0.2"),
    (("COMPARE_TO: ../twin", "COMPARE_RTOL: 0"), r"COMPARE_RTOL must be a number in \(0, 0.05\], got 0"),
    (("COMPARE_TO: ../twin", "COMPARE_RTOL: yes"), r"COMPARE_RTOL must be a number in \(0, 0.05\], got True"),
])
def test_compare_rtol_is_checked_when_the_recipe_loads(tmp_path, extra, match):
    cases = tmp_path / "cases"
    _case(cases, "twin")
    with pytest.raises(UserError, match=match):
        load_recipe(_case(cases, "bad", extra=extra))


def test_batch_runs_cases_and_summarizes(tmp_path):
    cases = tmp_path / "cases"
    _case(cases, "twin")
    other = _case(cases, "other", compare_to="../twin")
    summary = tmp_path / "summary.txt"
    rc = batch.main([str(other), "--record-missing", "--platform", "dgx_test", "--output-dir", str(tmp_path / "o"),
                     "--summary", str(summary), "--timeout-s", "60"])
    lines = summary.read_text().splitlines()
    assert rc == 0, lines
    assert lines[-1] == "2 of 2 cases passed" and "(recorded)" in lines[0] and "[hybrid/twin]" in lines[0]
    assert len(list((cases / "hybrid" / "other").glob("golden_values_*_dgx_test.json"))) == 1


def test_gpu_slots_hand_out_disjoint_gpus_and_wait_for_free_ones():
    slots = batch.GpuSlots(["0", "1", "2", "3"])
    held: list[set[str]] = []
    lock = threading.Lock()
    overlaps, peak = [], [0]

    def case(ranks: int) -> None:
        with slots.take(ranks) as gpus:
            mine = set(gpus.split(","))
            with lock:
                assert len(mine) == ranks
                overlaps.extend(mine & other for other in held if mine & other)
                held.append(mine)
                peak[0] = max(peak[0], sum(map(len, held)))
            time.sleep(0.05)
            with lock:
                held.remove(mine)

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(case, [2, 2, 2, 1, 1, 1, 1, 4]))
    assert not overlaps and peak[0] == 4 and sorted(slots.free) == ["0", "1", "2", "3"]


def test_batch_runs_gpu_cases_side_by_side_on_gpus_of_their_own(tmp_path, monkeypatch):
    cases = [_case(tmp_path / "cases", name, nproc=2) for name in ("a", "b")]
    given: dict[str, list[str]] = {}

    def fake_case(recipe, ns, shared, running, env):
        given[recipe.name] = env
        time.sleep(0.2)
        return batch.Outcome(recipe.name, 0, 0.2, "PASS", "dgx_test", False)

    monkeypatch.setattr(batch, "trains_on_gpus", lambda recipe: True)
    monkeypatch.setattr(batch, "check_gpus", lambda recipes, ns: None)
    monkeypatch.setattr(batch, "run_case", fake_case)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert batch.main([*map(str, cases), "--jobs", "2", "--output-dir", str(tmp_path / "o")]) == 0
    gpus = [set(env[0].removeprefix("CUDA_VISIBLE_DEVICES=").split(",")) for env in given.values()]
    assert len(gpus) == 2 and all(len(g) == 2 for g in gpus) and gpus[0] | gpus[1] == {"4", "5", "6", "7"}


@pytest.mark.parametrize(("nproc", "extra", "refusal"), [
    (8, [], "a case of 8 ranks needs as many GPUs of its own and 4 are visible here"),
    (2, ["--env", "CUDA_VISIBLE_DEVICES=0"], "--env CUDA_VISIBLE_DEVICES would give every case the same ones"),
])
def test_batch_refuses_side_by_side_cases_it_cannot_place(tmp_path, monkeypatch, capsys, nproc, extra, refusal):
    case = _case(tmp_path / "cases", "c", nproc=nproc)
    monkeypatch.setattr(batch, "trains_on_gpus", lambda recipe: True)
    monkeypatch.setattr(batch, "check_gpus", lambda recipes, ns: None)
    monkeypatch.setattr(batch, "run_case", lambda *a: pytest.fail("no case may start"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert batch.main([str(case), "--jobs", "2", *extra]) == 2
    assert refusal in capsys.readouterr().err
