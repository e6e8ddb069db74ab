"""``python -m hfsdp.planner <pretrain flags>``: same as scripts/fsdp_memory_planner.py."""
import sys

from hfsdp.environment import require_environment

require_environment("python -m hfsdp.planner")

from hfsdp.planner.cli import main  # noqa: E402

sys.exit(main())
