"""The step's statistics without host reads ([Note: host reads in a step]), on the CPU.

Upstream's reductions are stood in for by the same arithmetic on CPU tensors (float32, MAX, -1 for
none; MIN over ``input is True``); a reduction called where the one-rank path needs none fails the
test. The two-rank cases run two gloo processes. The reads themselves (no stream sync between log
iterations) are checked on a GPU by ``test_step_host_reads_gpu.py``.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.core import step_host_reads as shr

GROUP = object()  # a stand-in process group; its size comes from the patched get_world_size


def upstream_max(stat):
    """reduce_max_stat_across_model_parallel_group's arithmetic over one rank, on the CPU."""
    value = torch.tensor([-1.0 if stat is None else stat], dtype=torch.float32)
    return None if value.item() == -1.0 else value.item()


def upstream_and(flag):
    return bool(torch.tensor([1 if flag is True else 0], dtype=torch.int).item())


class Recorder:
    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, stat, **kwargs):
        self.calls.append((stat, kwargs))
        return self.fn(stat)


class NormThatMustNotBeRead:
    """A norm whose comparison is a host read: comparing it fails the test."""

    def __gt__(self, other):
        raise AssertionError("the norm was read")


@pytest.fixture
def world(monkeypatch):
    sizes = {"n": 1}
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: sizes["n"])
    return sizes


def test_switch_values():
    assert shr.every_step({}) is False
    assert shr.every_step({shr.ENV: "0"}) is False
    assert shr.every_step({shr.ENV: "1"}) is True
    with pytest.raises(ValueError, match=r"HFSDP_HOST_READS_EVERY_STEP='yes'"):
        shr.every_step({shr.ENV: "yes"})


def test_infinite_threshold_does_not_read_the_norm():
    assert shr.norm_exceeds(NormThatMustNotBeRead(), math.inf, {}) is False
    with pytest.raises(AssertionError, match="was read"):
        shr.norm_exceeds(NormThatMustNotBeRead(), math.inf, {shr.ENV: "1"})


@pytest.mark.parametrize("threshold", [1.0, -math.inf, math.nan, 1e30])
@pytest.mark.parametrize("norm", [0.5, 2.0, math.inf, math.nan])
def test_other_thresholds_compare_as_upstream(norm, threshold):
    tensor = torch.tensor([norm])
    assert shr.norm_exceeds(tensor, threshold, {}) is bool(tensor > threshold)
    assert shr.norm_exceeds(norm, threshold, {}) is bool(norm > threshold)


def test_infinite_threshold_answer_is_upstreams():
    for norm in (0.0, 3.5, math.inf, math.nan):
        assert bool(torch.tensor([norm]) > math.inf) is shr.norm_exceeds(torch.tensor([norm]), math.inf, {})


@pytest.mark.parametrize("flag", [True, False, 1, np.bool_(True), None])
def test_one_rank_flag_without_a_collective(world, flag):
    reduce = Recorder(upstream_and)
    assert shr.all_ranks(flag, reduce, group=GROUP, environ={}) is upstream_and(flag)
    assert reduce.calls == []


def test_several_ranks_or_the_switch_keep_upstreams_flag_reduction(world):
    reduce = Recorder(upstream_and)
    shr.all_ranks(True, reduce, group=GROUP, environ={shr.ENV: "1"})
    world["n"] = 2
    shr.all_ranks(True, reduce, group=GROUP, environ={})
    assert reduce.calls == [(True, {"group": GROUP}), (True, {"group": GROUP})]


@pytest.mark.parametrize("stat", [None, -1.0, 1e-4, 3.0e-5, 0.1, 2.5, 7, 1e40])
def test_one_rank_host_number_is_upstreams_float32(world, stat):
    reduce = Recorder(upstream_max)
    got = shr.max_stat(stat, reduce, group=GROUP, environ={})
    assert reduce.calls == []
    want = upstream_max(stat)
    assert got == want or (got is not None and want is not None and math.isinf(got) and math.isinf(want))
    assert shr.host_stat(got) == got


def test_a_tensor_learning_rate_takes_upstreams_reduction(world):
    """A captured optimizer step keeps its learning rate on the device (TE's FusedAdam, capturable)."""
    reduce = Recorder(lambda stat: upstream_max(float(stat)))
    assert shr.max_stat(torch.tensor(1e-4), reduce, group=GROUP, environ={}) == upstream_max(1e-4)
    assert len(reduce.calls) == 1


def test_one_rank_device_norm_is_kept(world):
    reduce = Recorder(upstream_max)
    norm = torch.tensor([2.75])
    assert shr.max_device_stat(norm, reduce, group=GROUP, environ={}) is norm
    assert shr.max_device_stat(None, reduce, group=GROUP, environ={}) is None
    assert reduce.calls == []
    assert shr.host_stat(norm) == upstream_max(norm.item()) == 2.75
    assert shr.host_stat(None) is None
    assert math.isnan(shr.host_stat(torch.tensor([math.nan])))
    assert shr.host_stat(torch.tensor([-1.0])) is None  # upstream's "no rank has it"


def test_host_numbers_and_the_switch_take_upstreams_reduction(world):
    reduce = Recorder(upstream_max)
    assert shr.max_device_stat(1.5, reduce, group=GROUP, environ={}) == 1.5  # one rank: no call
    assert shr.max_device_stat(torch.tensor([1.5]), reduce, group=GROUP, environ={shr.ENV: "1"}) == 1.5
    assert shr.max_stat(0.25, reduce, group=GROUP, environ={shr.ENV: "1"}) == 0.25
    world["n"] = 2
    assert shr.max_device_stat(1.5, reduce, group=GROUP, environ={}) == 1.5
    assert shr.max_stat(None, reduce, group=GROUP, environ={}) is None
    assert len(reduce.calls) == 4


def test_loss_scale_stays_a_tensor_until_read():
    scale = torch.tensor([1.0])
    assert shr.loss_scale(scale, {}) is scale
    assert shr.host_float(scale) == 1.0 and isinstance(shr.host_float(scale), float)
    assert shr.loss_scale(scale, {shr.ENV: "1"}) == 1.0
    assert shr.host_float(65536.0) == 65536.0


TWO_RANKS = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from megatron.core import step_host_reads as shr
    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = dist.group.WORLD

    def upstream_max(stat, group=None):  # the collective upstream issues, on CPU tensors
        value = torch.tensor([-1.0 if stat is None else stat], dtype=torch.float32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return None if value.item() == -1.0 else value.item()

    both = shr.max_device_stat(torch.tensor([3.0 + 2 * rank]), upstream_max, group=group, environ={})
    # rank 0 holds a host number, rank 1 a device norm: one collective each, the same answer
    mixed = shr.max_device_stat(2.0 if rank == 0 else torch.tensor([4.5]), upstream_max,
                                group=group, environ={})
    nan = shr.max_device_stat(torch.tensor([float("nan") if rank else 1.0]), upstream_max,
                              group=group, environ={})
    json.dump({"both": shr.host_stat(both), "mixed": shr.host_stat(mixed),
               "both_is_tensor": isinstance(both, torch.Tensor), "nan": repr(shr.host_stat(nan))},
              open(f"{out}/rank{rank}.json", "w"))
    dist.destroy_process_group()
""")


def test_two_ranks_reduce_a_device_norm_on_the_device(tmp_path: Path):
    import json

    import megatron.core

    tree = str(Path(megatron.core.__file__).resolve().parents[2])
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(r), init, str(tmp_path)],
                              env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for got in results:
        assert got["both"] == 5.0 and got["both_is_tensor"] is True
        assert got["mixed"] == 4.5
    # MAX with a NaN is what gloo's MAX makes of it; both ranks agree, as upstream's would
    assert results[0]["nan"] == results[1]["nan"]
