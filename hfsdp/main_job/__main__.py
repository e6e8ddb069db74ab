"""``python -m hfsdp.main_job [pretrain flags ...]``: the main job on this machine's GPUs."""

import sys

from hfsdp.environment import require_environment

require_environment("python -m hfsdp.main_job")

from hfsdp.main_job.gpu import main  # noqa: E402

sys.exit(main())
