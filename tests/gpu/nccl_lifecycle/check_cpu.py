"""CPU pre-flight for the NCCL-lifecycle GPU scripts (no GPU, no network, ~10 s).

Run from the repo root:  python tests/gpu/nccl_lifecycle/check_cpu.py
For each script's PARALLEL_KWARGS, starts one process per rank of a world of 2 on torch's "fake"
process-group backend (every collective is a no-op) and proves that
parallel_state.initialize_model_parallel accepts the arguments; prints, per rank, how many groups
of size > 1 the warmup would select (these are NCCL groups on the GPU run) and the size of the
inter-partial expert DP group. Also checks that the Megatron-FSDP script's configs construct.
Exits non-zero on any failure.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
WORLD = 2


def rank_child(script: str, rank: int) -> None:
    import importlib

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(HERE))
    mod = importlib.import_module(script)
    dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
    from megatron.core import parallel_state as ps
    from megatron.training.nccl_warmup import select_groups

    kwargs = dict(mod.PARALLEL_KWARGS)
    # The fake backend cannot build gloo groups; they are never NCCL groups, so the count holds.
    ps.initialize_model_parallel(**{**kwargs, "create_gloo_process_groups": False})
    extra = getattr(mod, "EXTRA_GROUPS", 0)
    for i in range(extra):
        ps.create_group([0, 1], group_desc=f"EXTRA_EP_GROUP_{i}")
    # On CPU every group is "fake"; count what the GPU run's NCCL filter would keep.
    groups, _, size_one = select_groups(ps._global_process_group_list, backend_filter=lambda g: True)
    inter = ps.get_inter_distributed_optimizer_instance_group(check_initialized=False)
    print(json.dumps({
        "script": script, "rank": rank, "kwargs": kwargs, "extra_groups": extra,
        "groups_size_gt1": len(groups), "skipped_size_one": size_one,
        "ep_size": ps.get_expert_model_parallel_world_size(),
        "expert_dp_size": ps.get_expert_data_parallel_world_size(),
        "inter_partial_expert_dp_size": dist.get_world_size(inter) if inter is not None else None,
    }))


def check_fsdp_config() -> dict:
    sys.path.insert(0, str(HERE))
    import full_iter_cuda_graph_mfsdp as fi

    cfg = fi.ddp_config()
    assert cfg.fsdp_double_buffer and cfg.megatron_fsdp_max_pool_double_buffer, cfg
    assert cfg.megatron_fsdp_cuda_graph_mode and not cfg.nccl_ub, cfg
    tcfg = fi.transformer_config()
    return {"ddp_config_ok": True, "cuda_graph_impl": tcfg.cuda_graph_impl,
            "num_layers": tcfg.num_layers}


def main() -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    failures = 0
    for script in ("warmup_memory", "teardown_exit_time"):
        for rank in range(WORLD):
            proc = subprocess.run([sys.executable, __file__, "--rank", script, str(rank)],
                                  env=env, capture_output=True, text=True, timeout=120)
            line = proc.stdout.strip().splitlines()[-1:] or [""]
            print(f"{script} rank{rank}: rc={proc.returncode} {line[0]}")
            if proc.returncode:
                failures += 1
                print(proc.stderr[-2000:])
    proc = subprocess.run([sys.executable, __file__, "--fsdp-config"], env=env,
                          capture_output=True, text=True, timeout=120)
    print(f"full_iter_cuda_graph_mfsdp config: rc={proc.returncode} {proc.stdout.strip()}")
    if proc.returncode:
        failures += 1
        print(proc.stderr[-2000:])
    print("OK" if not failures else f"{failures} FAILURE(S)")
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_child(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1:2] == ["--fsdp-config"]:
        print(json.dumps(check_fsdp_config()))
    else:
        sys.exit(main())
