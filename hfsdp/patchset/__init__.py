"""Patch-series tooling: materialize megatron/ from the pinned sdist plus patches/series."""
