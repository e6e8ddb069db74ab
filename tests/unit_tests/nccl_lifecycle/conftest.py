"""Session fixture for the NCCL-lifecycle CPU tests; the harness lives in nccl_harness.py."""

from typing import Any

import pytest
from nccl_harness import run_ranks


@pytest.fixture(scope="session")
def lifecycle_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 2-rank gloo job running warmup, eager-group and teardown scenarios in sequence."""
    return run_ranks("lifecycle", tmp_path_factory.mktemp("lifecycle"), n_inits=4)
