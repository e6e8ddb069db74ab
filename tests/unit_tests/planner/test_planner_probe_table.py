"""What a new user tried on the memory planner (scripts/fsdp_memory_planner.py), row by row.

Each row is an input, the exit status it must give and a fragment of what it must say (stdout and
stderr together); no row may end in a traceback. A refused row writes no plan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from hfsdp.planner import cli
from hfsdp.training import fsdp_units, requirements

# A small model of your own (its depth is given, so no defaults), buildable without TE or APEX.
SMALL = ["--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "1", "--vocab-size", "1000",
         "--tokenizer-type", "NullTokenizer", "--bf16", "--transformer-impl", "local", "--no-persist-layer-norm",
         "--disable-mamba-mem-eff-path", "--normalization", "RMSNorm", "--position-embedding-type", "none",
         "--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
MAX_POOL = ["--megatron-fsdp-max-pool-double-buffer"]


class Row(NamedTuple):
    argv: list[str]  # "TMP" stands for the test's folder
    rc: int
    says: str
    env: dict[str, str] = {}


ROWS: dict[str, Row] = {
    # A hybrid pattern the other flags cannot build: the planner says what pretrain_hybrid.py says.
    "E without --num-experts": Row(["--hybrid-layer-pattern", "M*EM*E", *SMALL], 2,
                                   "--hybrid-layer-pattern 'M*EM*E' has MoE layers (E) but no --num-experts"),
    "G with local specs": Row(["--hybrid-layer-pattern", "MG", *SMALL], 2,
                              "has G layers (Gated DeltaNet, DeepSeek sparse attention), which --transformer-impl"),
    "D with local specs": Row(["--hybrid-layer-pattern", "M*D", *SMALL], 2, "has D layers"),
    "E with --num-experts": Row(["--hybrid-layer-pattern", "M*E", *SMALL, "--num-experts", "4"], 0, "units=3"),
    # Flags that pick kernels, not shapes, and model parallelism: planned as training builds them.
    "gradient-accumulation fusion left on": Row(["--num-layers", "2", *SMALL], 0, "units=2"),
    "pipeline parallel 2": Row(["--pipeline-model-parallel-size", "2"], 0, "units=6"),
    # Training's lanes flag is applied as training applies it.
    "--megatron-fsdp-max-pool-lanes 1000": Row([*MAX_POOL, "--megatron-fsdp-max-pool-lanes", "1000"], 2,
                                               "megatron_fsdp_max_pool_lanes (--megatron-fsdp-max-pool-lanes, "
                                               "fully_shard: maxpool_lanes) asks for 1000 lanes, more than the 12 "
                                               "FSDP units of this model chunk"),
    "--megatron-fsdp-max-pool-lanes 4": Row([*MAX_POOL, "--megatron-fsdp-max-pool-lanes", "4"], 0,
                                            "[weight] 4-lane plan"),
    "--megatron-fsdp-max-pool-lanes 4 and --plan-lanes 2": Row(
        [*MAX_POOL, "--megatron-fsdp-max-pool-lanes", "4", "--plan-lanes", "2"], 0, "[grad] 4-lane plan"),
    "--megatron-fsdp-max-pool-lanes without max-pool": Row(["--megatron-fsdp-max-pool-lanes", "4"], 2,
                                                           "needs --megatron-fsdp-max-pool-double-buffer"),
    "--megatron-fsdp-max-pool-lanes x": Row(["--megatron-fsdp-max-pool-lanes", "x"], 2, "invalid int value: 'x'"),
    "--plan-lanes 1000": Row(["--plan-lanes", "1000"], 2, "--plan-lanes 1000 asks for 1000 lanes"),
    "--plan-lanes 1": Row(["--plan-lanes", "1"], 2, "'1' is not a lane count"),
    "max-pool with strategy optim": Row([*MAX_POOL, "--data-parallel-sharding-strategy", "optim"], 2,
                                        "requires --data-parallel-sharding-strategy optim_grads_params"),
    # Models no GPU holds.
    "--hidden-size 1048576": Row(["--hidden-size", "1048576"], 2,
                                 "this model cannot fit any GPU: its double-buffer pools alone take"),
    "--hidden-size 20480 at DP 2": Row(["--hidden-size", "20480"], 0,
                                       "warning: at --plan-dp-size 2 each rank holds at least"),
    "--hidden-size 20480 at DP 64": Row(["--hidden-size", "20480", "--plan-dp-size", "64"], 0, "dp=64"),
    # Unit lists, from the flag or from the variable training reads.
    "--fsdp-unit-modules Foo": Row(["--fsdp-unit-modules", "Foo"], 2, "--fsdp-unit-modules 'Foo': unknown unit class"),
    "--fsdp-unit-modules no.such.Class": Row(["--fsdp-unit-modules", "no.such.Class"], 2, "No module named 'no'"),
    "--fsdp-unit-modules os.path": Row(["--fsdp-unit-modules", "os.path"], 2, "'os.path' does not name a class"),
    "--fsdp-unit-modules none": Row(["--fsdp-unit-modules", "none"], 2, "it names no unit class"),
    "--fsdp-unit-modules torch.nn.Linear": Row(["--fsdp-unit-modules", "torch.nn.Linear"], 2,
                                               "no module of the model is a Linear"),
    "HFSDP_FSDP_UNIT_MODULES=MambaLayer": Row([], 0, "units=4", {fsdp_units.ENV: "MambaLayer"}),
    "HFSDP_FSDP_UNIT_MODULES=Foo": Row([], 2, "$HFSDP_FSDP_UNIT_MODULES 'Foo': unknown unit class",
                                      {fsdp_units.ENV: "Foo"}),
    "--fsdp-unit-modules over the variable": Row(["--fsdp-unit-modules", "MambaLayer"], 0, "units=4",
                                                 {fsdp_units.ENV: "Foo"}),
    # Where the plan goes: checked before the work.
    "--plan-json a folder": Row(["--plan-json", "TMP"], 2, "is a folder, not a file"),
    "--plan-json under a file": Row(["--plan-json", f"{__file__}/plan.json"], 2, "which is a file"),
    "--plan-json empty": Row(["--plan-json", ""], 2, "--plan-json is empty"),
    "--plan-json in a new folder": Row(["--plan-json", "TMP/new/plan.json"], 0, "wrote the plan as JSON"),
    # What the rename of a write in one step would replace: refused, and left as it was (no device here: a
    # regression run as root would replace it).
    "--plan-json a named pipe": Row(["--plan-json", "TMP/pipe"], 2, "pipe is a named pipe, not a regular file"),
    "--plan-json a link to nothing": Row(["--plan-json", "TMP/link"], 2, "link is a symbolic link to nothing; writing"),
    "--plan-json with a space and non-ASCII": Row(["--plan-json", "TMP/pl än/plan 1.json"], 0, "wrote the plan"),
    "HFSDP_DEBUG junk": Row(["--plan-dp-size", "0"], 2, "--plan-dp-size: must be > 0", {"HFSDP_DEBUG": "\x01 no"}),
    "HFSDP_FSDP_UNIT_MODULES white space": Row([], 0, "Megatron-FSDP memory plan:",
                                               {"HFSDP_FSDP_UNIT_MODULES": "  "}),
    # Folders os.access calls writable for root, where no file can be made: refused before the planning.
    "--plan-json in /proc": Row(["--plan-json", "/proc/plan.json"], 2, "--plan-json /proc/plan.json: "),
    "--plan-json in /sys": Row(["--plan-json", "/sys/plan.json"], 2, "--plan-json /sys/plan.json: "),
    # At data-parallel size 1 no pool exists: the plan says so, and plans none.
    "--plan-dp-size 1": Row(["--plan-dp-size", "1"], 0, "[weight] no pool: at data-parallel size 1 Megatron-FSDP "
                                                     "never all-gathers a unit, so no double-buffer pool is allocated"),
    # Flags that would make training read other flags.
    "--yaml-cfg": Row(["--yaml-cfg", __file__], 2, "--yaml-cfg has training read its flags from a YAML file"),
    "--use-checkpoint-args": Row(["--use-checkpoint-args"], 2, "from a checkpoint, which the planner does not read"),
    # Malformed values.
    "--plan-dp-size 0": Row(["--plan-dp-size", "0"], 2, "--plan-dp-size: must be > 0"),
    "--plan-dp-size 1.5": Row(["--plan-dp-size", "1.5"], 2, "'1.5' is not a whole number"),
    "--plan-dp-size 10**11": Row(["--plan-dp-size", "100000000000"], 2, "makes a world of 100,000,000,000 ranks"),
    "a world past the bound by tp": Row(["--plan-dp-size", "65536", "--tensor-model-parallel-size", "2"], 2,
                                        "plans at most 65,536 ranks"),
    "--plan-device-arch 0": Row(["--plan-device-arch", "0"], 2, "--plan-device-arch: must be > 0"),
    "--hidden-size abc": Row(["--hidden-size", "abc"], 2, "invalid int value: 'abc'"),
    "--data-parallel-sharding-strategy foo": Row(["--data-parallel-sharding-strategy", "foo"], 2, "invalid choice"),
}

@pytest.mark.parametrize("name", list(ROWS))
def test_probe_row(name, tmp_path, monkeypatch, call_cli):
    row = ROWS[name]
    monkeypatch.delenv("HFSDP_DEBUG", raising=False)
    monkeypatch.delenv(fsdp_units.ENV, raising=False)
    for key, value in row.env.items():
        monkeypatch.setenv(key, value)
    made = {"TMP/pipe": lambda p: os.mkfifo(p), "TMP/link": lambda p: p.symlink_to(tmp_path / "nowhere")}
    for token, make in made.items():
        if token in row.argv:
            make(tmp_path / token[4:])
    kept = {p.name: os.lstat(p).st_mode for p in tmp_path.iterdir()}
    rc, said = call_cli(cli.main, [a.replace("TMP", str(tmp_path)) for a in row.argv])
    assert "Traceback" not in said, said[-3000:]
    assert rc == row.rc, (rc, said[-3000:])
    assert row.says in said, said[-3000:]
    if rc != 0:
        assert "wrote the plan" not in said
        assert {p.name: os.lstat(p).st_mode for p in tmp_path.iterdir()} == kept, "a refused row changed files"


@pytest.mark.parametrize("path", ["/proc/plan.json", "/sys/plan.json"])
def test_a_plan_json_no_file_can_be_made_at_is_refused_before_the_planning(path, monkeypatch, call_cli):
    monkeypatch.delenv("HFSDP_DEBUG", raising=False)
    monkeypatch.setattr(cli, "plan_from_args", lambda *_a, **_k: pytest.fail("planned before refusing"))
    rc, said = call_cli(cli.main, ["--plan-json", path])
    assert rc == 2 and "Traceback" not in said, said[-3000:]
    assert f"--plan-json {path}: " in said and "Megatron-FSDP memory plan" not in said


def test_the_plan_at_data_parallel_size_1_holds_no_pool(tmp_path, call_cli):
    """No pool at DP=1: 0 bytes in every pool figure of the JSON, none in the rank's memory, and the
    benchmark's planned pools read from it are 0."""
    from hfsdp.bench.run import pools_from_plan

    rc, said = call_cli(cli.main, ["--plan-dp-size", "1", "--plan-json", str(tmp_path / "plan.json")])
    assert rc == 0, said[-2000:]
    assert "max-pool arena plan" not in said and "(0 bytes planned)" in said
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert "no double-buffer pool is allocated" in plan["no_pool"]
    for allocator in plan["allocators"].values():
        assert allocator["pool_allocated"] is False
        assert all(v == 0 for k, v in allocator.items() if k.endswith("_bytes")), allocator
        assert [lp["pool_bytes"] for lp in allocator["lane_plans"].values()] == [0]  # the default 3 lanes
    assert {p["pool_bytes"] for p in pools_from_plan(plan).values()} == {0}


def test_a_plan_json_is_strict_json(tmp_path, call_cli):
    rc, said = call_cli(cli.main, ["--plan-json", str(tmp_path / "new" / "plan.json")])
    assert rc == 0, said[-2000:]
    text = (tmp_path / "new" / "plan.json").read_text()
    assert "NaN" not in text and json.loads(text)["allocators"]["weight"]["lane_plans"]["3"]["pool_bytes"] > 0


def test_the_lanes_flag_plans_what_training_holds(call_cli):
    """Without --plan-lanes: only training's N-lane plan (not the default 3); with it: both."""
    _, said = call_cli(cli.main, [*MAX_POOL, "--megatron-fsdp-max-pool-lanes", "4"])
    assert "4-lane plan" in said and "3-lane plan" not in said
    _, said = call_cli(cli.main, [*MAX_POOL, "--megatron-fsdp-max-pool-lanes", "4", "--plan-lanes", "2"])
    assert "[weight] 2-lane plan" in said and "[weight] 4-lane plan" in said


def test_transformer_engine_asked_for_but_missing_is_one_sentence(monkeypatch, call_cli):
    monkeypatch.delenv("HFSDP_DEBUG", raising=False)
    real: Callable[[str], bool] = requirements.importable
    monkeypatch.setattr(requirements, "importable", lambda name: name != "transformer_engine" and real(name))
    argv = [a for a in SMALL if a not in ("--transformer-impl", "local")]
    rc, said = call_cli(cli.main, ["--hybrid-layer-pattern", "M*", *argv])
    assert rc == 2 and "Traceback" not in said, said[-3000:]
    assert "--transformer-impl transformer_engine needs Transformer Engine" in said
    assert "or pass --transformer-impl local" in said


def test_megatrons_log_lines_go_to_stderr():
    """stdout is the plan alone (``planner | head -1`` is its first line), Megatron's log lines go to
    stderr. A process of its own: Megatron's handler holds the stdout of the process that imported it."""
    repo = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k not in ("HFSDP_DEBUG", fsdp_units.ENV)}
    done = subprocess.run([sys.executable, "scripts/fsdp_memory_planner.py"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("Megatron-FSDP memory plan:"), done.stdout[:500]
    assert "INFO:megatron" not in done.stdout and "INFO:megatron" in done.stderr


def test_ctrl_c_while_planning_is_one_line_and_writes_no_plan(tmp_path, monkeypatch, call_cli):
    monkeypatch.delenv("HFSDP_DEBUG", raising=False)

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "plan_from_args", interrupted)
    rc, said = call_cli(cli.main, ["--plan-json", str(tmp_path / "plan.json")])
    assert rc == 130 and said.rstrip().endswith("fsdp_memory_planner: interrupted"), said[-2000:]
    assert "Traceback" not in said and list(tmp_path.iterdir()) == []
