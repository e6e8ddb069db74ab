"""Functional-test driver: Megatron-style ``model_config.yaml`` recipes, goldens and comparisons.

Entry point: ``python -m hfsdp.functional.run_case <case_dir> [--record] [--compare-to <case>]``.
Stdlib + PyYAML only; torch is needed only by the training processes it launches.
"""
