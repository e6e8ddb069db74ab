"""One benchmark run: ``torchrun ... -m hfsdp.bench.worker --result R --config C --repeat N
--warmup-steps W --timed-steps T -- <Megatron flags>``.

Builds model + optimizer through Megatron's own ``setup_model_and_optimizer`` (Float16Module,
Megatron-FSDP wrapper, distributed optimizer: exactly what ``pretrain`` builds), then times
``train_step`` on synthetic token batches. Rank 0 writes one JSON record. Each run is a fresh
process so allocator pools and the CUDA caching allocator never leak between configurations.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from hfsdp.atomic import write_json_atomic
from hfsdp.training.run_report import maxpool_stats, pool_bytes_held


def synthetic_batches(args: Any) -> Iterator[dict[str, Any]]:
    """Deterministic random tokens with a causal mask, in the dict shape forward_step reads."""
    import torch

    g = torch.Generator().manual_seed(1234)
    b, s = args.micro_batch_size, args.seq_length
    mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5  # True = masked
    pos = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    while True:
        tokens = torch.randint(0, args.padded_vocab_size, (b, s + 1), generator=g)
        yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
               "loss_mask": torch.ones(b, s), "attention_mask": mask, "position_ids": pos}


def data_iterator(args: Any) -> Any:
    """``synthetic_batches`` wrapped the way ``pretrain`` wraps its loaders: ``train_step``'s
    rerun state machine asserts every data iterator is a ``RerunDataIterator``."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    return RerunDataIterator(synthetic_batches(args))


def write_pyprofile(profile: Any, path: str, steps: int) -> None:
    """Host Python time of the timed steps: top functions by own time and by cumulative time."""
    import io
    import pstats

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    out.write(f"cProfile over {steps} timed steps (times include profiler overhead)\n")
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats("megatron_fsdp", 40)
    with open(path, "w") as f:
        f.write(out.getvalue())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own = argparse.ArgumentParser()
    own.add_argument("--result", required=True)
    own.add_argument("--config", required=True)
    own.add_argument("--repeat", type=int, default=0)
    own.add_argument("--warmup-steps", type=int, default=3)
    own.add_argument("--timed-steps", type=int, default=10)
    own.add_argument("--profile-dir", default=None,
                     help="Write a torch.profiler Chrome trace (gzip) and an op table of the "
                          "timed steps per rank.")
    own.add_argument("--profile-stack", action="store_true",
                     help="With --profile-dir: record Python frames too (with_stack), so the "
                          "idle-gap report (idle.py) names the Python code that kept the GPU "
                          "waiting. Adds host overhead.")
    own.add_argument("--pyprofile-dir", default=None,
                     help="Write cProfile tables (host Python time) of the timed steps per rank.")
    own.add_argument("--memory-trace-dir", default=None,
                     help="Record allocator history over all steps; write what was live at the "
                          "peak, by allocator, per rank (memtrace.py), and the snapshot pickle "
                          "that https://pytorch.org/memory_viz opens.")
    opts = own.parse_args(argv[:split])
    mflags = argv[split + 1:]
    total_steps = opts.warmup_steps + opts.timed_steps
    mflags += ["--train-iters", str(total_steps), "--lr", "1e-4", "--min-lr", "1e-5",
               "--log-interval", "1000000", "--eval-iters", "0"]

    import torch

    from hfsdp.determinism import pin_triton_autotune_from_env
    from hfsdp.training import entry, forward_step, fsdp_units, model_provider
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config
    from megatron.training import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer, train_step

    _, family = entry.parse_args(mflags)
    fsdp_units.install_unit_override()
    pin_triton_autotune_from_env()  # determinism checks only (run_determinism.sh)
    initialize_megatron()
    args = get_args()
    nvls_before = os.environ.get("NCCL_NVLS_ENABLE")
    model, optimizer, scheduler = setup_model_and_optimizer(
        model_provider.make_model_provider(family), ModelType.encoder_or_decoder)
    if "--use-nccl-ub" in mflags and nvls_before is not None:
        # NCCL UB setup must keep an explicit NCCL_NVLS_ENABLE (nccl-allocator-respect-nvls-env).
        assert os.environ.get("NCCL_NVLS_ENABLE") == nvls_before, (
            f"NCCL UB setup changed NCCL_NVLS_ENABLE from {nvls_before!r} to "
            f"{os.environ.get('NCCL_NVLS_ENABLE')!r}")
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        config.no_sync_func = model[0].no_sync
    for m in model:
        m.train()
    fwd_bwd = get_forward_backward_func()
    data = data_iterator(args)
    times: list[float] = []
    losses: list[float | None] = []
    # Training peaks only: model init (full-size init before sharding) is not a step.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    prof = None
    pyprof = None
    mem_baseline = None
    if opts.memory_trace_dir:
        from hfsdp.trace import memtrace

        mem_baseline = memtrace.start_recording()  # from step 1: pools are allocated lazily
    for it in range(total_steps):
        if opts.pyprofile_dir and it == opts.warmup_steps:
            import cProfile

            pyprof = cProfile.Profile()
            pyprof.enable()
        if opts.profile_dir and it == opts.warmup_steps:
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU,
                            torch.profiler.ProfilerActivity.CUDA],
                record_shapes=False, with_stack=opts.profile_stack)
            prof.__enter__()
        if it == opts.warmup_steps:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss_dict = train_step(forward_step.forward_step, data, model, optimizer, scheduler,
                               config, fwd_bwd, iteration=it)[0]
        torch.cuda.synchronize()
        if it == 0 and args.nccl_ub and args.fsdp_manual_registration:
            # train() registers FSDP buffers once, after the first iteration; do the same.
            for chunk in model:
                buf = getattr(chunk, "param_and_grad_buffer", None)
                if buf is not None and getattr(chunk.ddp_config, "fsdp_manual_registration", False):
                    buf.manual_buffer_registration()
        if it >= opts.warmup_steps:
            times.append(time.perf_counter() - t0)
        # Outside the timed window: the .item() sync must not count. Configs should agree.
        loss = loss_dict.get("lm loss") if isinstance(loss_dict, dict) else None
        losses.append(None if loss is None else float(loss))
    stem = f"{opts.config}-r{opts.repeat}-rank{torch.distributed.get_rank()}"
    memory_peak = None
    if mem_baseline is not None:
        os.makedirs(opts.memory_trace_dir, exist_ok=True)
        memory_peak = memtrace.stop_and_summarize(
            mem_baseline, snapshot_path=os.path.join(opts.memory_trace_dir, stem + ".snapshot.pickle"))
        with open(os.path.join(opts.memory_trace_dir, stem + ".memtrace.txt"), "w") as f:
            f.write(memtrace.format_summary(memory_peak) + "\n")
    if pyprof is not None:
        pyprof.disable()
        write_pyprofile(pyprof, os.path.join(opts.pyprofile_dir, stem + ".pstats.txt"),
                        opts.timed_steps)
    if prof is not None:
        prof.__exit__(None, None, None)
        os.makedirs(opts.profile_dir, exist_ok=True)
        trace_path = os.path.join(opts.profile_dir, stem + ".json.gz")
        prof.export_chrome_trace(trace_path)
        from hfsdp.trace import idle, timeline, waits

        trace_events = timeline.load_events(trace_path)
        step_timeline = timeline.summarize(trace_events, opts.timed_steps)
        with open(os.path.join(opts.profile_dir, stem + ".timeline.txt"), "w") as f:
            f.write(timeline.format_summary(step_timeline) + "\n")
        # Which host code each GPU-idle gap waited on (small text; the trace itself may stay behind).
        with open(os.path.join(opts.profile_dir, stem + ".idle.txt"), "w") as f:
            f.write(idle.format_report(idle.attribute(trace_events), opts.timed_steps, top=25) + "\n")
        # What the host waited for in blocking CUDA calls (e.g. .cpu() over a peer-bound all-gather).
        try:  # an optional report: never lose the op table and the run record to it
            text = waits.format_report(waits.attribute(trace_events), opts.timed_steps)
        except Exception as exc:  # noqa: BLE001
            text = f"waits report failed: {exc!r}"
        with open(os.path.join(opts.profile_dir, stem + ".waits.txt"), "w") as f:
            f.write(text + "\n")
        del trace_events
        with open(os.path.join(opts.profile_dir, stem + ".ops.txt"), "w") as f:
            averages = prof.key_averages()
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
            f.write(averages.table(sort_by="self_device_time_total", row_limit=25) + "\n")
        from hfsdp.trace.kernels import count_nccl_kernels

        nccl_kernels = count_nccl_kernels(prof.events())
    dp = args.data_parallel_size
    num_micro = args.global_batch_size // (args.micro_batch_size * dp)
    record = {
        "config": opts.config,
        "repeat": opts.repeat,
        "step_times_s": times,
        "tokens_per_step": args.global_batch_size * args.seq_length,
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        "pool_bytes_measured": pool_bytes_held(),
        "num_microbatches": num_micro,
        "world_size": args.world_size,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "lm_loss": losses,
        "maxpool_stats": maxpool_stats(model),
    }
    if memory_peak is not None:
        record["memory_peak"] = memory_peak  # rank 0's live set at its peak, by allocator
    if prof is not None:
        record["nccl_kernels"] = nccl_kernels  # ncclSymk* vs other, profiled steps, rank 0
        record["timeline"] = step_timeline  # per profiled step: exposed NCCL, idle, host syncs
    # Peak memory is per rank; report the max over ranks.
    peaks = torch.tensor([record["peak_allocated_bytes"], record["peak_reserved_bytes"]],
                         device="cuda", dtype=torch.int64)
    torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    record["peak_allocated_bytes"], record["peak_reserved_bytes"] = (int(v) for v in peaks.tolist())
    if torch.distributed.get_rank() == 0:
        write_json_atomic(opts.result, record, indent=None, sort_keys=False)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
