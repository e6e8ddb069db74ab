"""The README's main job on a GPU machine: ``python -m hfsdp.main_job [pretrain flags ...]``.

Trains the reference hybrid model (hfsdp/planner/setup.py ``DEFAULT_MODEL_FLAGS``) on every
local GPU with Megatron-FSDP, the max-pool double buffer and, when the model can be captured,
full-iteration CUDA graphs: the fastest configuration the fork offers. Then a short eager run
of the same model shows what the graph buys. When the configuration cannot be captured (the
CUDA-graph argument checks name why), it trains eagerly and says so. Each run is Megatron's
own ``pretrain`` under torchrun; the caller's environment is passed through, with at most two
defaults added where the caller set nothing (:func:`hfsdp.main_job.runs.run_env`).

At data-parallel size 1 (one GPU) Megatron-FSDP never all-gathers a unit, so nothing passes
through the double buffer: the output says so, and a short rehearsal at data-parallel size 2
follows on the same GPU (two ranks share it, [Note: several ranks on one GPU] in
hfsdp/launch/torchrun.py): the max-pool run, graphed where it can be, against its twin without
double buffering, both deterministic. It prints the pool against the plan, the home misses and
whether the losses are bit-identical; it says nothing about speed.

Each run's whole output (Megatron's arguments, warnings, every log line) goes to a log file in a
new folder under ``out/main_job/`` (:func:`hfsdp.main_job.logs.job_folder`), and what Megatron
prints while the job itself checks arguments and plans memory goes to ``main_job.log`` there
(:func:`hfsdp.main_job.logs.stderr_into`); the console shows the steps, the results and, for a
run that fails, the end of its output. On a machine without CUDA GPUs ``scripts/run_main.sh``
calls :func:`cpu_main` instead: the memory planner, the CUDA-graph capture check and the CPU
smoke, each summed up in a few lines, their whole output in one log file.

Environment: ``TRAIN_ITERS`` (graphed run, default 30), ``EAGER_ITERS`` (comparison, default
10, 0 skips it), ``REHEARSAL_ITERS`` (DP=2 rehearsal, default 8, 0 skips it), ``NPROC``
(default: all GPUs). The runs get the caller's environment, plus ``TRITON_CACHE_AUTOTUNING=1``
when it is unset (``hfsdp.launch.env.shared_autotune``) and, on one GPU,
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when neither it nor ``PYTORCH_ALLOC_CONF``
is set (see ``hfsdp.main_job.runs.ALLOC_CONF_ENV``). ``HFSDP_MAIN_JOB_OUT`` puts the job's
folder elsewhere.

Modules, one concern each:

- :mod:`~hfsdp.main_job.gpu`: the GPU job (its knobs, the graphed run, the eager comparison);
- :mod:`~hfsdp.main_job.runs`: one ``pretrain`` run, its flags and environment, the capture check;
- :mod:`~hfsdp.main_job.rehearsal`: the DP=2 rehearsal (two ranks on one GPU);
- :mod:`~hfsdp.main_job.cpu`: the CPU fallback (planner, capture check, CPU smoke);
- :mod:`~hfsdp.main_job.logs`: the job's log folder, log capture, failed steps on the console;
- :mod:`~hfsdp.main_job.fork`: the fork report ``scripts/run_main.sh`` prints first.
"""

from __future__ import annotations

from hfsdp.main_job.cpu import cpu_main, write_capture_problems
from hfsdp.main_job.fork import fork_report, print_fork
from hfsdp.main_job.gpu import main
from hfsdp.main_job.logs import stderr_into

__all__ = ["cpu_main", "fork_report", "main", "print_fork", "stderr_into", "write_capture_problems"]
