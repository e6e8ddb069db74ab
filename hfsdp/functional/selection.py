"""Which golden a run is held to, and what a case needs of its environment.

[Note: choosing a golden]
A case directory holds ``golden_values_<label>_<platform>.json`` files, each with the environment
it was recorded in ([Note: the environment of a golden] in environment.py). A run is held to the
golden of its platform (GPU kind, base, and ``_shared`` for several ranks per GPU) whose
environment equals its own in every field; the file name only says where to look first. With
several ranks per GPU the run is held, in order, to the mode's golden of its kind, to a real-GPU
golden of its kind, then to a real-GPU golden of another kind: losses compare exactly across
kinds of one architecture ([Note: goldens of the several-ranks-per-GPU mode] in golden.py). A
golden of another kind is also what ``--platform`` asks for explicitly: the GPU field is then
not compared. Every other field is.

Where no golden matches, the verdict is "no golden for this environment": it names the nearest
golden (fewest differences) and each difference, and the way to a matching golden.

A recipe's ``ENVIRONMENT`` block says what the case needs (``requires``) and what it cannot run
beside (``excludes``): a package whose mere presence takes Megatron off the path the case exists
to check. A case whose needs are not met is refused in one line before any GPU work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from hfsdp.functional import environment, golden
from hfsdp.functional.environment import Environment
from hfsdp.functional.recipe import Recipe
from hfsdp.usererror import not_a_regular_file

PREFIX = "golden_values_"


@dataclass(frozen=True)
class Candidate:
    """One golden file of a case: its platform (from the name) and its environment (None: unrecorded)."""

    path: Path
    label: str
    platform: str
    env: Environment | None
    problem: str | None = None  # why the file is no usable golden (unreadable, no environment block)


def parse_name(name: str) -> tuple[str, str] | None:
    """(label, platform) of ``golden_values_<label>_<platform>.json``; None for another name."""
    if not (name.startswith(PREFIX) and name.endswith(".json")):
        return None
    label, sep, platform = name[len(PREFIX):-len(".json")].partition("_")
    return (label, platform) if sep and label and platform else None


def candidates(recipe: Recipe) -> list[Candidate]:
    """Every golden of ``recipe``'s case, sorted by name; one that cannot be used says why (``problem``)."""
    out = []
    for path in sorted(recipe.case_dir.glob(f"{PREFIX}*.json")):
        if (parsed := parse_name(path.name)) is None:
            continue
        # A named pipe or device would block the read: run_case refuses it where it would be held to it.
        if (odd := not_a_regular_file(path)) is not None:
            out.append(Candidate(path, *parsed, None, f"golden {path} {odd}"))
            continue
        try:
            env = golden.read_environment(path)
        except golden.GoldenError as exc:
            out.append(Candidate(path, *parsed, None, f"{exc.cause} -> {exc.fix}"))
            continue
        problem = None if env is not None else (
            f"golden {path} records no environment -> re-record it with --record in the environment it is for")
        out.append(Candidate(path, *parsed, env, problem))
    return out


def platform_of(env: Environment) -> str:
    """The platform of a probed environment: its GPU kind, and ``_mcore<version>`` for a base other than the default."""
    from hfsdp.patchset.project import Project

    return env.gpu + ("" if env.base == Project.default().pin().version else f"_mcore{env.base}")


def kind_of(platform: str) -> str:
    """The GPU kind a platform name starts with (``dgx_h200_mcore0.19.2_shared`` -> ``dgx_h200``)."""
    parts = platform.split("_")
    return "_".join(parts[:2]) if len(parts) >= 2 else platform


def same_tail(a: str, b: str) -> bool:
    """Whether two platforms name the same base and mode (they may differ in GPU kind)."""
    return a[len(kind_of(a)):] == b[len(kind_of(b)):]


@dataclass(frozen=True)
class Selection:
    """Where this run's golden is (or would be recorded) and whether it holds for this environment."""

    path: Path  # the golden held to, or where one for this environment would be recorded
    matched: bool
    nearest: Candidate | None = None
    differences: tuple[str, ...] = ()
    problem: str | None = None  # the file at ``path`` is no usable golden: the case FAILs naming it

    def verdict_line(self) -> str:
        """The one-line reason of a "no golden for this environment" verdict."""
        if self.nearest is None:
            return (f"the case has no golden; record one here with --record (it is written to {self.path.name})")
        env = self.nearest.env.describe() if self.nearest.env is not None else "an unrecorded environment"
        return (f"nearest golden {self.nearest.path.name} differs in {'; '.join(self.differences)} -> record one "
                f"for this environment with --record (written to {self.path.name}), or run where that golden was "
                f"recorded ({env})")


def _differences(run: Environment, cand: Candidate, platform: str, ignore_gpu: bool) -> list[str]:
    if cand.env is None:
        return ["it is no usable golden"]
    found = environment.differences(run, replace(cand.env, gpu=run.gpu) if ignore_gpu else cand.env)
    if not same_tail(cand.platform, platform):
        found.insert(0, f"platform {platform} here, {cand.platform} there")
    return found


def select(recipe: Recipe, run: Environment, platforms: list[str], label: str | None = None,
           ignore_gpu: bool = False, any_kind: bool = False) -> Selection:
    """The golden for ``run`` among ``platforms`` (in order of preference; the first names where a
    new golden is recorded). ``ignore_gpu``: a platform given explicitly, whose GPU field is not
    compared. ``any_kind``: also a golden of another GPU kind with the last platform's base and mode."""
    label = label or run.label()
    found = candidates(recipe)
    for platform in platforms:
        for cand in found:
            if cand.platform == platform and not _differences(run, cand, platform, ignore_gpu):
                return Selection(cand.path, True)
    if any_kind:
        last = platforms[-1]
        for cand in found:
            if same_tail(cand.platform, last) and not golden.is_shared_platform(cand.platform) \
                    and not _differences(run, cand, cand.platform, True):
                return Selection(cand.path, True)
    target = recipe.golden_path(label, platforms[0])
    if broken := next((c.problem for c in found if c.path == target and c.problem), None):
        return Selection(target, False, problem=broken)
    scored = [(len(diffs), cand.path.name, cand, diffs) for cand in found if cand.env is not None
              for diffs in [_differences(run, cand, platforms[0], ignore_gpu)]]
    if not scored:
        return Selection(target, False)
    _, _, nearest, diffs = min(scored, key=lambda item: (item[0], item[1]))
    return Selection(target, False, nearest, tuple(diffs))


def unmet_needs(recipe: Recipe, run: Environment) -> str | None:
    """One sentence when ``run`` lacks a package the case requires or has one it excludes, else None."""
    needs = recipe.environment_needs
    lacking = [p for p in needs.requires if run.package(p) is None]
    present = [p for p in needs.excludes if run.package(p) is not None]
    if not lacking and not present:
        return None
    parts = []
    if lacking:
        parts.append("needs " + ", ".join(environment.PACKAGE_NAMES[p] for p in lacking) + ", absent here")
    if present:
        parts.append("excludes " + ", ".join(environment.PACKAGE_NAMES[p] for p in present) + ", importable here")
    want = [f"with {environment.PACKAGE_NAMES[p]}" for p in needs.requires] + \
           [f"without {environment.PACKAGE_NAMES[p]}" for p in needs.excludes]
    return (f"{'; '.join(parts)} ({needs.why}) -> run it in an environment {' and '.join(want)} "
            "(docs/functional-tests.md lists what each case needs)")
