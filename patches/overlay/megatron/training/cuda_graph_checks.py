# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Argument checks for CUDA-graph configurations that cannot be captured.

[Note: known capture breakers]
A CUDA graph records GPU work only; any point where the host must read a GPU value (a
``.item()``, ``.tolist()``, ``.cpu()`` or an event synchronize) ends a capture with an
opaque ``cudaErrorStreamCaptureInvalidated`` / ``cudaErrorStreamCaptureUnsupported`` deep
inside the first captured step. These checks turn the configurations we know to hit such a
point into one clear error at argument validation, naming the flags that fix it.

Full-iteration graphs (``--cuda-graph-impl full_iteration``) capture forward and backward of
every layer, so every MoE layer's token dispatch is inside the graph:

* ``allgather`` dispatcher: always counts tokens per expert on the host.
* ``alltoall`` dispatcher: copies the all-to-all split sizes to the host and waits for
  them, unless inputs are dropped and padded to a fixed capacity
  (``--moe-expert-capacity-factor`` plus ``--moe-pad-expert-input-to-capacity``), which makes
  every size static.
* ``flex`` dispatcher: the DeepEP backend reads the permuted token count on the host; the
  HybridEP backend does too unless inputs are dropped and padded.

With more than one rank the graph also holds NCCL collectives across ranks, and NCCL registers
their buffers when they are captured (``NCCL_GRAPH_REGISTER``, on by default). Under
expandable segments (``expandable_segments:True`` in ``PYTORCH_ALLOC_CONF``, or in
``PYTORCH_CUDA_ALLOC_CONF`` when the former is unset) the allocator unmaps and remaps those
pages later, and a replay can then hit an illegal memory access. Upstream asserts
``NCCL_GRAPH_REGISTER=0`` for its Transformer Engine graphs under expandable segments at any
rank count; here only several ranks are rejected, because one-rank graphs with expandable
segments have been run (the Megatron-FSDP runs in docs/cuda-graphs.md) and nothing crosses
ranks there.

A full-iteration graph also fixes how many micro-batches a step runs: the capture unrolls the
forward and backward passes of that many, and every replay runs exactly those. Batch-size
ramp-up (``--rampup-batch-size``) raises the count as training goes on; the replays would
keep training on the captured count, fetching and dropping the other micro-batches, while
the log, the learning-rate schedule and the consumed-samples count assume the larger batch.
Nothing would fail. So ramp-up is rejected.

Per-layer graphs (``--cuda-graph-impl local`` or ``transformer_engine``) with Megatron-FSDP:
a graphed layer's replay skips ``nn.Module.__call__``, so Megatron-FSDP's forward pre-hooks
(all-gather of the unit's weights into its buffer) and its backward hooks (gradient
reduce-scatter, buffer release) never run for that layer; the graph would read whichever
unit last occupied the buffer. The local implementation also creates its graphs after the
gradient sync, when Megatron-FSDP has swapped the parameters for their DTensor shards, and
only accepts forward pre-hooks that belong to Megatron's DDP wrapper. Supporting it needs a
graph runner that gathers a unit's weights before each replay and reduces its gradients
after, outside the graph, on buffers at fixed addresses (the max-pool double buffer gives
those). Until then, full-iteration graphs are the supported way to graph Megatron-FSDP.
"""

import os
from collections.abc import Mapping
from typing import Any

DROP_AND_PAD_FLAGS = "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"


def _moe_dispatch_problem(args: Any) -> str:
    """Why MoE token dispatch cannot be captured in a full-iteration graph ('' if it can)."""
    if not args.num_experts:
        return ""
    dispatcher = args.moe_token_dispatcher_type
    drop_and_pad = args.moe_expert_capacity_factor is not None and args.moe_pad_expert_input_to_capacity
    if dispatcher == "allgather":
        return ("the allgather MoE token dispatcher counts tokens per expert on the host "
                "every step. Use --moe-token-dispatcher-type alltoall with drop-and-pad: "
                f"{DROP_AND_PAD_FLAGS}.")
    if dispatcher == "alltoall" and not drop_and_pad:
        return ("the alltoall MoE token dispatcher copies its split sizes to the host and "
                "waits for them unless inputs are dropped and padded to a fixed capacity. "
                f"Add {DROP_AND_PAD_FLAGS}.")
    if dispatcher == "flex":
        backend = args.moe_flex_dispatcher_backend
        if backend == "deepep" or not drop_and_pad:
            return (f"the flex MoE token dispatcher ({backend} backend) reads the permuted "
                    "token count on the host. Use --moe-token-dispatcher-type alltoall with "
                    f"drop-and-pad: {DROP_AND_PAD_FLAGS}.")
    return ""


def expandable_segments(environ: Mapping[str, str]) -> bool:
    """Whether torch's caching allocator runs with expandable segments in ``environ``: the last
    ``expandable_segments`` entry of ``PYTORCH_ALLOC_CONF``, or of ``PYTORCH_CUDA_ALLOC_CONF``
    when the former is unset (torch reads the newer name first)."""
    conf = environ.get("PYTORCH_ALLOC_CONF", environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    values = [item.split(":", 1)[1] for item in conf.replace(" ", "").split(",")
              if item.startswith("expandable_segments:")]
    return bool(values) and values[-1] == "True"


def _expandable_segments_problem(args: Any, environ: Mapping[str, str]) -> str:
    """Why this environment's allocator cannot run a multi-rank graph ('' if it can)."""
    # world_size is no flag: parse_args sets it from WORLD_SIZE before validate_args calls this.
    if (not expandable_segments(environ) or args.world_size <= 1
            or environ.get("NCCL_GRAPH_REGISTER", "") == "0"):
        return ""
    return ("expandable allocator segments (expandable_segments:True) with "
            f"{args.world_size} ranks: NCCL registers the captured collectives' buffers, which "
            "expandable segments may remap (illegal memory access on replay). Set "
            "NCCL_GRAPH_REGISTER=0, or drop expandable_segments:True.")


def cuda_graph_arg_problems(args: Any, environ: Mapping[str, str] | None = None) -> list[str]:
    """Every known capture breaker in ``args`` (and ``environ``, default ``os.environ``), each
    a sentence that names the fix."""
    environ = os.environ if environ is None else environ
    impl = args.cuda_graph_impl
    problems = []
    if impl in ("local", "transformer_engine") and args.use_megatron_fsdp:
        problems.append(
            f"--cuda-graph-impl {impl} (per-layer CUDA graphs) does not work with "
            "--use-megatron-fsdp: a graphed layer's replay skips Megatron-FSDP's all-gather "
            "and reduce-scatter hooks. Use --cuda-graph-impl full_iteration, which captures "
            "them with the whole step."
        )
    if impl == "full_iteration":
        moe = _moe_dispatch_problem(args)
        if moe:
            problems.append(f"--cuda-graph-impl full_iteration cannot capture MoE layers: {moe}")
        if args.rampup_batch_size:
            problems.append(
                "--cuda-graph-impl full_iteration with --rampup-batch-size: a replay runs the "
                "number of micro-batches the graph captured, so the ramped-up batches would be "
                "fetched but not trained on. Train with a constant --global-batch-size."
            )
        alloc = _expandable_segments_problem(args, environ)
        if alloc:
            problems.append(f"--cuda-graph-impl full_iteration: {alloc}")
    return problems


def validate_cuda_graph_args(args: Any) -> None:
    """Raise ValueError listing every known capture breaker in ``args``."""
    problems = cuda_graph_arg_problems(args)
    if problems:
        raise ValueError("CUDA graphs cannot be captured with these arguments:\n  - "
                         + "\n  - ".join(problems))
