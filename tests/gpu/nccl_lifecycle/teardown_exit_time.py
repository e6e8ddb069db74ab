"""GPU experiment (2): process exit time after training with many expert-parallel NCCL groups,
with and without the pretrain() teardown (megatron/training/teardown.py).

Run (2 x H200, < 130 s):  . tests/gpu/setup_gpu_env.sh && python tests/gpu/nccl_lifecycle/teardown_exit_time.py
Writes $OUT/teardown_exit_time.json and prints a summary.

Each child builds Megatron's groups with EP=2 (one DistOpt instance: with EP=2 on 2 GPUs expert DP
is 1, which 2 instances cannot divide) plus EXTRA_GROUPS additional 2-rank groups made through
parallel_state.create_group in creation order (the many expert-parallel groups of a large MoE
layout; on 2 GPUs Megatron itself yields only a handful), uses every group once so its communicator
exists, then returns from a pretrain-like function. "teardown" wraps that function with
tear_down_distributed_on_exit; "none" leaves the groups to interpreter shutdown (0.18.2).
Measured: seconds from "training done" (timestamp written by each rank) to job exit, as seen
by the parent; a job still alive after CHILD_TIMEOUT_S is recorded as a hang.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _launch  # noqa: E402

EXTRA_GROUPS = 48
CHILD_TIMEOUT_S = 60  # x2 jobs (< 130 s in all); a hang is recorded as timed_out

# Valid on world size 2 (checked on CPU by check_cpu.py): expert DP = 2 / (EP=2) = 1, divisible
# by num_distributed_optimizer_instances = 1.
PARALLEL_KWARGS = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                       expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                       num_distributed_optimizer_instances=1)


def child(variant: str, stamp_path: str) -> None:
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)

    def pretrain_like(inprocess_call_wrapper=None) -> int:
        dist.init_process_group("nccl")
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(**PARALLEL_KWARGS)
        for i in range(EXTRA_GROUPS):
            ps.create_group([0, 1], group_desc=f"EXTRA_EP_GROUP_{i}")
        from megatron.training.nccl_warmup import warm_up_nccl_communicators

        warmed = warm_up_nccl_communicators().warmed  # every communicator now exists
        # "Training done" is stamped here, inside the wrapped function, so the teardown the
        # wrapper runs afterwards counts toward exit time (the first GPU run stamped after it).
        Path(f"{stamp_path}.rank{local}").write_text(
            json.dumps({"done_at": time.time(), "groups": warmed}))
        return warmed

    if variant == "teardown":
        from megatron.training.teardown import tear_down_distributed_on_exit

        pretrain_like = tear_down_distributed_on_exit(pretrain_like)
    pretrain_like()


def main() -> None:
    _launch.assert_nvls_guard()
    out = _launch.out_dir()
    runs = {}
    for variant in ("none", "teardown"):
        stamp = out / f"teardown_exit_{variant}"
        job = _launch.torchrun(__file__, [variant, str(stamp)], CHILD_TIMEOUT_S)
        ended = time.time()
        stamps = [json.loads(Path(f"{stamp}.rank{r}").read_text())
                  for r in range(2) if Path(f"{stamp}.rank{r}").exists()]
        exit_s = round(ended - min(s["done_at"] for s in stamps), 2) if stamps else None
        runs[variant] = {"job": job, "stamps": stamps, "exit_after_training_s": exit_s}
    path = _launch.write_results("teardown_exit_time", runs)
    print(f"== exit time after training ({path}) ==")
    for variant, run in runs.items():
        groups = run["stamps"][0]["groups"] if run["stamps"] else None
        print(f"{variant:9s} rc={run['job']['rc']} timed_out={run['job']['timed_out']} "
              f"nccl_groups={groups} exit_after_training_s={run['exit_after_training_s']}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
