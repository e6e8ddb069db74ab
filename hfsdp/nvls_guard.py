"""The NVLink-multicast guard of our own GPU test scripts (``tests/gpu``), and nothing else.

The machines our GPU tests run on must keep NVLS / multicast off. The scripts under
``tests/gpu`` export these values and check them with ``python -m hfsdp.nvls_guard`` before any
GPU work; the Python test harnesses call :func:`assert_guard`. The product's launchers do not
import this module: they pass the user's environment through ([Note: launch environment] in
hfsdp/launch/env.py), so on a shared machine set the guard yourself (README, "Shared machines").

Standard library only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

NVLS_SAFE_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def guard_violations(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Guard variables whose value differs from the safe one: name -> actual value (or None)."""
    env = os.environ if environ is None else environ
    return {k: env.get(k) for k, v in NVLS_SAFE_ENV.items() if env.get(k) != v}


def assert_guard(environ: Mapping[str, str] | None = None) -> None:
    """Raise AssertionError naming every guard variable that is not at its safe value."""
    bad = guard_violations(environ)
    assert not bad, f"NVLS guard not set: expected {NVLS_SAFE_ENV}, got {bad}"


def main() -> int:
    bad = guard_violations()
    if bad:
        exports = " ".join(f"{k}={v}" for k, v in NVLS_SAFE_ENV.items())
        print(f"refusing: NVLS guard not set ({bad}); export {exports}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
