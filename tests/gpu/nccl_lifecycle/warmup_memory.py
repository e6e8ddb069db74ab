"""GPU experiment (1): NCCL communicator memory with/without --nccl-comm-warmup, and an OOM repro.

Run (2 x H200, < 90 s):  . tests/gpu/setup_gpu_env.sh && python tests/gpu/nccl_lifecycle/warmup_memory.py
Writes $OUT/warmup_memory.json and prints a summary.

Each child is a 2-rank job with Megatron's real parallel groups: TP=PP=EP=ETP=1 and 2 DistOpt
instances, so expert DP = 2 and the inter-partial expert DP group (the DistOpt replica group,
get_inter_distributed_optimizer_instance_group) is a real 2-rank NCCL group. On 2 GPUs EP=2 and
2 DistOpt instances cannot coexist: expert DP = world / (EP*ETP*PP) must be divisible by the
instance count (parallel_state asserts it), which needs >= 4 GPUs; PARALLEL_KWARGS keeps the
partial-DistOpt groups, which are the ones this experiment is about.
A "step" allocates activations (ACT_MIB) and then runs one collective on every NCCL group, as
iteration 1 does. Without warmup the communicators are created inside that step.
- measure: records device free memory (cudaMemGetInfo, which sees NCCL's own allocations)
  before/after warmup and the lowest free memory during the step (= first-step peak).
- oom: caps the torch allocator with set_per_process_memory_fraction so that, after the
  model-like fill, only MARGIN_MIB of the device stays free for NCCL; then runs the step.
  Expected: without warmup NCCL fails to allocate its buffers (or the job times out), with
  warmup the step succeeds because the communicators already exist.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _launch  # noqa: E402

ACT_MIB = 2048
MARGIN_MIB = 24
CHILD_TIMEOUT_S = 45  # x4 jobs; generous: on a fresh machine the first imports and NCCL set-up are slow

# Valid on world size 2 (checked on CPU by check_cpu.py): expert DP = 2 / (EP*ETP*PP) = 2,
# divisible by num_distributed_optimizer_instances = 2.
PARALLEL_KWARGS = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                       expert_model_parallel_size=1, expert_tensor_parallel_size=1,
                       num_distributed_optimizer_instances=2, create_gloo_process_groups=False)


def child(mode: str, warmup: bool, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl")
    from megatron.core import parallel_state as ps
    from megatron.training.nccl_warmup import select_groups, warm_up_nccl_communicators

    ps.initialize_model_parallel(**PARALLEL_KWARGS)
    groups, _, _ = select_groups(ps._global_process_group_list)
    inter = ps.get_inter_distributed_optimizer_instance_group()
    res = {"rank": dist.get_rank(), "mode": mode, "warmup": warmup, "n_nccl_groups": len(groups),
           "parallel_kwargs": PARALLEL_KWARGS,
           "inter_partial_expert_dp_size": dist.get_world_size(inter),
           "inter_partial_expert_dp_in_warmed_set": any(g is inter for g in groups),
           "ep2_with_partial_distopt": "impossible on 2 GPUs (expert DP must divide by 2 instances)",
           "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
           "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
    free0, total = torch.cuda.mem_get_info(dev)
    res["total_mib"] = total / 2**20
    if warmup:
        rep = warm_up_nccl_communicators()
        res.update(warmed=rep.warmed, warmup_s=rep.seconds,
                   comm_mib=(rep.device_free_bytes_before - rep.device_free_bytes_after) / 2**20)
    if mode == "oom":
        free_now = torch.cuda.mem_get_info(dev)[0]
        used_by_torch = torch.cuda.memory_reserved(dev)
        cap = (used_by_torch + free_now - MARGIN_MIB * 2**20) / total
        torch.cuda.set_per_process_memory_fraction(cap, dev)
        fill = []
        try:
            while True:
                fill.append(torch.empty(64 * 2**20, dtype=torch.uint8, device=dev))
        except torch.OutOfMemoryError:
            pass
        res["free_before_step_mib"] = torch.cuda.mem_get_info(dev)[0] / 2**20
    acts = [] if mode == "oom" else [torch.empty(ACT_MIB * 2**20, dtype=torch.uint8, device=dev)]
    lowest = torch.cuda.mem_get_info(dev)[0]
    t0 = time.perf_counter()
    try:
        x = torch.ones(1, device=dev)
        for g in groups:
            dist.all_reduce(x, group=g)
            torch.cuda.synchronize(dev)
            lowest = min(lowest, torch.cuda.mem_get_info(dev)[0])
        res["step_ok"] = True
    except Exception as exc:  # the OOM repro expects this without warmup
        res["step_ok"] = False
        res["step_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    res["step_s"] = time.perf_counter() - t0
    res["first_step_peak_used_mib"] = (total - lowest) / 2**20
    res["free_at_start_mib"] = free0 / 2**20
    del acts
    Path(f"{result_path}.rank{dist.get_rank()}").write_text(json.dumps(res))
    if res["step_ok"]:
        dist.destroy_process_group()
    else:
        os._exit(3)  # a failed communicator cannot be torn down cleanly; do not hang


def main() -> None:
    _launch.assert_nvls_guard()
    out = _launch.out_dir()
    runs = {}
    for mode in ("measure", "oom"):
        for warmup in (False, True):
            key = f"{mode}_warmup{int(warmup)}"
            path = out / f"warmup_memory_{key}"
            job = _launch.torchrun(__file__, [mode, str(int(warmup)), str(path)], CHILD_TIMEOUT_S)
            ranks = []
            for r in range(2):
                p = Path(f"{path}.rank{r}")
                ranks.append(json.loads(p.read_text()) if p.exists() else None)
            runs[key] = {"job": job, "ranks": ranks}
    results_path = _launch.write_results("warmup_memory", runs)
    print(f"== NCCL communicator warmup memory ({results_path}) ==")
    for key, run in runs.items():
        r0 = run["ranks"][0] or {}
        print(f"{key:18s} rc={run['job']['rc']} timed_out={run['job']['timed_out']} "
              f"groups={r0.get('n_nccl_groups')} comm_mib={r0.get('comm_mib')} "
              f"peak_used_mib={r0.get('first_step_peak_used_mib')} step_ok={r0.get('step_ok')} "
              f"err={r0.get('step_error', '')[:120]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3] == "1", sys.argv[4])
    else:
        main()
