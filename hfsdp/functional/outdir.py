"""Output folders of the functional driver: it clears only folders it made, never a test case.

[Note: output folders] A case's output folder is ``<output-dir>/<model>/<case>`` (plus
``node<k>`` per node on several nodes). The driver clears it before a launch, because a stale
checkpoint would turn run 1 into a resume, and writes its metrics and result there when it only
judges a log (``--evaluate-log``). Writing into a folder that exists, and so clearing it, is
allowed only when the folder is empty or

* carries the driver's marker file (written when the driver created it), and
* holds nothing at its top level but names the driver writes (logs, metrics, checkpoints, ...),

and never when the folder is, lies inside, or contains a test case (``model_config.yaml`` or
``golden_values_*.json``). Otherwise the run is refused and the offending path named: an
``--output-dir`` pointing at the test cases once made the output folder the case folder itself.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

from hfsdp.usererror import UserError, output_folder

MARKER = ".hfsdp-functional-output"
# Everything the driver (and the training it launches, through the path variables) puts at
# the top level of a case's output folder.
DRIVER_OUTPUTS = frozenset({MARKER, "run1.log", "run2.log", "metrics.json", "result.json", "checkpoints",
                            "tensorboard", "data_cache"})
CASE_FILES = ("model_config.yaml", "golden_values_*.json")
ROOT_SCAN_DEPTH = 4  # <root>/[tests/functional_tests/]test_cases/<model>/<case>: deep enough, and bounded
FIX = "pick an empty folder outside the test cases with --output-dir (or HFSDP_FUNCTIONAL_OUT)"


def _case_files_below(folder: Path, max_depth: int | None = None, limit: int = 3) -> list[Path]:
    """Up to ``limit`` test case files under ``folder`` (``max_depth`` folder levels down)."""
    found: list[Path] = []
    top = len(folder.parts)
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        if max_depth is not None and len(here.parts) - top >= max_depth:
            dirnames[:] = []
        found += [here / n for n in filenames if any(fnmatch.fnmatch(n, pat) for pat in CASE_FILES)]
        if len(found) >= limit:
            return found[:limit]
    return found


def check_not_a_case(out: Path, max_depth: int | None = None, fix: str = FIX) -> None:
    """Refuse an output folder that is, lies inside, or contains a test case (``fix``: the way out)."""
    out = out.resolve()
    for folder in (out, *out.parents):
        if (folder / "model_config.yaml").is_file():
            what = "is the test case" if folder == out else f"is inside the test case {folder}"
            raise UserError(f"output folder {out} {what}; a run would write into (and a rerun clear) "
                            f"the case's model_config.yaml and goldens", fix)
    if out.is_dir() and (found := _case_files_below(out, max_depth)):
        raise UserError(f"output folder {out} holds test case files ({', '.join(map(str, found))}); "
                        "the driver clears its output folder before a run", fix)


def foreign_entries(out: Path, marker: str = MARKER, ours: frozenset[str] | None = DRIVER_OUTPUTS) -> list[str]:
    """Top-level entries of ``out`` that the writer whose ``marker`` it is did not make: all of them without
    the marker; with it, those not named in ``ours`` (None: every entry is the writer's)."""
    names = sorted(p.name for p in out.iterdir())
    if marker not in names:
        return names
    return [n for n in names if ours is not None and n not in ours]


def refuse_foreign(what: str, out: Path, fix: str, *, marker: str = MARKER,
                   ours: frozenset[str] | None = DRIVER_OUTPUTS, maker: str = "the functional driver",
                   rule: str = "it writes into and clears only folders it made") -> None:
    """[Note: made by us] Every writer of ours writes into a folder that exists only when the folder is
    empty or carries its ``marker`` (written when it made the folder, :func:`mark`): a folder the user
    made, or one of another tool, is refused, naming what it holds (``what``: how the folder is given)."""
    if out.is_dir() and (foreign := foreign_entries(out, marker, ours)):
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        only = ", driver outputs only" if ours is not None else ""
        raise UserError(f"{what} {out} exists and holds {shown}, not made by {maker} ({rule}: {marker} marker{only})",
                        f"{fix}; or, if those are yours to lose, remove {out} yourself")


def mark(out: Path, marker: str = MARKER) -> None:
    """Make ``out`` (if missing) and put ``marker`` in it: from now on it is a folder we made."""
    out.mkdir(parents=True, exist_ok=True)
    (out / marker).touch()


def check(out: Path) -> None:
    """Refuse an ``out`` that :func:`prepare` may not use (see the note), changing nothing."""
    check_not_a_case(out)
    try:
        output_folder("output folder", out)
    except UserError as exc:
        raise UserError(exc.cause, FIX) from None  # the way out is --output-dir, which names its parent
    refuse_foreign("output folder", out, FIX)


def prepare(out: Path, clear: bool) -> Path:
    """Make ``out`` ready for a run (see the note); returns it. ``clear`` empties a previous run."""
    check(out)
    try:
        if out.exists() and clear:
            shutil.rmtree(out)
        mark(out)
    except OSError as exc:
        raise UserError(f"output folder {out} cannot be made: {exc.strerror or exc}", FIX) from exc
    return out


def check_root(root: Path) -> None:
    """Refuse an ``--output-dir`` that is or holds test cases (they sit a few levels down), or that
    cannot be made or written (:func:`hfsdp.usererror.output_folder`)."""
    check_not_a_case(root, max_depth=ROOT_SCAN_DEPTH)
    output_folder("--output-dir", root)
