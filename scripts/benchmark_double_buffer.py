#!/usr/bin/env python3
"""Benchmark Megatron-FSDP double buffering (no / FixedPool / max-pool); see docs/benchmark.md."""
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # PYTHONPATH wins

from hfsdp.environment import require_environment  # noqa: E402

if __name__ == "__main__":
    require_environment("benchmark_double_buffer")

from hfsdp.bench.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
