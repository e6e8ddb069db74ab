"""--nccl-comm-warmup and the eager expert DP-outer group barrier (CPU, gloo).

The multi-rank parts run once per session in ``lifecycle_results`` (conftest): a real 2-rank
gloo job with Megatron's real initialize_model_parallel group list. On CPU every group is
gloo, so the job injects a backend filter that treats Megatron's *_GLOO groups as the gloo
ones and all others as the groups that would be NCCL on GPU.
"""

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron.training import nccl_warmup


def _expected_order(group_list: list[dict[str, Any]]) -> list[str]:
    return [g["desc"] for g in group_list if "GLOO" not in g["desc"].upper() and g["size"] > 1]


def test_every_eligible_group_warmed_once_in_creation_order(lifecycle_results):
    for rank, res in enumerate(lifecycle_results):
        descs = [g["desc"] for g in res["group_list"]]
        touched = res["warm"]["touched"]
        assert touched == _expected_order(res["group_list"]), f"rank {rank}: {touched}"
        assert len(set(touched)) == len(touched), f"rank {rank} warmed a group twice: {touched}"
        positions = [descs.index(d) for d in touched]
        assert positions == sorted(positions), f"rank {rank} not in creation order: {touched}"
        # The groups whose lazy NCCL set-up can deadlock must be among them.
        for needed in ("default_pg", "DATA_PARALLEL_GROUP", "EXPERT_DATA_PARALLEL_GROUP"):
            assert needed in touched, f"rank {rank} skipped {needed}"
    # Same sequence on every rank: that is what keeps lazy NCCL bootstrap deadlock-free.
    assert lifecycle_results[0]["warm"]["touched"] == lifecycle_results[1]["warm"]["touched"]


def test_warmup_report_accounts_for_every_listed_group(lifecycle_results):
    for res in lifecycle_results:
        w = res["warm"]
        assert w["warmed"] == len(w["touched"])
        assert w["warmed"] + w["skipped_backend"] + w["skipped_size_one"] == len(res["group_list"])
        assert w["skipped_backend"] == sum("GLOO" in g["desc"] for g in res["group_list"])
        assert 0.0 <= w["seconds"] < 30.0


def test_warmup_leaves_values_unchanged(lifecycle_results):
    assert all(res["warm"]["state_unchanged"] for res in lifecycle_results)


def test_real_backend_filter_skips_gloo_groups(lifecycle_results):
    for res in lifecycle_results:
        assert res["warm_default_filter"]["touched"] == []
        assert res["warm_default_filter"]["skipped_backend"] == len(res["group_list"])


def test_eager_expert_dp_outer_group(lifecycle_results):
    for res in lifecycle_results:
        eager = res["eager"]
        assert eager["inter_desc"] == "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1"
        assert eager["ran_two_instances"] is True
        assert eager["ran_one_instance"] is False  # num_distributed_optimizer_instances == 1
        assert eager["ran_default_filter_on_gloo"] is False  # not an NCCL group
        assert eager["ran_dense"] is False  # dense model: group is None
        assert eager["barriers"] == [eager["inter_desc"]]  # exactly one barrier, on that group


class _FakeGroup(SimpleNamespace):
    def size(self) -> int:
        return self.n


def test_select_groups_dedupes_and_keeps_first_position():
    a, b, c = _FakeGroup(n=2, tag="a"), _FakeGroup(n=1, tag="b"), _FakeGroup(n=4, tag="c")
    selected, skipped_backend, skipped_one = nccl_warmup.select_groups(
        [c, a, b, a, c], backend_filter=lambda g: True
    )
    assert [g.tag for g in selected] == ["c", "a"]
    assert (skipped_backend, skipped_one) == (0, 1)


def test_warm_up_groups_detects_a_non_inert_collective():
    def corrupting(tensor: torch.Tensor, group: Any = None) -> None:
        tensor.add_(1.0)

    with pytest.raises(RuntimeError, match="returned 1.0"):
        nccl_warmup.warm_up_groups([_FakeGroup(n=2)], torch.device("cpu"), corrupting)


TINY_MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --lr 1e-4 --train-iters 2"
).split()


def test_validate_args_refuses_the_warmup_without_nccl(megatron_validator):
    """The hook in validate_args: the flag parses into the config field, and with a backend that
    has no NCCL communicators to warm it is one sentence naming both flags."""
    validate = megatron_validator(TINY_MODEL, world_size=1)
    assert validate([]).nccl_comm_warmup is False
    assert validate(["--nccl-comm-warmup"]).nccl_comm_warmup is True
    with pytest.raises(ValueError, match="--nccl-comm-warmup warms NCCL communicators, but --distributed-backend "
                                         "is 'gloo'"):
        validate(["--nccl-comm-warmup", "--distributed-backend", "gloo"])
