"""The double-buffer tests: run against a patch-queue checkout named on PYTHONPATH (patch_queue_path.py);
the GPU tests (marker ``gpu``) share maxpool_gpu_harness.py's module-scoped ``dist_env`` fixture,
imported here after the path is set."""

from patch_queue_path import put_queue_trees_first

put_queue_trees_first()

from maxpool_gpu_harness import dist_env  # noqa: E402, F401
