"""Which recipe made a case's outputs: a COMPARE_TO twin's numbers are reused only under the recipe that made them.

[Note: twin provenance] A case with ``COMPARE_TO`` compares its losses with the twin's
``metrics.json`` when one is there, instead of running the twin again. Numbers of another recipe
(the twin's seed or flags edited since) would make that comparison pass or fail for nothing, so
every run records in its ``result.json`` the ``recipe_hash`` of what decided its numbers and the
``metrics_digest`` of the ``metrics.json`` it wrote, and a twin's outputs are reused only when the
recipe hash recorded there is the hash of the twin as it would run now and the metrics are the
ones recorded; otherwise (no hash recorded: outputs of an older driver; or a run that stopped
between writing its metrics and its result) the twin runs again, as a missing one does, and a
twin that still does not match after that fails the case as no reference. ``result.json`` is the
record because it is written last, after every run of the case.

The hash covers (:func:`recipe_hash`):

* the bytes of ``model_config.yaml``: any edit, comments included, counts as another recipe (a
  needless re-run costs minutes; a stale reference gives a wrong verdict);
* the launch inputs as the driver resolves them: ``TRAINING_SCRIPT``, ``TEST_TYPE``, ``NPROC``,
  ``ENV_VARS``, ``ENV_VARS_2``, ``MODEL_ARGS``, ``MODEL_ARGS_2``, which include what
  ``DETERMINISM`` merges in from hfsdp/te_determinism.py, code the file does not hold;
* the run's ``--env`` pairs, which win over ``ENV_VARS``, except ``CUDA_VISIBLE_DEVICES``: it
  picks which GPUs run, not what they compute (the batch runner gives each case its own).

It does not cover the caller's environment (every job's differs: paths, Slurm's variables), the
code under test (comparing the case with its twin on the same tree is the point; a run on another
tree reuses a twin only from an output folder it shares), nor ``${...}`` placeholders, which are
hashed as written. The world size is recorded beside it (``world_size``) and checked on its own.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from pathlib import Path

from hfsdp.atomic import json_text, loads_strict
from hfsdp.functional import environment
from hfsdp.functional.recipe import Recipe

HASH_KEY = "recipe_hash"  # the field of result.json (run_case.Result) that holds it
METRICS_KEY = "metrics_digest"  # and the one naming the metrics.json the run wrote
PLACEMENT_ENV = frozenset({"CUDA_VISIBLE_DEVICES"})  # --env pairs that place a run without changing its numbers


def recipe_hash(recipe: Recipe, env: Mapping[str, str] | None = None) -> str:
    """The sha256 of what decides the numbers of ``recipe``'s runs under ``--env`` ``env`` (see the note)."""
    doc = {
        "model_config.yaml": hashlib.sha256((recipe.case_dir / "model_config.yaml").read_bytes()).hexdigest(),
        "launch": {"TRAINING_SCRIPT": recipe.training_script, "TEST_TYPE": recipe.test_type, "NPROC": recipe.nproc,
                   "ENV_VARS": recipe.env_vars, "ENV_VARS_2": recipe.env_vars_2, "MODEL_ARGS": recipe.model_args,
                   "MODEL_ARGS_2": recipe.model_args_2},
        "--env": {k: v for k, v in (env or {}).items() if k not in PLACEMENT_ENV},
    }
    return hashlib.sha256(json_text(_plain(doc), indent=None).encode()).hexdigest()


def metrics_digest(doc: object) -> str:
    """The sha256 of a ``metrics.json`` document's metrics (as written, or as read back), whatever its layout;
    its environment block is no metric and is left out."""
    if isinstance(doc, dict):
        doc = {name: spec for name, spec in doc.items() if name != environment.KEY}
    return hashlib.sha256(json_text(_plain(doc), indent=None).encode()).hexdigest()


def _plain(obj: object) -> object:
    """``obj`` with every value JSON can hold as it is and any other (a YAML date, NaN) as its text, so
    that hashing never fails on what a recipe or a metrics file may hold."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    return obj if obj is None or isinstance(obj, (bool, int, float, str)) else str(obj)


def _metrics_file_digest(path: Path) -> str | None:
    """:func:`metrics_digest` of the file at ``path`` (None: it cannot be read as strict JSON)."""
    try:
        return metrics_digest(loads_strict(Path(path).read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _recorded(result_path: Path) -> dict:
    """``result.json`` as a mapping ({} when missing or unreadable)."""
    try:
        doc = loads_strict(Path(result_path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def mismatch(recipe: Recipe, env: Mapping[str, str] | None, folder: Path) -> str | None:
    """Why the outputs in output folder ``folder`` are not ``recipe``'s as it would run now under ``env``
    (None: they are; see the note)."""
    record = _recorded(folder / "result.json")
    recorded, now = record.get(HASH_KEY), recipe_hash(recipe, env)
    if not isinstance(recorded, str):
        return f"{folder / 'result.json'} records no recipe hash"
    if recorded != now:
        return (f"{folder / 'result.json'} records another recipe (hash {recorded[:12]}, now {now[:12]}: its "
                "model_config.yaml or --env changed since)")
    if record.get(METRICS_KEY) != _metrics_file_digest(folder / "metrics.json"):
        return f"{folder / 'metrics.json'} is not the one its result.json describes (a run that did not finish?)"
    return None
