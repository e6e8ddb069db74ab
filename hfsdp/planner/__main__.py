"""``python -m hfsdp.planner <pretrain flags>``: same as scripts/fsdp_memory_planner.py."""
import sys

from hfsdp.planner.cli import main

sys.exit(main())
