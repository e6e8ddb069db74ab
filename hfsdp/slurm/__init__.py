"""SLURM launch for functional-test cases: sbatch generation, submission, pass/fail summary.

CLI: ``python -m hfsdp.slurm.submit`` (submit) and ``python -m hfsdp.slurm.summary``.
"""
