"""Benchmark aggregation, ordering, JSON and chart writer (CPU only, no megatron needed)."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from hfsdp.bench import results as R
from hfsdp.bench.chart import ChartUnavailable, write_chart


def run(config, repeat, times, alloc=1000, resv=2000, pool=None, tokens=4096):
    return R.RunResult(config, repeat, tuple(times), tokens, alloc, resv, pool)


def test_median_and_run_median():
    assert R.median([3.0, 1.0, 2.0]) == 2.0
    assert R.median([1.0, 2.0, 3.0, 10.0]) == 2.5
    with pytest.raises(ValueError):
        R.median([])
    assert run("a", 0, [0.3, 0.1, 0.2, 5.0, 0.2]).median_step_s == 0.2


def test_run_rejects_empty_or_bad_times():
    with pytest.raises(ValueError):
        run("a", 0, [])
    with pytest.raises(ValueError):
        run("a", 0, [0.1, 0.0])


def test_interleaved_order_rotates_every_config_through_every_slot():
    order = R.interleaved_order(["a", "b", "c"], 3)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                     (2, "c"), (2, "a"), (2, "b")]
    firsts = [order[i * 3][1] for i in range(3)]
    assert sorted(firsts) == ["a", "b", "c"]
    with pytest.raises(ValueError):
        R.interleaved_order(["a"], 0)


def test_summarize_medians_ratios_and_peaks():
    runs = [
        run("no_db", 0, [0.10, 0.10], alloc=1000, resv=4000),
        run("no_db", 1, [0.12, 0.12], alloc=1100, resv=4000),
        run("no_db", 2, [0.50, 0.50], alloc=900, resv=4000),  # outlier run: median ignores it
        run("maxpool", 0, [0.09], alloc=800, resv=3000, pool=300),
        run("maxpool", 1, [0.09], alloc=850, resv=3000, pool=300),
        run("maxpool", 2, [0.10], alloc=820, resv=3200, pool=300),
    ]
    planned = {"maxpool": {"pool_bytes": 280, "analytic_minimum_bytes": 256}}
    s = {x.config: x for x in R.summarize(runs, planned=planned)}
    assert s["no_db"].median_step_s == pytest.approx(0.12)
    assert s["no_db"].peak_allocated_bytes == 1100  # max over runs
    assert s["maxpool"].median_step_s == pytest.approx(0.09)
    assert s["maxpool"].step_time_ratio == pytest.approx(0.09 / 0.12)
    assert s["maxpool"].tokens_per_s == pytest.approx(4096 / 0.09)
    assert s["maxpool"].tokens_per_s_ratio == pytest.approx(0.12 / 0.09)
    assert s["maxpool"].peak_reserved_ratio == pytest.approx(3200 / 4000)
    assert s["maxpool"].pool_bytes_planned == 280 and s["maxpool"].pool_bytes_measured == 300
    assert s["no_db"].step_time_ratio == 1.0
    assert (s["maxpool"].min_run_median_s, s["maxpool"].max_run_median_s) == (0.09, 0.10)


def test_summarize_without_baseline_leaves_ratios_empty():
    (s,) = R.summarize([run("maxpool", 0, [0.1])])
    assert s.step_time_ratio is None and s.peak_allocated_ratio is None


def test_summarize_rejects_inconsistent_tokens():
    with pytest.raises(ValueError):
        R.summarize([run("a", 0, [0.1], tokens=1), run("a", 1, [0.1], tokens=2)])


def test_table_and_json_roundtrip(tmp_path):
    runs = [run("no_db", 0, [0.2]), run("fixedpool", 0, [0.1], pool=2 * R.MIB)]
    summaries = R.summarize(runs)
    table = R.format_table(summaries)
    assert table[0].startswith("config") and len(table) == 4
    cells = table[3].split()
    assert cells[0] == "fixedpool" and cells[2] == "100.0"  # median step in ms
    assert cells[5] == "2.000"  # tokens/s ratio vs no_db (half the step time)
    path = tmp_path / "r.json"
    R.write_json(str(path), R.to_json(summaries, runs, {"nproc": 2}))
    doc = json.loads(path.read_text())
    assert doc["meta"] == {"nproc": 2}
    assert [x["config"] for x in doc["summary"]] == ["no_db", "fixedpool"]
    back = [R.run_from_dict(d) for d in doc["runs"]]
    assert back == runs


def test_table_columns_stay_aligned_for_long_config_names():
    runs = [run("no_db", 0, [0.2]), run("maxpool_lanes3_graph", 0, [0.1], pool=2 * R.MIB)]
    table = R.format_table(R.summarize(runs))
    assert table[0].index("runs") == table[2].index("   1") == table[3].index("   1")


def test_chart_missing_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ChartUnavailable, match="matplotlib"):
        write_chart(str(tmp_path / "c.png"), R.summarize([run("no_db", 0, [0.1])]), "t")


def test_chart_writes_png(tmp_path):
    runs = [run("no_db", 0, [0.2]), run("maxpool", 0, [0.1])]
    out = tmp_path / "c.png"
    write_chart(str(out), R.summarize(runs), "title")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        write_chart(str(out), [], "empty")


def _run(config, repeat, losses):
    return R.RunResult(config=config, repeat=repeat, step_times_s=(0.1,), tokens_per_step=8,
                       peak_allocated_bytes=1, peak_reserved_bytes=1, lm_loss=tuple(losses))


def test_loss_agreement_flags_the_first_divergent_step():
    ref = (11.0, 10.5, 10.25, 10.0)
    runs = [_run("no_db", 0, ref), _run("maxpool", 0, ref),
            _run("maxpool", 1, (11.0, 10.5, 10.250001, 10.0)), _run("no_db", 1, ref),
            _run("fixedpool", 0, ref[:3])]
    agreement = R.loss_agreement(runs)
    assert agreement["reference"] == list(ref) and agreement["baseline_distinct_sequences"] == 1
    verdicts = {(r["config"], r["repeat"]): r["first_divergent_step"] for r in agreement["runs"]}
    assert verdicts == {("no_db", 0): None, ("maxpool", 0): None, ("maxpool", 1): 3,
                        ("no_db", 1): None, ("fixedpool", 0): 4}
    text = "\n".join(R.format_loss_agreement(agreement))
    assert "maxpool      repeat 1: DIFFERS from step 3" in text
    assert "maxpool      repeat 0: bit-identical" in text


def test_loss_agreement_reference_is_the_majority_baseline():
    a, b = (1.0, 2.0), (1.0, 2.5)
    agreement = R.loss_agreement([_run("no_db", 0, b), _run("no_db", 1, a), _run("no_db", 2, a)])
    assert agreement["reference"] == list(a) and agreement["baseline_distinct_sequences"] == 2
    alone = R.loss_agreement([_run("no_db", 0, a)])
    assert R.format_loss_agreement(alone) == ["loss agreement: 1 no_db run and nothing held to it, nothing to compare"]
    assert R.format_loss_agreement(agreement) == ["loss agreement among 3 no_db runs: 2 distinct sequences"]
    same = R.loss_agreement([_run("no_db", 0, a), _run("no_db", 1, a)])
    assert R.format_loss_agreement(same) == ["loss agreement among 2 no_db runs: bit-identical"]
    missing = R.loss_agreement([_run("maxpool", 0, a)])
    assert missing["reference"] is None
    assert R.format_loss_agreement(missing) == ["loss agreement: no no_db losses to hold maxpool to"]


def _diverged(path):
    runs = [R.run_from_dict(r) for r in json.loads(path.read_text())["runs"]]
    return {(r["config"], r["repeat"]): r["first_divergent_step"]
            for r in R.loss_agreement(runs)["runs"] if not r["identical"]}


def test_loss_agreement_on_the_recorded_gpu_runs():
    """The recorded 2xH200 benchmarks (no --deterministic-mode): which runs diverged, and where."""
    import pathlib

    here = pathlib.Path(__file__)
    # The benchmark at commit 23949bc (docs/results.md): two double-buffered runs
    # diverged mid-run.
    assert _diverged(here.parent / "data" / "benchmark-results-2026-11-22-23949bc.json") == {
        ("fixedpool", 0): 4, ("maxpool", 1): 7}
    # The one at commit 591ed8f: a no_db run diverged too.
    assert _diverged(here.parents[3] / "docs" / "results" / "2026-11-22-591ed8f-default-dp2.json") == {
        ("maxpool", 1): 12, ("no_db", 1): 3}


def test_profiling_fields_survive_the_worker_record_roundtrip(tmp_path):
    # The worker writes these only in profiling passes; the runner used to drop them on read.
    record = {"config": "maxpool_ub", "repeat": 0, "step_times_s": [0.3], "tokens_per_step": 4096,
              "peak_allocated_bytes": 1, "peak_reserved_bytes": 2,
              "nccl_kernels": {"symmetric": {"ncclSymkDevKernel_AllGather_ST": 16}, "other": {}},
              "timeline": [{"step": 0, "exposed_nccl_ms": 1.5}],
              "memory_peak": {"peak_bytes": 7}}
    got = R.run_from_dict(record)
    assert got.nccl_kernels == record["nccl_kernels"]
    assert got.timeline == record["timeline"] and got.memory_peak == record["memory_peak"]
    doc = R.to_json(R.summarize([got]), [got], {})
    assert doc["runs"][0]["nccl_kernels"] == record["nccl_kernels"]
    assert doc["runs"][0]["timeline"] == record["timeline"]


def test_pool_check_compares_pool_with_plan_and_counts_home_misses():
    mib = R.MIB

    def pooled(config, repeat, pool, misses):
        return dataclasses.replace(run(config, repeat, [0.1], pool=pool * mib),
                                   maxpool_stats={"home_misses": misses})

    runs = [run("maxpool", 0, [0.1]), pooled("maxpool", 0, 300, 0),
            pooled("maxpool_lanes3", 0, 200, 2), pooled("maxpool_lanes3", 1, 200, 0)]
    planned = {"maxpool": {"pool_bytes": 300 * mib}, "maxpool_lanes3": {"pool_bytes": 100 * mib}}
    # No baseline: no memory clause.
    lines = R.format_pool_check(R.summarize(runs, planned=planned), runs, dp_size=2)
    assert lines[0] == "pool check:" and len(lines) == 3
    assert lines[1].split() == ["maxpool", "pool", "=", "plan;", "home", "misses", "0"]
    assert lines[2].split() == ["maxpool_lanes3", "pool", "!=", "plan", "(200.0", "vs", "100.0",
                                "MiB);", "home", "misses", "2"]
    assert R.format_pool_check(R.summarize(runs[:1]), runs[:1], dp_size=2) == []


def test_pool_check_holds_the_extra_peak_to_the_planned_pool():
    """What max-pool adds to the baseline's peak allocated memory is at most its planned pool."""
    mib = R.MIB
    runs = [run("no_db", 0, [0.2], alloc=4323 * mib), run("maxpool", 0, [0.2], alloc=4518 * mib, pool=384 * mib),
            run("maxpool_lanes3", 0, [0.2], alloc=4600 * mib, pool=264 * mib)]
    planned = {"maxpool": {"pool_bytes": 384 * mib}, "maxpool_lanes3": {"pool_bytes": 264 * mib}}
    lines = R.format_pool_check(R.summarize(runs, planned=planned), runs, dp_size=2)
    assert lines[1].endswith("peak allocated +195.0 MiB over no_db (1.045x), within the planned pool")
    assert lines[2].endswith("peak allocated +277.0 MiB over no_db (1.064x), MORE than the planned pool")


def test_pool_check_at_data_parallel_size_1_says_no_pool_exists():
    """At DP=1 no pool exists by design: the check says so in the main job's words, not '!= plan'."""
    from hfsdp.planner.pools import NEVER_GATHERED

    mib = R.MIB
    runs = [run("no_db", 0, [0.2], alloc=4323 * mib), run("maxpool", 0, [0.2], alloc=4330 * mib, pool=0),
            run("maxpool_lanes3", 0, [0.2], alloc=4330 * mib, pool=0)]
    planned = {"maxpool": {"pool_bytes": 0}, "maxpool_lanes3": {"pool_bytes": 0}}
    lines = R.format_pool_check(R.summarize(runs, planned=planned), runs, dp_size=1)
    for line in lines[1:]:
        assert f"pool none ({NEVER_GATHERED}, so no double-buffer pool is allocated)" in line, line
        assert "!= plan" not in line and "planned pool" not in line, line
    assert lines[1].endswith("peak allocated +7.0 MiB over no_db (1.002x)")


def test_without_speed_keeps_memory_and_drops_every_step_time():
    runs = [run("no_db", 0, [0.2, 0.3]), run("maxpool", 0, [0.1, 0.1], pool=5)]
    doc = R.without_speed(R.to_json(R.summarize(runs), runs, {}))
    for s in doc["summary"]:
        assert all(s[k] is None for k in R.SPEED_FIELDS) and s["peak_allocated_bytes"] == 1000
    assert all(r["step_times_s"] is None and r["median_step_s"] is None for r in doc["runs"])
    table = R.format_table(R.summarize(runs), speed=False)
    assert "250.0" not in "\n".join(table) and table[2].split()[2:6] == ["-", "-", "-", "-"]
    assert "ranks share each GPU" in R.no_speed_note(2)


def test_machine_names_what_the_runs_report():
    def run(torch, device):
        return R.RunResult("no_db", 0, (0.1,), 1, 1, 1, torch=torch, device=device)

    assert R.machine([run("2.11.0+cu130", "NVIDIA H100 80GB HBM3")] * 2) == {
        "torch": "2.11.0+cu130", "device": "NVIDIA H100 80GB HBM3"}
    assert R.machine([run("2.11.0", "H100"), run("2.12.0", "H100")])["torch"] == "2.11.0, 2.12.0"
    assert R.machine([run(None, None)]) == {}, "profiling runs report no machine"
