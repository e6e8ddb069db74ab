"""``--env KEY=VALUE``: the one way our launchers change a job's environment.

[Note: launch environment] The functional driver, the sbatch generator and the benchmark runner
pass the caller's environment to the jobs they start unchanged. Cluster settings such as
``NCCL_NVLS_ENABLE`` are the user's to choose: export them, or name them with ``--env KEY=VALUE``
(repeatable; the job's value wins over the caller's). Only our own GPU test scripts under
``tests/gpu`` pin the NVLink-multicast switches (:mod:`hfsdp.nvls_guard`).

Standard library only.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Mapping

from hfsdp.determinism import ENV as PIN_AUTOTUNE_ENV
from hfsdp.usererror import UserError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_assignments(items: Iterable[str]) -> dict[str, str]:
    """``["A=1", "B=x=y"]`` -> ``{"A": "1", "B": "x=y"}``; a malformed item is a UserError."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _NAME.match(name):
            raise UserError(
                f"--env {item!r} is not KEY=VALUE with KEY a shell variable name",
                "write it as --env NAME=VALUE, e.g. --env NCCL_NVLS_ENABLE=0 (repeat --env for more)",
            )
        if "\0" in value or "\n" in value:
            raise UserError(f"--env {name}=...: the value contains a newline or NUL byte",
                            "pass a single-line value")
        out[name] = value
    return out


# Triton autotunes the Mamba kernels in the first step of every process (a minute or more for the
# default model). With this variable set Triton keeps the timed choice in its on-disk cache, so the
# processes after the first on a machine reuse it. Our jobs set it where the caller has not.
SHARED_AUTOTUNE_ENV = "TRITON_CACHE_AUTOTUNING"


def shared_autotune(*chosen: Mapping[str, str]) -> dict[str, str]:
    """``{SHARED_AUTOTUNE_ENV: "1"}`` unless one of ``chosen`` (the caller's environment, ``--env``)
    already sets it, or pins Triton's choice instead (``HFSDP_TRITON_PIN_AUTOTUNE=1``, nothing timed
    to share): then that choice stands and nothing is added."""
    if any(SHARED_AUTOTUNE_ENV in c or c.get(PIN_AUTOTUNE_ENV) == "1" for c in chosen):
        return {}
    return {SHARED_AUTOTUNE_ENV: "1"}


def add_env_option(parser: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--env KEY=VALUE`` option (read it back with :func:`parse_assignments`)."""
    parser.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE",
        help="set this variable in the launched job (repeatable); everything else in the "
             "caller's environment is passed through unchanged",
    )


def job_env(caller: Mapping[str, str], *layers: Mapping[str, str | None]) -> dict[str, str]:
    """``caller`` with each layer applied in order (a ``None`` value unsets the variable)."""
    env = dict(caller)
    for layer in layers:
        for key, value in layer.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
    return env
