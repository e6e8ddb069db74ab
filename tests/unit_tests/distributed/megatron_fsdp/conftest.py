"""The max-pool GPU tests' module-scoped process group (maxpool_gpu_harness.py)."""

from maxpool_gpu_harness import dist_env  # noqa: F401
