# Copyright (c) 2026, hfsdp authors. Added by the hfsdp patch series.

"""Full-iteration CUDA graphs run Megatron's rerun state machine disabled unless asked.

[Note: result validation under full-iteration graphs]
Megatron's default ``--rerun-mode validate_results`` ends each step's forward-backward loop
with a world all-reduce of "did any rank ask for a rerun?", read on the host
(``RerunStateMachine._reduce_any``). Under ``--cuda-graph-impl full_iteration`` that read
comes right after the graph is launched, so the host waits for the whole captured
forward-backward before it launches the optimizer step. The optimizer step is host-bound
Python (the fused Adam over DTensor shards, the main-to-model weight copy, the grad-norm
bookkeeping), so the GPU then idles while the host works through it. Without the read, those
launches queue behind the graph while it runs.

Under full-iteration graphs nothing can ask for a rerun: only ``validate_result`` does, and
each of its callers reads a value on the host, which a capture cannot contain. They are the
loss NaN check (``--check-for-nan-in-loss-and-grad``, which Megatron forbids with these graphs)
and the gradient checks of Megatron's non-FSDP DDP buffers; a replay runs no Python at all.
Validation would be a collective and a host sync per step that cannot find anything. So when
``--rerun-mode`` was left at Megatron's default, it becomes ``disabled``, with a warning. An
explicit ``--rerun-mode`` is kept; ``validate_results`` and ``report_stats`` (which reduces
after every step too) then get a warning naming the cost. The mode decides only whether a step
is replayed and what a checkpoint records about replays (disabled: nothing; loading handles
either), never the arithmetic, so losses are bit-identical either way.
"""

import sys
from collections.abc import Callable, Sequence
from typing import Any

FLAG = "--rerun-mode"
VALIDATE = "validate_results"
DISABLED = "disabled"


def given_on_command_line(flag: str, argv: Sequence[str]) -> bool:
    """Whether ``flag`` (``--name``) appears in ``argv`` as ``--name VALUE`` or ``--name=VALUE``."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def rerun_mode_for_graphs(args: Any, warn: Callable[[str], None],
                          argv: Sequence[str] | None = None) -> str | None:
    """Disable result validation under full-iteration graphs when the mode is Megatron's
    default (see [Note: result validation under full-iteration graphs]).

    ``warn`` says it once (validate_args passes its warn_rank_0); ``argv``: the command line
    ``parse_args`` read (default ``sys.argv[1:]``). Returns the warning given, or None when
    there was nothing to say.
    """
    if args.cuda_graph_impl != "full_iteration":
        return None
    mode = args.rerun_mode
    if mode == DISABLED:
        return None
    argv = sys.argv[1:] if argv is None else argv
    if mode != VALIDATE or given_on_command_line(FLAG, argv):
        message = (f"{FLAG} {mode} with --cuda-graph-impl full_iteration checks nothing "
                   "(captured steps run no Python, and the NaN checks are off) but costs a world "
                   "all-reduce and a host sync per step, which keeps the optimizer's launches "
                   f"from overlapping the graph. {FLAG} {DISABLED} avoids it.")
    else:
        args.rerun_mode = DISABLED
        message = (f"Setting {FLAG} to {DISABLED} for --cuda-graph-impl full_iteration: result "
                   "validation has nothing to check there (captured steps run no Python, and the "
                   "NaN checks are off), and its per-step all-reduce and host sync would keep the "
                   f"optimizer's launches from overlapping the graph. Pass {FLAG} explicitly to "
                   "choose another mode.")
    warn(message)
    return message
