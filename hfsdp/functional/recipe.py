"""Load a Megatron-layout ``model_config.yaml`` and turn it into launchable runs.

Keys kept from Megatron (``tests/functional_tests/test_cases/<model>/<case>/model_config.yaml``):
``ENV_VARS``, ``MODEL_ARGS``, ``MODEL_ARGS_2`` (overrides for the second run of a resume test),
``TEST_TYPE`` and ``METRICS``. Our additions, all optional:

* ``TRAINING_SCRIPT``: script path relative to the repo root, or ``-m module`` (default
  ``pretrain_gpt.py``);
* ``ENV_VARS_2``: env overrides for the second run (``null`` unsets a variable);
* ``NPROC``: processes per node (default 2);
* ``COMPARE_TO``: a sibling case whose ``lm loss`` curve (and validation loss, where it has
  one) must be identical;
* ``COMPARE_RTOL``: with ``COMPARE_TO``, hold the losses within this relative tolerance
  (0 < R <= 0.05) instead: for a twin whose numerics differ by design, such as a fused
  weight-gradient path that skips a bf16 rounding;
* ``CHECKS``: ``log_absent`` / ``log_present`` regex lists, ``min_iterations``,
  ``loss_decreases`` (bool);
* ``REQUIRE_GOLDEN``: false for cases whose numbers are machine-specific (CPU smoke).
* ``ENVIRONMENT``: what the case needs of its environment, checked before any GPU work
  ([Note: choosing a golden] in selection.py): ``requires`` and ``excludes``, lists of optional
  packages (``transformer_engine``, ``causal_conv1d``, ``mamba_ssm``, ``apex``), and ``why``, one
  phrase the refusal quotes. ``excludes`` names a package whose mere presence takes Megatron off
  the path the case checks (Transformer Engine's FusedAdam replaces Apex's);
* ``DETERMINISM: transformer_engine``: the environment and flags of a deterministic TE run, from
  hfsdp/te_determinism.py ([Note: deterministic TE runs]), merged into ``ENV_VARS`` and
  ``MODEL_ARGS``; the recipe must not set any of them itself (one place for them).
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
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import yaml

from hfsdp import te_determinism
from hfsdp.functional import environment
from hfsdp.functional.golden import unknown_names_text
from hfsdp.functional.logparse import METRIC_NAMES
from hfsdp.launch.torchrun import MAX_NPROC
from hfsdp.usererror import UserError, not_a_regular_file

TEST_TYPES = ("regular", "ckpt-resume", "smoke")
DEFAULT_METRICS = ("lm loss", "num-zeros")
KEYS = ("ENV_VARS", "MODEL_ARGS", "MODEL_ARGS_2", "ENV_VARS_2", "TEST_TYPE", "METRICS", "TRAINING_SCRIPT",
        "NPROC", "COMPARE_TO", "COMPARE_RTOL", "CHECKS", "REQUIRE_GOLDEN", "RESUME_COMPARE", "DETERMINISM",
        "ENVIRONMENT")
ENVIRONMENT_KEYS = ("requires", "excludes", "why")
CHECK_KEYS = ("log_absent", "log_present", "min_iterations", "loss_decreases")
REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE_FIX = "fix model_config.yaml; docs/functional-tests.md lists every key and its type"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RecipeError(UserError):
    """The model_config.yaml is missing or malformed; the message names the file."""

    def __init__(self, cause: str, fix: str = RECIPE_FIX) -> None:
        super().__init__(cause, fix)


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
class EnvironmentNeeds:
    """``ENVIRONMENT``: optional packages the case requires and those it cannot run beside."""

    requires: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    why: str = ""


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
    compare_rtol: float = 0.0  # COMPARE_RTOL: 0 means identical
    checks: Checks = field(default_factory=Checks)
    require_golden: bool = True
    resume_compare: ResumeCompare = field(default_factory=ResumeCompare)
    determinism: str | None = None  # DETERMINISM: already merged into env_vars and model_args
    environment_needs: EnvironmentNeeds = field(default_factory=EnvironmentNeeds)

    @property
    def train_iters(self) -> int:
        value = self.model_args.get("--train-iters")
        where = f"{self.case_dir / 'model_config.yaml'}: MODEL_ARGS"
        if value is None:
            raise RecipeError(f"{where} has no --train-iters", "add --train-iters N to MODEL_ARGS")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RecipeError(f"{where} --train-iters must be an integer >= 1, got {value!r}")
        return value

    def golden_path(self, label: str, platform: str) -> Path:
        """``golden_values_<label>_<platform>.json``: the environment's label in Megatron's environment
        slot ([Note: the environment of a golden] in environment.py)."""
        return self.case_dir / f"golden_values_{label}_{platform}.json"


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_at_least(raw: Mapping[str, Any], key: str, default: int, minimum: int, where: str) -> int:
    value = raw.get(key, default)
    if not _is_int(value) or value < minimum:
        raise RecipeError(f"{where}{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _flag_value(raw: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise RecipeError(f"{where}{key} must be true or false, got {value!r}")
    return value


def _env_map(raw: Any, where: str) -> dict[str, str | None]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{where} must be a mapping of variable names to values, got {type(raw).__name__}")
    out: dict[str, str | None] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise RecipeError(f"{where}: {key!r} is not an environment variable name")
        if isinstance(value, (Mapping, list, tuple)):
            raise RecipeError(f"{where} {key}: a value must be a string, number, or null (unset), "
                              f"got {type(value).__name__}")
        out[key] = None if value is None else str(value)
    return out


def _model_args(raw: Any, where: str, required: bool) -> dict[str, Any]:
    if raw is None or raw == {}:
        if required:
            raise RecipeError(f"{where} is missing: the case has nothing to launch",
                              "add MODEL_ARGS with the training flags, e.g. `MODEL_ARGS: {--train-iters: 10, ...}` "
                              "(see the cases under tests/functional_tests/test_cases)")
        return {}
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{where} must be a mapping of flags to values, got {type(raw).__name__}")
    for flag, value in raw.items():
        if not isinstance(flag, str) or not flag.startswith("--"):
            raise RecipeError(f"{where} key {flag!r} is not a flag (flags start with --)")
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, (Mapping, list, tuple)) for v in items):
            raise RecipeError(f"{where} {flag}: a value must be a scalar, true/false/null, or a list of scalars")
    return dict(raw)


def _checks(raw: Any, where: str) -> Checks:
    if raw is None:
        return Checks()
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{where} must be a mapping with keys {', '.join(CHECK_KEYS)}")
    unknown = sorted(set(map(str, raw)) - set(CHECK_KEYS))
    if unknown:
        raise RecipeError(f"{where} has unknown keys {unknown}; known: {', '.join(CHECK_KEYS)}")
    patterns: dict[str, tuple[str, ...]] = {}
    for key in ("log_absent", "log_present"):
        value = raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise RecipeError(f"{where} {key} must be a list of regular expressions, got {value!r}")
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise RecipeError(f"{where} {key}: {pattern!r} is not a valid regular expression ({exc})") from exc
        patterns[key] = tuple(value)
    return Checks(patterns["log_absent"], patterns["log_present"],
                  _int_at_least(raw, "min_iterations", 0, 0, f"{where} "),
                  _flag_value(raw, "loss_decreases", False, f"{where} "))


def _as_number(value: Any) -> Any:
    if isinstance(value, str):  # YAML 1.1 reads "5e-5" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _compare_rtol(raw: Mapping[str, Any], where: str) -> float:
    if "COMPARE_RTOL" not in raw:
        return 0.0
    if raw.get("COMPARE_TO") is None:
        raise RecipeError(f"{where}COMPARE_RTOL is only for a case with COMPARE_TO",
                          "name the twin (COMPARE_TO), or drop COMPARE_RTOL")
    rtol = _as_number(raw["COMPARE_RTOL"])
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 < rtol <= 0.05:
        raise RecipeError(f"{where}COMPARE_RTOL must be a number in (0, 0.05], got {raw['COMPARE_RTOL']!r}",
                          "omit it for identical losses, or give a small relative tolerance, e.g. 0.005")
    return float(rtol)


def _resume_compare(raw: Any, test_type: str, where: str) -> ResumeCompare:
    if raw is None:
        return ResumeCompare()
    if test_type != "ckpt-resume":
        raise RecipeError(f"{where} is only for TEST_TYPE ckpt-resume, not {test_type!r}")
    if not isinstance(raw, Mapping) or set(raw) - {"exact_steps", "rtol"}:
        raise RecipeError(f"{where} must be a mapping with exact_steps and rtol, got {raw!r}")
    if "exact_steps" not in raw or "rtol" not in raw:
        raise RecipeError(f"{where} needs both exact_steps and rtol, got {dict(raw)!r}")
    exact, rtol = raw["exact_steps"], _as_number(raw["rtol"])
    # An exact first step shows the weights loaded; a loose rtol could hide a lost optimizer state.
    if not _is_int(exact) or exact < 1:
        raise RecipeError(f"{where}: exact_steps must be an int >= 1, got {exact!r}")
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 <= rtol <= 1e-3:
        raise RecipeError(f"{where}: rtol must be a number in [0, 1e-3], got {rtol!r}")
    return ResumeCompare(exact_steps=exact, rtol=float(rtol))


def _determinism(raw: Any, path: Path, parts: Mapping[str, Mapping[str, Any]]
                 ) -> tuple[dict[str, str | None], dict[str, Any]]:
    """The ``DETERMINISM`` profile's environment and flags; none may be set by the recipe."""
    if raw != te_determinism.PROFILE:
        raise RecipeError(f"{path}: DETERMINISM must be {te_determinism.PROFILE!r}, got {raw!r}")
    env: dict[str, str | None] = dict(te_determinism.env("pin"))
    flags = te_determinism.flags()
    clash = sorted(k for key, part in parts.items() for k in part if k in (env if "ENV" in key else flags))
    if clash:
        raise RecipeError(f"{path}: {', '.join(clash)} also set by DETERMINISM: {raw}",
                          "remove them from the recipe: the deterministic settings live in one place, "
                          "hfsdp/te_determinism.py")
    return env, flags


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last silently)."""


def where(first: int, again: int) -> str:
    return f"line {first}" if first == again else f"lines {first} and {again}"


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.get(key)
            seen.setdefault(key, key_node.start_mark.line + 1)
        except TypeError:  # an unhashable key: construct_mapping says so
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice ({where(first, key_node.start_mark.line + 1)}), and YAML "
                "would keep only the last", key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{path} is not valid YAML{where}: {problem}", "fix the YAML syntax") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path} cannot be read: {exc}", "check the file's permissions and encoding") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{path} must be a mapping of keys ({', '.join(KEYS[:3])}, ...), "
                          f"got a YAML {type(raw).__name__}")
    return dict(raw)


def _training_script(raw: Any, path: Path) -> str:
    if raw is None:
        return "pretrain_gpt.py"
    if not isinstance(raw, str) or not raw.split():
        raise RecipeError(f"{path}: TRAINING_SCRIPT must name a script (relative to the repository) "
                          f"or `-m module`, got {raw!r}")
    first = raw.split()
    if first[0] == "-m":
        if len(first) < 2:
            raise RecipeError(f"{path}: TRAINING_SCRIPT {raw!r} names no module after -m")
        return raw
    if not (REPO_ROOT / first[0]).is_file():
        raise RecipeError(f"{path}: TRAINING_SCRIPT {first[0]} does not exist (looked in {REPO_ROOT})",
                          "name a script relative to the repository root, or `-m package.module`")
    return raw


def _not_a_case(case_dir: Path) -> tuple[str, str]:
    """Why ``case_dir`` is no test case, and what to pass instead."""
    path = case_dir / "model_config.yaml"
    fix = "pass a case folder that holds model_config.yaml, e.g. tests/functional_tests/test_cases/smoke/cpu_gloo_smoke"
    if case_dir.is_file():
        if case_dir.name == "model_config.yaml":
            return f"{case_dir} is the recipe file; the driver takes the case folder that holds it", \
                f"pass {case_dir.parent}"
        return f"{case_dir} is a file, not a test case folder", fix
    if os.path.lexists(path):
        return f"{path} {not_a_regular_file(path)}, so {case_dir} is not a test case", fix
    if case_dir.is_dir() and (below := sorted(case_dir.glob("*/model_config.yaml")) or
                              sorted(case_dir.glob("*/*/model_config.yaml"))):
        depth = len(below[0].relative_to(case_dir).parts) - 1
        return (f"{case_dir} is not a test case but holds {len(below)} of them",
                f"pass the cases themselves, e.g. {case_dir}/{'/'.join(['*'] * depth)} (one folder per case)")
    return f"{path} does not exist, so {case_dir} is not a test case", fix


def load_recipe(case_dir: str | os.PathLike[str]) -> Recipe:
    """Parse and check ``<case_dir>/model_config.yaml``; every error names the file."""
    case_dir = Path(case_dir).resolve()
    path = case_dir / "model_config.yaml"
    if not_a_regular_file(path) is not None:
        raise RecipeError(*_not_a_case(case_dir))
    raw = _read_yaml(path)
    unknown = sorted(set(map(str, raw)) - set(KEYS))
    if unknown:
        raise RecipeError(f"{path}: unknown keys {unknown}", f"use only {', '.join(KEYS)}")
    test_type = raw.get("TEST_TYPE", "regular")
    if test_type not in TEST_TYPES:
        raise RecipeError(f"{path}: TEST_TYPE {test_type!r} not in {TEST_TYPES}")
    model_args = _model_args(raw.get("MODEL_ARGS"), f"{path}: MODEL_ARGS", required=True)
    metrics = raw.get("METRICS", list(DEFAULT_METRICS))
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) and m for m in metrics):
        raise RecipeError(f"{path}: METRICS must be a list of metric names (e.g. [lm loss, num-zeros]), "
                          f"got {metrics!r}")
    if unknown := [m for m in metrics if m not in METRIC_NAMES]:
        raise RecipeError(f"{path}: METRICS names {unknown_names_text(unknown)}", "name only those in METRICS")
    nproc = _int_at_least(raw, "NPROC", 2, 1, f"{path}: ")
    if nproc > MAX_NPROC:
        raise RecipeError(f"{path}: NPROC {nproc} is more ranks on one node than any launch can start "
                          f"(at most {MAX_NPROC})", "give the ranks per node, e.g. NPROC: 2")
    require_golden = _flag_value(raw, "REQUIRE_GOLDEN", True, f"{path}: ")
    compare_to = raw.get("COMPARE_TO")
    if compare_to is not None and (not isinstance(compare_to, str)
                                   or not (case_dir / compare_to / "model_config.yaml").is_file()):
        raise RecipeError(f"{path}: COMPARE_TO {compare_to} is not a case folder (no "
                          f"{case_dir / str(compare_to) / 'model_config.yaml'})",
                          "name a sibling case relative to this one, e.g. ../hybrid_mcore_local_fsdp_no_db")
    compare_rtol = _compare_rtol(raw, f"{path}: ")
    env_vars = _env_map(raw.get("ENV_VARS"), f"{path}: ENV_VARS")
    model_args_2 = _model_args(raw.get("MODEL_ARGS_2"), f"{path}: MODEL_ARGS_2", required=False)
    env_vars_2 = _env_map(raw.get("ENV_VARS_2"), f"{path}: ENV_VARS_2")
    if "DETERMINISM" in raw:
        det_env, det_flags = _determinism(raw["DETERMINISM"], path, {
            "ENV_VARS": env_vars, "ENV_VARS_2": env_vars_2, "MODEL_ARGS": model_args,
            "MODEL_ARGS_2": model_args_2})
        env_vars, model_args = {**env_vars, **det_env}, {**model_args, **det_flags}
    recipe = Recipe(
        case_dir=case_dir,
        model=case_dir.parent.name,
        name=case_dir.name,
        env_vars=env_vars,
        model_args=model_args,
        model_args_2=model_args_2,
        env_vars_2=env_vars_2,
        test_type=test_type,
        metrics=tuple(metrics),
        training_script=_training_script(raw.get("TRAINING_SCRIPT"), path),
        nproc=nproc,
        compare_to=compare_to,
        compare_rtol=compare_rtol,
        checks=_checks(raw.get("CHECKS"), f"{path}: CHECKS"),
        require_golden=require_golden,
        resume_compare=_resume_compare(raw.get("RESUME_COMPARE"), test_type, f"{path}: RESUME_COMPARE"),
        determinism=raw.get("DETERMINISM"),
        environment_needs=_environment_needs(raw.get("ENVIRONMENT"), f"{path}: ENVIRONMENT"),
    )
    if "lm loss validation" in recipe.metrics:
        _check_eval_schedule(recipe, path)
    if recipe.test_type == "ckpt-resume":
        _ = recipe.train_iters
        for key in ("--save", "--load", "--save-interval"):
            if key not in recipe.model_args:
                raise RecipeError(f"{path}: ckpt-resume needs {key} in MODEL_ARGS")
    return recipe


def _environment_needs(raw: Any, where: str) -> EnvironmentNeeds:
    """``ENVIRONMENT`` checked: known keys, lists of known packages, none both required and excluded, a reason."""
    if raw is None:
        return EnvironmentNeeds()
    known = environment.PACKAGES
    if not isinstance(raw, dict):
        raise RecipeError(f"{where} must be a mapping of {', '.join(ENVIRONMENT_KEYS)}, got {raw!r}")
    if unknown := sorted(set(map(str, raw)) - set(ENVIRONMENT_KEYS)):
        raise RecipeError(f"{where} has unknown keys {unknown}", f"use only {', '.join(ENVIRONMENT_KEYS)}")
    lists: dict[str, tuple[str, ...]] = {}
    for key in ("requires", "excludes"):
        value = raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise RecipeError(f"{where}.{key} must be a list of package names, got {value!r}")
        if bad := [v for v in value if v not in known]:
            raise RecipeError(f"{where}.{key} names {bad}, which are not optional packages the driver knows",
                              f"use only {', '.join(known)}")
        lists[key] = tuple(value)
    if both := sorted(set(lists["requires"]) & set(lists["excludes"])):
        raise RecipeError(f"{where} both requires and excludes {both}", "name each package in one list")
    why = raw.get("why")
    if (lists["requires"] or lists["excludes"]) and not (isinstance(why, str) and why.strip()):
        raise RecipeError(f"{where}.why must say in one phrase why the case needs this, got {why!r}",
                          "add why: <the path the case checks>")
    return EnvironmentNeeds(lists["requires"], lists["excludes"], str(why or "").strip())


def _check_eval_schedule(recipe: Recipe, path: Path) -> None:
    """A validation-loss metric needs evaluations a golden can hold (evenly spaced steps).

    Megatron evaluates every ``--eval-interval`` steps and once more after the last one; the
    golden format (start, end, interval) holds that only when the interval divides
    ``--train-iters``. Said here, not after a GPU run that cannot record its golden.
    """
    args = recipe.model_args
    interval, iters = args.get("--eval-interval"), args.get("--eval-iters")
    if not (_is_int(iters) and iters >= 1 and _is_int(interval) and interval >= 1):
        raise RecipeError(f"{path}: METRICS has 'lm loss validation' but MODEL_ARGS does not evaluate "
                          f"(--eval-iters {iters!r}, --eval-interval {interval!r})",
                          "set --eval-iters and --eval-interval to integers >= 1, or drop the metric")
    if recipe.train_iters % interval:
        raise RecipeError(f"{path}: --eval-interval {interval} does not divide --train-iters "
                          f"{recipe.train_iters}, so the validation steps (every {interval}, then "
                          f"{recipe.train_iters}) are not evenly spaced and no golden can hold them",
                          "pick an --eval-interval that divides --train-iters")


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
