"""NCCL message-size sweep: all-gather and reduce-scatter on plain and on NCCL-registered buffers.

``python -m hfsdp.bench.collectives --nproc 4`` launches one rank per GPU (torchrun) that times
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` for each message size, dtype and buffer
kind, eagerly or replayed from a CUDA graph (``--graph``), and prints the time, the bus bandwidth
and each registered kind against plain buffers; ``--out-json`` keeps every row.

[Note: what the sweep answers]
``--use-nccl-ub`` puts Megatron-FSDP's buckets in memory that Megatron's NCCL allocator made
(``megatron.core.nccl_allocator``: ``ncclMemAlloc`` behind a ``torch.cuda.MemPool``) and registers
that pool with the communicator, symmetrically where NCCL supports it. Whether that shortens a
training step depends on the collective, its dtype and its message size: registration lets NCCL
skip its staging copies and, for symmetric buffers, pick its symmetric kernels. The sweep times
exactly those collectives on buffers made the same way, so that a step-time ratio can be read
against the collective's own:

* ``plain``: tensors from torch's caching allocator (what runs without ``--use-nccl-ub``);
* ``registered``: a fresh pool per case, registered with ``symm=False``;
* ``symmetric``: the same, registered with ``symm=True`` (Megatron-FSDP's registration).

Sizes are the full message: the gathered output of an all-gather, the unreduced input of a
reduce-scatter (nccl-tests' convention), so that bus bandwidth is ``size / time * (n - 1) / n``
for both. A case's time is the slowest rank's mean over ``--iters`` collectives after
``--warmup`` untimed ones. One rank per GPU only: ranks sharing a GPU time-slice it, and the
figures would say nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hfsdp.atomic import write_json_atomic
from hfsdp.usererror import UserError, comma_choices, output_file, positive, run_cli

OPS = ("all_gather", "reduce_scatter")
DTYPES = ("fp32", "bf16")
BUFFERS = ("plain", "registered", "symmetric")
DEFAULT_SIZES = "1M,4M,16M,64M,256M,1G"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
_ITEMSIZE = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Case:
    op: str
    dtype: str
    buffer: str
    size_bytes: int


@dataclass(frozen=True)
class Row(Case):
    time_us: float  # the slowest rank's mean time per collective
    bus_gbps: float  # GB/s (10**9 bytes), nccl-tests' bus bandwidth


def parse_size(text: str) -> int:
    """``64M`` -> 67108864 (K, M, G are powers of 1024; a bare number is bytes)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size > 0 such as 4096, 64K, 16M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_choices(option: str, allowed: Sequence[str], noun: str):
    """argparse ``type=``: a comma-separated subset of ``allowed``, in the order given, each once
    (:func:`hfsdp.usererror.comma_choices`; argparse prints its refusal)."""

    def parse(text: str) -> tuple[str, ...]:
        try:
            return tuple(comma_choices(option, text, allowed, noun))
        except UserError as exc:
            raise argparse.ArgumentTypeError(f"{exc.cause}; {exc.fix}") from None

    return parse


def parse_sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(parse_size(t) for t in text.split(","))
    if len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"{text!r} names one size more than once")
    return sizes


def check_case(case: Case, world: int) -> str | None:
    """Why ``case`` cannot run on ``world`` ranks (one sentence), or None: each rank's shard must be
    a whole number of elements."""
    unit = world * _ITEMSIZE[case.dtype]
    if case.size_bytes % unit:
        return (f"{human(case.size_bytes)} of {case.dtype} does not split into {world} equal shards of whole "
                f"elements; give sizes that are multiples of {unit} bytes")
    return None


def bus_bandwidth(size_bytes: int, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-gather or reduce-scatter of ``size_bytes`` (the full message) in GB/s."""
    return size_bytes / seconds * (world - 1) / world / 1e9


def human(size_bytes: int) -> str:
    for unit in ("G", "M", "K"):
        if size_bytes % _UNITS[unit] == 0:
            return f"{size_bytes // _UNITS[unit]}{unit}"
    return str(size_bytes)


def cases(ops: Sequence[str], dtypes: Sequence[str], buffers: Sequence[str], sizes: Sequence[int]) -> list[Case]:
    return [Case(o, d, b, s) for o, d, s, b in itertools.product(ops, dtypes, sizes, buffers)]


def table(rows: Sequence[Row]) -> str:
    """One line per (op, dtype, size): each buffer kind's time and bus bandwidth, registered kinds
    also as a fraction of plain's time (below 1: faster)."""
    by_key: dict[tuple[str, str, int], dict[str, Row]] = {}
    for row in rows:
        by_key.setdefault((row.op, row.dtype, row.size_bytes), {})[row.buffer] = row
    kinds = [b for b in BUFFERS if any(b in v for v in by_key.values())]
    head = f"{'op':<15}{'dtype':<6}{'size':>6}" + "".join(f"  {k + ' us (GB/s)':>26}" for k in kinds)
    lines = [head, "-" * len(head)]
    for (op, dtype, size), found in by_key.items():
        cells = []
        for kind in kinds:
            if (cell := found.get(kind)) is None:
                cells.append(f"  {'-':>26}")
                continue
            ratio = (f" {cell.time_us / found['plain'].time_us:.2f}x" if kind != "plain" and "plain" in found else "")
            cells.append(f"  {f'{cell.time_us:,.1f} ({cell.bus_gbps:,.0f}){ratio}':>26}")
        lines.append(f"{op:<15}{dtype:<6}{human(size):>6}" + "".join(cells))
    return "\n".join(lines)


# --- the ranks (GPU) -------------------------------------------------------------------------


def _time_case(case: Case, warmup: int, iters: int, graph: bool) -> float:
    """Seconds per collective on this rank (mean over ``iters``); raises when the result is wrong.

    The full message and the shard are views of one allocation, so a registered pool holds one
    segment, registered (symmetrically: collectively) in the same order on every rank."""
    import torch
    import torch.distributed as dist

    from megatron.core import nccl_allocator

    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case.dtype]
    full = case.size_bytes // _ITEMSIZE[case.dtype]
    symmetric = case.buffer == "symmetric"
    pool = None if case.buffer == "plain" else nccl_allocator.create_nccl_mem_pool(symmetric=symmetric)
    group = dist.group.WORLD
    with torch.cuda.use_mem_pool(pool) if pool is not None else contextlib.nullcontext():
        flat = torch.empty(full + full // world, dtype=dtype, device="cuda")
    # [full message | this rank's shard]: all-gather sends rank + 1, reduce-scatter sums rank + 1
    bufs = [flat[:full], flat[full:]]
    (bufs[1] if case.op == "all_gather" else bufs[0]).fill_(rank + 1)
    registered = False

    def once() -> None:
        big, shard = bufs
        if case.op == "all_gather":
            dist.all_gather_into_tensor(big, shard)
        else:
            dist.reduce_scatter_tensor(shard, big)

    graphs: list[torch.cuda.CUDAGraph] = []  # the captured collectives, dropped before their buffers
    try:
        if pool is not None:
            nccl_allocator.register_mem_pool(pool, group, symmetric=symmetric)
            registered = True
        for _ in range(warmup):
            once()
        torch.cuda.synchronize()
        if graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graphs.append(torch.cuda.CUDAGraph())
            with torch.cuda.stream(stream), torch.cuda.graph(graphs[0], stream=stream):
                for _ in range(iters):
                    once()
            torch.cuda.synchronize()
            graphs[0].replay()  # one untimed replay
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        if graphs:
            graphs[0].replay()
        else:
            for _ in range(iters):
                once()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
        _check_result(case, bufs, world)
        return seconds
    finally:
        torch.cuda.synchronize()
        graphs.clear()
        bufs.clear()
        del flat
        if registered:
            nccl_allocator.deregister_mem_pool(pool, group)


def _check_result(case: Case, bufs: list, world: int) -> None:
    """Raise unless the collective computed what it should (a sweep of a broken path times nothing)."""
    import torch

    big, shard = bufs
    if case.op == "all_gather":
        expected = torch.arange(1, world + 1, device=big.device).repeat_interleave(shard.numel()).to(big.dtype)
        ok = torch.equal(big, expected)
    else:
        ok = bool((shard == world * (world + 1) // 2).all())
    if not ok:
        raise RuntimeError(f"{case.op} {case.dtype} {human(case.size_bytes)} on {case.buffer} buffers gave wrong "
                           "values: the timing of this path would mean nothing")


def worker(opts: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for case in cases(opts.ops, opts.dtypes, opts.buffers, opts.sizes):
        seconds = torch.tensor([_time_case(case, opts.warmup, opts.iters, opts.graph)], device="cuda")
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        row = Row(**asdict(case), time_us=seconds.item() * 1e6,
                  bus_gbps=bus_bandwidth(case.size_bytes, seconds.item(), world))
        rows.append(row)
        if rank == 0:
            print(f"{case.op} {case.dtype} {human(case.size_bytes)} {case.buffer}: {row.time_us:,.1f} us, "
                  f"{row.bus_gbps:,.0f} GB/s", flush=True)
    if rank == 0:
        meta = {"world": world, "graph": opts.graph, "warmup": opts.warmup, "iters": opts.iters,
                "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "device": torch.cuda.get_device_name(local),
                "env": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(("NCCL_", "TORCH_NCCL_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))}}
        write_json_atomic(opts.worker_json, {"meta": meta, "rows": [asdict(r) for r in rows]})
    dist.destroy_process_group()
    return 0


# --- the launcher ----------------------------------------------------------------------------


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hfsdp.bench.collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=positive(int), default=None, help="Ranks, one per GPU (default: every GPU).")
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                   help=f"Full message sizes (default {DEFAULT_SIZES}).")
    p.add_argument("--ops", type=parse_choices("--ops", OPS, "collective"), default=OPS,
                   help=f"Default {','.join(OPS)}.")
    p.add_argument("--dtypes", type=parse_choices("--dtypes", DTYPES, "dtype"), default=DTYPES,
                   help=f"Default {','.join(DTYPES)}.")
    p.add_argument("--buffers", type=parse_choices("--buffers", BUFFERS, "buffer kind"), default=BUFFERS,
                   help=f"Default {','.join(BUFFERS)}.")
    p.add_argument("--graph", action="store_true", help="Time replays of a CUDA graph of --iters collectives.")
    p.add_argument("--warmup", type=positive(int), default=5, help="Untimed collectives first (NCCL connects lazily).")
    p.add_argument("--iters", type=positive(int), default=20)
    p.add_argument("--timeout", type=positive(int), default=600, help="Seconds for the whole sweep.")
    p.add_argument("--out-json", default="out/collectives.json")
    p.add_argument("--worker-json", help=argparse.SUPPRESS)  # set by the launcher for its ranks
    return p.parse_args(argv)


def launch(opts: argparse.Namespace) -> int:
    from hfsdp.launch import fit, torchrun
    from hfsdp.proc import run_group

    output_file("--out-json", opts.out_json)
    gpus = len(fit.gpu_memory())
    if gpus < 2:
        raise UserError(f"the sweep times collectives between ranks on GPUs of their own, and this machine has "
                        f"{gpus} GPU(s) visible", "run it on a machine with 2 or more NVIDIA GPUs")
    nproc = opts.nproc or gpus
    if not 2 <= nproc <= gpus:
        raise UserError(f"--nproc {nproc}: the sweep runs one rank per GPU, and {gpus} GPUs are visible",
                        f"give --nproc between 2 and {gpus}")
    for case in cases(opts.ops, opts.dtypes, opts.buffers, opts.sizes):
        if why := check_case(case, nproc):
            raise UserError(f"--sizes: {why}", "change --sizes or --nproc")
    with tempfile.TemporaryDirectory(prefix="hfsdp-collectives-") as tmp:
        out = os.path.join(tmp, "rows.json")
        args = ["--sizes", ",".join(map(str, opts.sizes)), "--ops", ",".join(opts.ops),
                "--dtypes", ",".join(opts.dtypes), "--buffers", ",".join(opts.buffers),
                "--warmup", str(opts.warmup), "--iters", str(opts.iters), "--worker-json", out,
                *(["--graph"] if opts.graph else [])]
        cmd = torchrun.command(torchrun.Placement(nproc=nproc), ["-m", "hfsdp.bench.collectives", *args])
        ended = run_group(cmd, timeout_s=opts.timeout)
        if ended.returncode != 0 or ended.timed_out or not os.path.exists(out):
            raise UserError(f"the sweep's ranks {'timed out' if ended.timed_out else 'failed'} "
                            f"(exit {ended.returncode}); their output is above",
                            "fix what the first rank's error names, or raise --timeout")
        with open(out, encoding="utf-8") as f:
            doc = json.load(f)
    rows = [Row(**r) for r in doc["rows"]]
    print(table(rows))
    os.makedirs(os.path.dirname(os.path.abspath(opts.out_json)), exist_ok=True)
    write_json_atomic(opts.out_json, {**doc, "meta": {**doc["meta"], "command": sys.argv}})
    print(f"wrote {opts.out_json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    return run_cli("collectives", lambda: worker(opts) if opts.worker_json else launch(opts))


if __name__ == "__main__":
    sys.exit(main())
