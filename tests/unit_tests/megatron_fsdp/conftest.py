"""Megatron-FSDP tests run against a patch-queue checkout named on PYTHONPATH (patch_queue_path.py)."""

from patch_queue_path import put_queue_trees_first

put_queue_trees_first()
