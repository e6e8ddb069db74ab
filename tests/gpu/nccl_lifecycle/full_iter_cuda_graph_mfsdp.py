"""GPU experiment (4): full-iteration CUDA graph capture of a small Megatron-FSDP model.

Run (2 x H200, < 3 min):  . .devtools/bootstrap.sh && python tests/gpu/nccl_lifecycle/full_iter_cuda_graph_mfsdp.py
Writes $OUT/full_iter_cuda_graph_mfsdp.json and prints a summary.

A 4-block MLP is wrapped with Megatron-FSDP (ZeRO-3, blocks as FSDP units, cuda_graph_mode)
and driven through the real FullCudaGraphWrapper: 2 eager warmup iterations, capture on the
3rd, then 3 replays. Records whether torch has set_override_stale_capture_stream, whether the
wrapper's one warning (pytorch/pytorch#180090) was logged, whether capture succeeded (with the
error otherwise, e.g. cudaErrorStreamCaptureIsolation) and the losses of eager vs replayed steps.
torch 2.11 on the H200 machines lacks the API, so the expected record there is "warning logged";
capture may then fail, which is the failure mode the patch addresses on newer torch.
"""

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _launch  # noqa: E402

CHILD_TIMEOUT_S = 120
HIDDEN = 1024


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def child(result_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    from megatron.core import full_cuda_graph as fcg
    from megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard import fully_shard_model

    handler = _ListHandler()
    fcg.logger.addHandler(handler)
    res = {"rank": dist.get_rank(), "torch": torch.__version__,
           "api_available": hasattr(torch.autograd.graph, "set_override_stale_capture_stream")}

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
            self.fc2 = torch.nn.Linear(4 * HIDDEN, HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    torch.manual_seed(0)
    module = torch.nn.Sequential(*[Block() for _ in range(4)]).cuda()
    mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("dp",))
    model = fully_shard_model(module, device_mesh=mesh, dp_shard_dim="dp",
                              fsdp_unit_modules=[Block], zero_dp_strategy=3,
                              device=torch.device("cuda", local), cuda_graph_mode=True)
    static_x = torch.randn(8, 128, HIDDEN, device="cuda", generator=None)

    def forward_backward(model, data_iterator, num_microbatches, seq_length, forward_only):
        loss = model[0](static_x).float().pow(2).mean()
        loss.backward()
        model[0].finish_grad_sync()
        return loss.detach()

    wrapper = fcg.FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=2)
    losses, phase = [], "eager"
    try:
        for it in range(6):
            phase = "capture" if it == 2 else ("replay" if it > 2 else "eager")
            model.zero_grad_buffer()
            loss = wrapper(model=[model], data_iterator=None, num_microbatches=1,
                           seq_length=128, forward_only=False)
            torch.cuda.synchronize()
            losses.append(float(loss))
        res["capture_ok"] = True
    except Exception as exc:
        res["capture_ok"] = False
        res["failed_phase"] = phase
        res["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
    res["losses"] = losses
    res["warnings"] = [m for m in handler.messages if "180090" in m]
    Path(f"{result_path}.rank{dist.get_rank()}").write_text(json.dumps(res))
    if res["capture_ok"]:
        dist.destroy_process_group()
    else:
        os._exit(3)  # a broken capture can leave NCCL/streams unusable; do not hang on exit


def main() -> None:
    _launch.assert_safety_env()
    out = _launch.out_dir()
    path = out / "full_iter_cuda_graph_mfsdp"
    job = _launch.torchrun(__file__, [str(path)], CHILD_TIMEOUT_S)
    ranks = [json.loads(Path(f"{path}.rank{r}").read_text()) if Path(f"{path}.rank{r}").exists()
             else None for r in range(2)]
    results_path = _launch.write_results("full_iter_cuda_graph_mfsdp", {"job": job, "ranks": ranks})
    r0 = ranks[0] or {}
    print(f"== full-iteration CUDA graph, Megatron-FSDP ({results_path}) ==")
    print(f"rc={job['rc']} timed_out={job['timed_out']} torch={r0.get('torch')} "
          f"api_available={r0.get('api_available')} warnings={len(r0.get('warnings', []))} "
          f"capture_ok={r0.get('capture_ok')} failed_phase={r0.get('failed_phase')} "
          f"losses={r0.get('losses')} error={r0.get('error', '')[:200]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
