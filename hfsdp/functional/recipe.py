"""Load a Megatron-layout ``model_config.yaml`` and turn it into launchable runs.

Keys kept from Megatron (``tests/functional_tests/test_cases/<model>/<case>/model_config.yaml``):
``ENV_VARS``, ``MODEL_ARGS``, ``MODEL_ARGS_2`` (overrides for the second run of a resume test),
``TEST_TYPE`` and ``METRICS``. Our additions, all optional:

* ``TRAINING_SCRIPT``: script path relative to the repo root, or ``-m module`` (default
  ``pretrain_gpt.py``);
* ``ENV_VARS_2``: env overrides for the second run (``null`` unsets a variable);
* ``NPROC``: processes per node (default 2);
* ``COMPARE_TO``: a sibling case whose ``lm loss`` curve must be identical;
* ``CHECKS``: ``log_absent`` / ``log_present`` regex lists, ``min_iterations``,
  ``loss_decreases`` (bool);
* ``REQUIRE_GOLDEN``: false for cases whose numbers are machine-specific (CPU smoke).
* ``RESUME_COMPARE``: how a ckpt-resume case's run 2 is held to run 1 (default: every resumed
  ``lm loss`` identical). ``exact_steps: N`` keeps the first N resumed steps identical (the
  first one shows the loaded weights are the saved ones; the optimizer state first shows in
  the step after) and ``rtol: R`` bounds the later steps. Only for a
  resume into a different FSDP unit layout, which changes the float summation order of
  training itself (a straight run in each layout differs from step 4; docs/functional-tests.md).

``MODEL_ARGS`` values: ``true`` -> bare flag, ``false``/``null`` -> omitted, a list -> spliced,
anything else -> ``str(value)``. ``${VAR}`` placeholders are filled from the path variables
(``OUTPUT_PATH``, ``CHECKPOINT_SAVE_PATH``, ``CHECKPOINT_LOAD_PATH``, ``TENSORBOARD_PATH``,
``DATA_PATH``, ``DATA_CACHE_PATH``) and then from the environment.
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

TEST_TYPES = ("regular", "ckpt-resume", "smoke")
DEFAULT_METRICS = ("lm loss", "num-zeros")


class RecipeError(ValueError):
    """The model_config.yaml is malformed."""


@dataclass(frozen=True)
class Checks:
    """Extra pass/fail conditions on a run's log (see module docstring)."""

    log_absent: tuple[str, ...] = ()
    log_present: tuple[str, ...] = ()
    min_iterations: int = 0
    loss_decreases: bool = False


@dataclass(frozen=True)
class ResumeCompare:
    """Run 2 vs run 1 of a ckpt-resume case (see module docstring)."""

    exact_steps: int | None = None  # None: every resumed step must be identical
    rtol: float = 0.0

    def split(self, resumed: set[int]) -> tuple[set[int], set[int]]:
        """(steps that must be identical, steps held to ``rtol``)."""
        if self.exact_steps is None:
            return set(resumed), set()
        ordered = sorted(resumed)
        return set(ordered[: self.exact_steps]), set(ordered[self.exact_steps :])


@dataclass(frozen=True)
class Recipe:
    """One functional-test case."""

    case_dir: Path
    model: str  # parent directory name: gpt / moe / hybrid / smoke
    name: str  # case directory name
    env_vars: dict[str, str | None]
    model_args: dict[str, Any]
    model_args_2: dict[str, Any]
    env_vars_2: dict[str, str | None]
    test_type: str
    metrics: tuple[str, ...]
    training_script: str = "pretrain_gpt.py"
    nproc: int = 2
    compare_to: str | None = None
    checks: Checks = field(default_factory=Checks)
    require_golden: bool = True
    resume_compare: ResumeCompare = field(default_factory=ResumeCompare)

    @property
    def train_iters(self) -> int:
        value = self.model_args.get("--train-iters")
        if value is None:
            raise RecipeError(f"{self.case_dir}: MODEL_ARGS has no --train-iters")
        return int(value)

    def golden_path(self, environment: str = "dev", platform: str = "dgx_h200") -> Path:
        return self.case_dir / f"golden_values_{environment}_{platform}.json"


def _env_map(raw: Any, where: str) -> dict[str, str | None]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{where} must be a mapping, got {type(raw).__name__}")
    return {str(k): (None if v is None else str(v)) for k, v in raw.items()}


def _resume_compare(raw: Any, test_type: str, where: str) -> ResumeCompare:
    if raw is None:
        return ResumeCompare()
    if test_type != "ckpt-resume":
        raise RecipeError(f"{where} is only for TEST_TYPE ckpt-resume, not {test_type!r}")
    if not isinstance(raw, Mapping) or set(raw) - {"exact_steps", "rtol"}:
        raise RecipeError(f"{where} must be a mapping with exact_steps and rtol, got {raw!r}")
    if "exact_steps" not in raw or "rtol" not in raw:
        raise RecipeError(f"{where} needs both exact_steps and rtol, got {dict(raw)!r}")
    exact, rtol = raw["exact_steps"], raw["rtol"]
    if isinstance(rtol, str):  # YAML 1.1 reads "5e-5" (no dot) as a string
        try:
            rtol = float(rtol)
        except ValueError:
            pass
    # An exact first step shows the weights loaded; a loose rtol could hide a lost optimizer state.
    if isinstance(exact, bool) or not isinstance(exact, int) or exact < 1:
        raise RecipeError(f"{where}: exact_steps must be an int >= 1, got {exact!r}")
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 <= rtol <= 1e-3:
        raise RecipeError(f"{where}: rtol must be a number in [0, 1e-3], got {rtol!r}")
    return ResumeCompare(exact_steps=exact, rtol=float(rtol))


def load_recipe(case_dir: str | os.PathLike[str]) -> Recipe:
    """Parse ``<case_dir>/model_config.yaml``."""
    case_dir = Path(case_dir).resolve()
    path = case_dir / "model_config.yaml"
    if not path.is_file():
        raise RecipeError(f"{path} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    unknown = set(raw) - {
        "ENV_VARS", "MODEL_ARGS", "MODEL_ARGS_2", "ENV_VARS_2", "TEST_TYPE", "METRICS",
        "TRAINING_SCRIPT", "NPROC", "COMPARE_TO", "CHECKS", "REQUIRE_GOLDEN", "RESUME_COMPARE",
    }
    if unknown:
        raise RecipeError(f"{path}: unknown keys {sorted(unknown)}")
    test_type = raw.get("TEST_TYPE", "regular")
    if test_type not in TEST_TYPES:
        raise RecipeError(f"{path}: TEST_TYPE {test_type!r} not in {TEST_TYPES}")
    model_args = raw.get("MODEL_ARGS") or {}
    if not isinstance(model_args, Mapping):
        raise RecipeError(f"{path}: MODEL_ARGS must be a mapping")
    checks_raw = raw.get("CHECKS") or {}
    checks = Checks(
        log_absent=tuple(checks_raw.get("log_absent", ())),
        log_present=tuple(checks_raw.get("log_present", ())),
        min_iterations=int(checks_raw.get("min_iterations", 0)),
        loss_decreases=bool(checks_raw.get("loss_decreases", False)),
    )
    resume_compare = _resume_compare(raw.get("RESUME_COMPARE"), test_type, f"{path}: RESUME_COMPARE")
    recipe = Recipe(
        case_dir=case_dir,
        model=case_dir.parent.name,
        name=case_dir.name,
        env_vars=_env_map(raw.get("ENV_VARS"), f"{path}: ENV_VARS"),
        model_args=dict(model_args),
        model_args_2=dict(raw.get("MODEL_ARGS_2") or {}),
        env_vars_2=_env_map(raw.get("ENV_VARS_2"), f"{path}: ENV_VARS_2"),
        test_type=test_type,
        metrics=tuple(raw.get("METRICS") or DEFAULT_METRICS),
        training_script=str(raw.get("TRAINING_SCRIPT", "pretrain_gpt.py")),
        nproc=int(raw.get("NPROC", 2)),
        compare_to=raw.get("COMPARE_TO"),
        checks=checks,
        require_golden=bool(raw.get("REQUIRE_GOLDEN", True)),
        resume_compare=resume_compare,
    )
    if recipe.test_type == "ckpt-resume":
        _ = recipe.train_iters
        for key in ("--save", "--load", "--save-interval"):
            if key not in recipe.model_args:
                raise RecipeError(f"{path}: ckpt-resume needs {key} in MODEL_ARGS")
    return recipe


def substitute(value: str, variables: Mapping[str, str]) -> str:
    """Fill ``${VAR}``/``$VAR`` from ``variables`` then ``os.environ``; unknown ones stay."""
    merged = {**os.environ, **variables}
    return string.Template(value).safe_substitute(merged)


def args_to_argv(model_args: Mapping[str, Any], variables: Mapping[str, str]) -> list[str]:
    """MODEL_ARGS mapping -> argv list (Megatron's yaml-to-CLI conventions)."""
    argv: list[str] = []
    for flag, value in model_args.items():
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv.append(flag)
            argv.extend(substitute(str(v), variables) for v in value)
        else:
            argv.extend([flag, substitute(str(value), variables)])
    return argv


def merged_args(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` applied (a ``false``/``null`` override drops the flag)."""
    out = dict(base)
    out.update(override)
    return out


def merged_env(base: Mapping[str, str | None], override: Mapping[str, str | None]
               ) -> dict[str, str | None]:
    out = dict(base)
    out.update(override)
    return out
