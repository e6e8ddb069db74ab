"""Readers of the profiler's Chrome traces and of the CUDA allocator's history: GPU busy and idle
time per step (:mod:`~hfsdp.trace.timeline`, :mod:`~hfsdp.trace.idle`), blocking host calls
(:mod:`~hfsdp.trace.waits`), device time by launching code (:mod:`~hfsdp.trace.launchers`), host
time of two traces compared (:mod:`~hfsdp.trace.hostdiff`), kernel classes
(:mod:`~hfsdp.trace.kernels`) and the live set at the memory peak (:mod:`~hfsdp.trace.memtrace`).

The benchmark's profiling passes write their reports with them (hfsdp/bench/worker.py); each reader
but memtrace is also a command, ``python -m hfsdp.trace.<name> TRACE.json[.gz]`` (docs/benchmark.md).
Standard library only.
"""
