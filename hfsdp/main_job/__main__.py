"""``python -m hfsdp.main_job [pretrain flags ...]``: the main job on this machine's GPUs."""

import sys

from hfsdp.main_job.gpu import main

sys.exit(main())
