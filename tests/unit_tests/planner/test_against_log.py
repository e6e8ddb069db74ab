"""hfsdp.planner.against_log: a run's logged max-pool pools held to the planner's, read from its log."""

from __future__ import annotations

import os

import pytest

from hfsdp.planner import against_log as al
from hfsdp.usererror import UserError

LOG = """\
$ /usr/bin/python -m torch.distributed.run --nproc-per-node 2 -m hfsdp.launch.shared_gpu --ranks-per-gpu 2 -- \
pretrain_gpt.py --hidden-size 256 --num-layers 4 --fp8-param-gather --tensorboard-dir '/tmp/a b'
using world size: 2, data-parallel size: 2, context-parallel size: 1
INFO:x.allocator:[fsdp_params] max-pool plan: 4 units, pool 2629632 B = 2.51 MiB (2 groups)
INFO:x.allocator:[fsdp_grads] max-pool plan: 4 units, pool 10502144 B = 10.02 MiB (2 groups)
INFO:x.allocator:[fsdp_params] max-pool plan: 4 units, pool 2629632 B = 2.51 MiB (2 groups)
"""


def test_a_log_gives_its_flags_size_and_pools() -> None:
    run = al.read_log(LOG, "run1.log")
    assert run.flags == ("--hidden-size", "256", "--num-layers", "4", "--fp8-param-gather",
                         "--tensorboard-dir", "/tmp/a b")
    assert run.dp_size == 2
    assert run.pools == {"fsdp_params": 2629632, "fsdp_grads": 10502144}
    assert run.pool_bytes == 13131776


@pytest.mark.parametrize("drop, words", [
    ("$ ", "command line"),
    ("using world size", "data-parallel size"),
    ("max-pool plan", "no max-pool plan"),
])
def test_a_log_without_what_it_needs_is_refused_naming_it(drop: str, words: str) -> None:
    text = "\n".join(line for line in LOG.splitlines() if not line.startswith(drop) and drop not in line)
    with pytest.raises(UserError, match=words):
        al.read_log(text, "run1.log")


def test_verdict_holds_only_for_equal_bytes() -> None:
    run = al.read_log(LOG, "run1.log")
    assert al.verdict(run, 13131776)[0]
    same, said = al.verdict(run, 13131777)
    assert not same and "!= plan" in said and "13,131,777" in said and "13,131,776" in said
    same, said = al.verdict(run, None)
    assert not same and "planner failed" in said


def test_main_plans_each_log_at_its_size_and_fails_on_a_mismatch(tmp_path, monkeypatch, capsys) -> None:
    log = tmp_path / "run1.log"
    log.write_text(LOG)
    asked = []

    def planned(flags, dp_size, env, see_gpus=False):
        asked.append((tuple(flags), dp_size, see_gpus))
        return planned.value

    monkeypatch.setattr(al.pools, "planned_maxpool_bytes", planned)
    planned.value = 13131776
    assert al.main([str(log)]) == 0 and "= plan" in capsys.readouterr().out
    assert asked == [(al.read_log(LOG, "x").flags, 2, True)]  # after the run: TE's layers may need the GPU
    planned.value = 1
    assert al.main([str(log)]) == 1 and "!= plan" in capsys.readouterr().out


def test_unreadable_input_is_refused_before_any_planner_runs(tmp_path, monkeypatch) -> None:
    good = tmp_path / "run1.log"
    good.write_text(LOG)
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)
    monkeypatch.setattr(al.pools, "planned_maxpool_bytes", lambda *a, **k: pytest.fail("planner ran"))
    for bad in (tmp_path / "missing.log", fifo):
        with pytest.raises(UserError, match="does not exist|named pipe"):
            al.main([str(good), str(bad)])


def test_a_deterministic_runs_plan_gets_the_variables_megatron_checks_unless_given() -> None:
    assert al.planner_env(["--deterministic-mode"], {})["NCCL_ALGO"] == "Ring"
    assert al.planner_env(["--deterministic-mode"], {"NCCL_ALGO": "Tree"})["NCCL_ALGO"] == "Tree"
    assert "NCCL_ALGO" not in al.planner_env(["--bf16"], {})


def test_the_reference_examples_own_flags_are_left_to_it() -> None:
    example = LOG.replace("pretrain_gpt.py", "examples/reference_kl/train.py", 1)
    first = next(line for line in example.splitlines() if line.startswith("$ "))
    assert "reference_kl/train.py" in first
    example = example.replace(first, first + " --reference-kl-weight 0 --reference-free-after 10", 1)
    assert al.read_log(example, "x").flags == al.read_log(LOG, "x").flags


def test_a_scoped_models_pool_lines_are_read_under_their_scope() -> None:
    scoped = LOG + "[reference.fsdp_params] max-pool plan: 2 units, pool 512 B\n"
    assert al.read_log(scoped, "x").pools["reference.fsdp_params"] == 512
