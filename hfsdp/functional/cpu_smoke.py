"""CPU-only smoke "training" for SLURM CI: our entry-point code path on a gloo process group.

Megatron's ``pretrain`` needs CUDA, so this exercises everything of ours that does not: Megatron
argument parsing through :func:`hfsdp.training.entry.parse_args` (family resolution, TE check),
model construction through our provider (CPU build), mock GPT datasets through our dataset
builder (including the C++ helper build), and then a short data-parallel loop (gloo all-reduce) of
a tiny embedding/linear LM over those batches. It prints Megatron-format iteration lines, so the
functional driver parses and judges it exactly like a GPU run.

Run under torchrun. ``HFSDP_SMOKE_FAIL_RANK=<r>`` makes rank ``r`` raise at iteration 2 (the
designed-to-fail case: a failing rank must fail the job). ``HFSDP_SMOKE_STALL_S=<s>`` makes every
rank sleep ``s`` seconds before iteration 2, after printing ``smoke: rank R stalls``: a run that
outlives its time limit, or one whose rank is killed while the others wait. Collectives give up
after ``HFSDP_SMOKE_GLOO_TIMEOUT_S`` (default 120) seconds, so a rank that waits on a dead peer
fails rather than hangs.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import sys
import time

import torch

from hfsdp.usererror import env_number, run_cli


def _log_line(iteration: int, total: int, consumed: int, ms: float, loss: float) -> str:
    return (f" iteration {iteration:8d}/{total:8d} | consumed samples: {consumed:12d} |"
            f" elapsed time per iteration (ms): {ms:.1f} | lm loss: {loss:.6E} |"
            f" number of skipped iterations:   0 | number of nan iterations:   0 |")


def main() -> None:
    from hfsdp.diagnostics import install_stack_dump_signal

    install_stack_dump_signal()  # a stalled run shows where each rank was when its launcher ends it
    os.environ.setdefault("HFSDP_SKIP_FORK_GUARD", "1")  # CPU smoke may use a pristine tree
    gloo_timeout_s = env_number("HFSDP_SMOKE_GLOO_TIMEOUT_S", 120.0, kind=float)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=gloo_timeout_s))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        from hfsdp.training.entry import parse_args

        argv = sys.argv[1:]
        if "--no-one-logger" not in argv and importlib.util.find_spec("one_logger") is None:
            # Megatron turns on one_logger (an NVIDIA-internal package) by default; without it,
            # its warning links to a page only NVIDIA staff can open.
            argv.append("--no-one-logger")
        args, family = parse_args(argv)
        from hfsdp.training.data import build_datasets
        from hfsdp.training.model_provider import model_provider
        from megatron.core import parallel_state
        from megatron.training import get_tokenizer

        parallel_state.initialize_model_parallel(1, 1)
        model = model_provider(family)
        n_params = sum(p.numel() for p in model.parameters())
        if rank == 0:
            print(f"> smoke: family={family} megatron model params={n_params}", flush=True)

        iters, mbs = args.train_iters, args.micro_batch_size
        train, _, _ = build_datasets(args, get_tokenizer(), [iters * mbs * world, 0, 0],
                                     is_built_on_rank=lambda: True)
        torch.manual_seed(args.seed)
        vocab, hidden = args.padded_vocab_size, 32
        lm = torch.nn.Sequential(torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab))
        opt = torch.optim.SGD(lm.parameters(), lr=0.5)
        fail_rank = env_number("HFSDP_SMOKE_FAIL_RANK", -1, zero=True)  # -1: no rank fails
        stall_s = env_number("HFSDP_SMOKE_STALL_S", 0.0, kind=float, zero=True)
        # A fixed micro-batch per rank: loss must go down if the loop really trains.
        idx = [rank * mbs + j for j in range(mbs)]
        tokens = torch.stack([torch.as_tensor(train[i]["tokens"]) for i in idx]).long()
        labels = torch.stack([torch.as_tensor(train[i]["labels"]) for i in idx]).long()
        for it in range(1, iters + 1):
            start = time.perf_counter()
            if fail_rank == rank and it == 2:
                raise RuntimeError(f"HFSDP_SMOKE_FAIL_RANK={fail_rank}: designed failure on rank {rank}")
            if stall_s > 0 and it == 2:
                print(f"smoke: rank {rank} stalls {stall_s:g} s before iteration 2 (HFSDP_SMOKE_STALL_S)", flush=True)
                time.sleep(stall_s)
            logits = lm(tokens)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), labels.view(-1))
            opt.zero_grad()
            loss.backward()
            for pname, p in lm.named_parameters():
                grad = p.grad
                if grad is None:
                    raise RuntimeError(f"smoke: parameter {pname} got no gradient from backward(); "
                                       "every parameter of the toy model must take part in the loss")
                torch.distributed.all_reduce(grad)
                grad /= world  # in place: p.grad is this tensor
            opt.step()
            report = loss.detach().clone()
            torch.distributed.all_reduce(report)
            report /= world
            if rank == world - 1:
                ms = (time.perf_counter() - start) * 1000.0
                print(_log_line(it, iters, it * mbs * world, ms, report.item()), flush=True)
        torch.distributed.barrier()
    finally:
        # Clean exit even on failure, in pretrain's teardown order: Megatron's model-parallel
        # state first, so no gloo group outlives destroy_process_group() in a module global (to
        # be freed in interpreter finalization, where its threads may not be joined), then the
        # process groups (no "destroy_process_group() was not called" leak).
        if (parallel_state := sys.modules.get("megatron.core.parallel_state")) is not None:
            parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_cli("cpu_smoke", main))  # a bad HFSDP_SMOKE_* value is one sentence, exit status 2
