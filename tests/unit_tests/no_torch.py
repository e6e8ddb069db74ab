"""A Python without torch, for tests of what our entry points say there: ``BLOCK_TORCH`` is a
``sitecustomize`` that makes every ``import torch...`` fail as a missing module, put on a subprocess's
PYTHONPATH."""

BLOCK_TORCH = """
import sys


class _BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _BlockTorch())
"""
