#!/usr/bin/env python3
"""Megatron-FSDP double-buffer memory planner (no GPU needed); see docs/memory-planner.md."""
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # PYTHONPATH (a materialized tree) wins

from hfsdp.environment import require_environment  # noqa: E402

if __name__ == "__main__":
    require_environment("fsdp_memory_planner")

from hfsdp.planner.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
