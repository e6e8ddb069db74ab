"""The environment an in-process functional driver "probes" in CPU tests ([Note: the environment of a golden]
in hfsdp/functional/environment.py): a one-GPU H200 machine with torch and mamba_ssm only. conftest.py puts it in
place of the probe; tests marked ``real_environment_probe`` and drivers started as subprocesses probe for real."""

from __future__ import annotations

from dataclasses import replace
from typing import Any


def fake_environment(**changes: Any) -> Any:
    from hfsdp.functional.environment import Environment
    from hfsdp.functional.platform import base_version
    from hfsdp.training import requirements

    env = Environment(gpu="dgx_h200", base=base_version(), torch="2.11.0+cu130", cuda="13.0", nccl="2.28.9",
                      packages=(("apex", None), ("causal_conv1d", None), ("mamba_ssm", "2.3.2.post1"),
                                ("transformer_engine", None)),
                      megatron_paths=tuple(sorted(requirements.megatron_paths(lambda m: False).items())))
    return replace(env, **changes)
