"""GPU experiment (5): max-pool double buffer staged in the symmetric NCCL pool (--use-nccl-ub).

Run (2 x H200, < 3 min):  . tests/gpu/setup_gpu_env.sh && python tests/gpu/nccl_lifecycle/symmetric_staging.py
Writes $OUT/symmetric_staging.json and prints a summary.

A 4-block bf16 MLP (16 MiB of bf16 weights per FSDP unit, so NCCL picks symmetric kernels
for the unit all-gathers / reduce-scatters) is wrapped with Megatron-FSDP ZeRO-3 and
max-pool double buffering, once without and once with nccl_ub (two separate torchrun jobs,
so a failing nccl_ub init cannot poison the baseline). Each job asserts NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 at start and again after the
ParamAndGradBuffer exists (nccl_allocator.init() must keep the explicit 0), runs warmup
steps, profiles PROFILED_STEPS steps with torch.profiler and counts CUDA kernels whose names
start with ncclSymk vs other nccl kernels, split into all-gather / reduce-scatter, then times
TIMED_STEPS steps (median). The nccl_ub job also records the staging record (plan hash,
arena bytes) of double_buffer/symmetric.py. An nccl_ub init failure is recorded with its error text.
Expected with the patches: ub.symk.all_gather > 0 and ub.symk.reduce_scatter > 0, plain.symk
all zero, NVLS 0 throughout.
"""

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _launch  # noqa: E402

sys.path.insert(0, str(_launch.REPO_ROOT))
from hfsdp.trace.kernels import count_nccl_kernels  # noqa: E402

CHILD_TIMEOUT_S = {"plain": 60, "ub": 110}  # ub compiles the NCCL allocator extension once
HIDDEN = 1024  # fc1 + fc2 = 8.4 M params = 16 MiB bf16 per unit
BLOCKS = 4
WARMUP_STEPS = 2
PROFILED_STEPS = 2
TIMED_STEPS = 6


def child(mode: str, result_path: str) -> None:
    _launch.assert_nvls_guard()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    res = {"mode": mode, "rank": rank, "torch": torch.__version__,
           "nccl": str(torch.cuda.nccl.version()),
           "nvls_at_start": os.environ.get("NCCL_NVLS_ENABLE")}
    path = Path(f"{result_path}.{mode}.rank{rank}")

    def finish(code: int) -> None:
        path.write_text(json.dumps(res, default=str))
        if code:
            os._exit(code)  # a broken NCCL state must not hang the exit

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
            self.fc2 = torch.nn.Linear(4 * HIDDEN, HIDDEN, bias=False)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    try:
        from megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard import fully_shard_model

        torch.manual_seed(0)
        module = torch.nn.Sequential(*[Block() for _ in range(BLOCKS)]).to("cuda", torch.bfloat16)
        # 0.18.2's fully_shard needs a TP mesh dim even at TP=1 (get_submesh(None) raises).
        mesh = init_device_mesh("cuda", (2, 1), mesh_dim_names=("dp", "tp"))
        model = fully_shard_model(
            module, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp", fsdp_unit_modules=[Block],
            zero_dp_strategy=3, device=torch.device("cuda", local),
            nccl_ub=(mode == "ub"), fsdp_double_buffer=True, maxpool_double_buffer=True,
        )
    except Exception as exc:  # recorded, not swallowed: the parent prints it
        res["init_error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
        res["init_traceback"] = traceback.format_exc()[-3000:]
        res["nvls_after_build"] = os.environ.get("NCCL_NVLS_ENABLE")
        finish(3)
        return
    res["nvls_after_build"] = os.environ.get("NCCL_NVLS_ENABLE")
    if res["nvls_after_build"] != "0":
        res["abort"] = "NCCL_NVLS_ENABLE changed after building ParamAndGradBuffer"
        finish(4)
        return
    _launch.assert_nvls_guard()
    pgb = model.param_and_grad_buffer
    staging = pgb.maxpool_staging
    res["allocators"] = {a: type(getattr(pgb, a, None)).__name__
                         for a in ("weight_alloc", "main_grad_alloc")}
    res["staging"] = None if staging is None else {
        "fingerprint": staging.fingerprint, "arena_bytes": staging.arena_bytes,
        "arenas": len(staging.arenas), "symmetric": staging.symmetric,
        "manual_registration": staging.manual_registration, "groups": staging.group_descs}

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8, 256, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step() -> float:
        model.zero_grad_buffer()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        model.finish_grad_sync()
        return loss

    try:
        losses = [float(step()) for _ in range(WARMUP_STEPS)]
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(PROFILED_STEPS):
                losses.append(float(step()))
            torch.cuda.synchronize()
        res["kernels"] = count_nccl_kernels(prof.events())
        times = []
        for _ in range(TIMED_STEPS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        res["median_step_ms"] = round(1000 * statistics.median(times), 3)
        res["step_ms"] = [round(1000 * t, 3) for t in times]
        res["losses"] = losses
        res["home_misses"] = pgb.weight_alloc.stats()["home_misses"]
    except Exception as exc:
        res["run_error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
        res["run_traceback"] = traceback.format_exc()[-3000:]
        finish(5)
        return
    res["nvls_at_end"] = os.environ.get("NCCL_NVLS_ENABLE")
    finish(0)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    _launch.assert_nvls_guard()
    out = _launch.out_dir()
    path = out / "symmetric_staging"
    results = {"config": {"hidden": HIDDEN, "blocks": BLOCKS, "warmup": WARMUP_STEPS,
                          "profiled": PROFILED_STEPS, "timed": TIMED_STEPS}}
    for mode in ("plain", "ub"):
        for r in range(2):
            Path(f"{path}.{mode}.rank{r}").unlink(missing_ok=True)  # no stale results
        job = _launch.torchrun(__file__, [mode, str(path)], CHILD_TIMEOUT_S[mode])
        ranks = []
        for r in range(2):
            p = Path(f"{path}.{mode}.rank{r}")
            ranks.append(json.loads(p.read_text()) if p.exists() else None)
        results[mode] = {"job": job, "ranks": ranks}
    plain0 = (results["plain"]["ranks"][0] or {})
    ub0 = (results["ub"]["ranks"][0] or {})
    if plain0.get("losses") and ub0.get("losses"):
        results["max_abs_loss_diff"] = max(
            abs(a - b) for a, b in zip(plain0["losses"], ub0["losses"], strict=False))
    results_path = _launch.write_results("symmetric_staging", results)
    print(f"== max-pool symmetric staging, Megatron-FSDP ({results_path}) ==")
    for mode, r0 in (("plain", plain0), ("ub", ub0)):
        job = results[mode]["job"]
        k = r0.get("kernels", {})
        print(f"[{mode}] rc={job['rc']} timed_out={job['timed_out']} wall={job['wall_s']}s "
              f"torch={r0.get('torch')} nccl={r0.get('nccl')} "
              f"nvls start/built/end={r0.get('nvls_at_start')}/{r0.get('nvls_after_build')}/"
              f"{r0.get('nvls_at_end')} symk={k.get('symk')} other_nccl={k.get('other_nccl')} "
              f"median_step_ms={r0.get('median_step_ms')} staging={r0.get('staging')} "
              f"home_misses={r0.get('home_misses')}")
        for key in ("init_error", "run_error", "abort"):
            if r0.get(key):
                print(f"[{mode}] {key}: {r0[key][:400]}")
        if job["rc"] != 0 and not r0:
            print(f"[{mode}] output tail:\n{job['tail'][-1500:]}")
    print(f"max_abs_loss_diff={results.get('max_abs_loss_diff')}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
