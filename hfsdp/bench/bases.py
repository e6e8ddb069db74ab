"""Pristine upstream releases beside the fork in one benchmark invocation (``--base``).

[Note: upstream bases] ``--base upstream-0.19.2`` times the same ``pretrain_gpt.py`` flags on the
unpatched megatron-core 0.19.2 (``upstream-0.18.2``: the release the fork is built on), so the
fork's best configuration can be set against what users would run instead.

* Prepared on a connected machine: ``python -m hfsdp.bench.bases prepare 0.19.2 0.18.2`` puts each
  release's sdist, as PyPI serves it, in ``out/bases/`` with a manifest (file name, sha256, where
  it came from). The sdists are fetched and verified by the patch-set tool's code
  (hfsdp/patchset/source.py, check.py); the pinned 0.18.2 is checked against patches/base.toml,
  another release against the sha256 the index publishes. The folder is what a GPU machine
  without network needs.
* At run time each prepared sdist is checked against its manifest and extracted, unpatched
  (``extract_base``), into a folder of its own for the invocation. A run of that base gets
  ``PYTHONPATH=<its tree>:<a folder holding only hfsdp/>``, ``PYTHONSAFEPATH=1`` (so the script's
  folder, the checkout with the fork's megatron/, is not searched) and ``HFSDP_UPSTREAM_BASE``,
  by which our entry checks that ``megatron.core`` is that tree (hfsdp/training/upstream_base.py)
  and drops an editable install's finder, which would serve modules the release lacks from the fork.
* The sdist has ``helpers.cpp`` but not the Makefile that upstream's start-up ``make`` needs, so
  every pristine ``pretrain`` would exit before step 1: the extension is built beforehand, as
  installing the sdist builds it, and a one-target Makefile (marked as ours) names it.
* A configuration is refused on a base whose own argument parser (asked in the run environment)
  lacks one of its flags or a model flag, or that has no local-spec hybrid layers (the fork adds
  them) for a hybrid model on local specs, in one sentence before any run. Graphed configurations get
  ``--rerun-mode disabled`` on upstream: the fork's default under full-iteration graphs, so both
  do the same work per step.
* Peak memory comes from the run report our entry writes on either tree (its forward step and
  entry are ours); on upstream it has no pool or home-miss figures from the fork's allocators.

Rows of a base are named ``<base>:<config>``; the fork's keep the configuration's name.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hfsdp.bench import configs as cfgs
from hfsdp.usererror import UserError, comma_choices, run_cli

FORK = "fork"
PREFIX = "upstream-"
SEP = ":"
VERSIONS = ("0.19.2", "0.18.2")  # the releases --base offers besides the fork
CHOICES = (FORK, *(PREFIX + v for v in VERSIONS))
DEFAULT_DIR = os.path.join("out", "bases")
# The fork's default under full-iteration graphs (megatron/training/cuda_graph_rerun.py), given to upstream.
RERUN_DISABLED = ("--rerun-mode", "disabled")
FORK_ONLY = "hfsdp-only"  # key of the trees mapping: the folder with only hfsdp/


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A release's sdist in the bases folder, as its manifest describes it."""

    version: str
    sdist: Path
    sha256: str
    source: str  # where prepare found it
    # helpers_cpp built by prepare, by the file name a tree gives it (the interpreter's suffix): file and sha256
    helpers: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    def meta(self) -> dict[str, Any]:
        return {"version": self.version, "sdist": self.sdist.name, "sha256": self.sha256, "source": self.source,
                "helpers": self.helpers}

    def prebuilt(self, name: str) -> Path | None:
        """The helpers_cpp prepare built under tree file name ``name``, if its sha256 is the manifest's."""
        from hfsdp.patchset.source import sha256_file

        entry = self.helpers.get(name)
        if not entry:
            return None
        path = self.sdist.parent / entry["file"]
        return path if path.is_file() and sha256_file(path) == entry["sha256"] else None


def names(values: Sequence[str] | None) -> list[str]:
    """The bases ``--base`` names (repeatable, comma-separated), in order; default the fork alone."""
    return comma_choices("--base", values or [FORK], CHOICES, "base")


def run_name(base: str, config: str) -> str:
    """A result row's name: the configuration for the fork, ``<base>:<config>`` for a release."""
    return config if base == FORK else f"{base}{SEP}{config}"


def split(name: str) -> tuple[str, str]:
    """(base, configuration) of a row name."""
    base, sep, config = name.rpartition(SEP)
    return (base, config) if sep else (FORK, name)


def version(base: str) -> str:
    return base.removeprefix(PREFIX)


def config(name: str) -> cfgs.BenchConfig:
    """The configuration a row runs: on a release, named as the row, graphed ones with the rerun mode disabled."""
    base, name_ = split(name)
    found = cfgs.CONFIGS[name_]
    if base == FORK:
        return found
    extra = RERUN_DISABLED if found.graphed and RERUN_DISABLED[0] not in found.flags else ()
    return dataclasses.replace(found, name=name, flags=(*found.flags, *extra))


def startup_class(name: str) -> tuple[str, str, bool]:
    """cfgs.startup_class per base: each tree compiles its own dataset helper and bytecode."""
    return (split(name)[0], *cfgs.startup_class(split(name)[1]))


def priming_runs(run_names: Sequence[str]) -> list[str]:
    """The first row of each start-up class, in order ([Note: priming] in hfsdp/bench/run.py)."""
    seen: set[tuple[str, str, bool]] = set()
    out = []
    for name in run_names:
        if (cls := startup_class(name)) not in seen:
            seen.add(cls)
            out.append(name)
    return out


def loss_groups(run_names: Sequence[str]) -> dict[str, list[str]]:
    """cfgs.loss_groups per base: a release's rows are held to its own eager twin (its FSDP units differ)."""
    groups: dict[str, list[str]] = {}
    for name in run_names:
        base, config_ = split(name)
        groups.setdefault(run_name(base, cfgs.loss_baseline(config_)), []).append(name)
    return groups


# --- preparing (connected machine) and finding (any machine)


def manifest_path(folder: Path, version_: str) -> Path:
    return folder / f"megatron_core-{version_}.json"


def prepare(target: str, folder: Path, env: Mapping[str, str] | None = None) -> Prepared:
    """Put the sdist of release ``target`` (a version, or an sdist file) and its manifest in ``folder``."""
    from hfsdp.atomic import write_json_atomic
    from hfsdp.patchset.check import _download_unpinned, _newer_pin
    from hfsdp.patchset.project import Project
    from hfsdp.patchset.source import locate_sdist, published_sha256, sha256_file
    from hfsdp.patchset.tree import extract_base

    pin = Project.default().pin()
    if target == pin.version:
        other, path = pin, locate_sdist(pin, env=None if env is None else dict(env))  # sha256 of the pin
        source = f"{pin.filename}, sha256 as patches/base.toml pins it"
    else:
        other, given = _newer_pin(pin, target)
        if given is not None:
            path = given
            source = f"{path.name}, a local file (not checked against the index)"
        else:
            path = _download_unpinned(other)
            published, why = published_sha256(other, other.filename, env)
            if published is None:
                raise UserError(f"the sha256 of {path} cannot be checked: {why}",
                                "prepare on a machine that reaches the index")
            if published != sha256_file(path):
                raise UserError(f"{path} is not the {other.filename} the index publishes (sha256 differs)",
                                f"delete {path} and prepare again")
            source = f"{other.filename} from {other.index_url}, sha256 as the index publishes it"
    digest = sha256_file(path)
    folder.mkdir(parents=True, exist_ok=True)
    helpers: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="hfsdp-base-") as tmp:
        extract_base(dataclasses.replace(other, sha256=digest), path, Path(tmp))  # a release we can read
        # Its dataset helpers for this interpreter too, for a GPU machine without a compiler (build_dataset_helpers).
        try:
            built = build_dataset_helpers(Path(tmp))
        except UserError as exc:
            built = None
            print(f"note: {exc.cause}; the machine that runs it will build them")
        if built is not None:
            kept = folder / f"megatron_core-{other.version}.{built.name}"
            shutil.copyfile(built, kept)
            helpers[built.name] = {"file": kept.name, "sha256": sha256_file(kept)}
    dest = folder / other.filename
    if dest.resolve() != path.resolve():
        part = dest.with_name(dest.name + ".part")
        shutil.copyfile(path, part)
        os.replace(part, dest)
    prepared = Prepared(other.version, dest, digest, source, helpers)
    write_json_atomic(str(manifest_path(folder, other.version)), prepared.meta())
    return prepared


def find(base: str, folder: Path) -> Prepared:
    """The prepared sdist of ``base`` in ``folder``, its sha256 checked against the manifest."""
    from hfsdp.patchset.source import sha256_file

    version_ = version(base)
    manifest = manifest_path(folder, version_)
    fix = (f"on a machine with network run `python -m hfsdp.bench.bases prepare {version_}` (it writes "
           f"{DEFAULT_DIR}/), and copy that folder here or give it with --bases-dir")
    try:
        doc = json.loads(manifest.read_text())
        sdist = folder / doc["sdist"]
        prepared = Prepared(doc["version"], sdist, doc["sha256"], doc["source"], dict(doc.get("helpers") or {}))
    except FileNotFoundError:
        raise UserError(f"{base} is not prepared: {folder} has no {manifest.name}", fix) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{base}: {manifest} is not a manifest prepare wrote ({exc})", fix) from None
    if prepared.version != version_ or not sdist.is_file():
        raise UserError(f"{base} is not prepared: {manifest.name} names {doc['sdist']}, which {folder} lacks"
                        if prepared.version == version_ else f"{base}: {manifest} describes {prepared.version}", fix)
    if sha256_file(sdist) != prepared.sha256:
        raise UserError(f"{base}: {sdist} is not the file its manifest describes (sha256 differs)", fix)
    return prepared


def materialize(prepared: Prepared, dest: Path) -> Path:
    """Extract ``prepared`` unpatched into ``dest/megatron-core-<version>/``; returns that tree."""
    from hfsdp.patchset.project import Project
    from hfsdp.patchset.tree import extract_base

    pin = dataclasses.replace(Project.default().pin(), version=prepared.version, filename=prepared.sdist.name,
                              sha256=prepared.sha256, url="")
    tree = dest / f"megatron-core-{prepared.version}"
    tree.mkdir(parents=True)
    extract_base(pin, prepared.sdist, tree)
    return tree


DATASETS = Path("megatron", "core", "datasets")
MAKEFILE_NOTE = ("# Not part of the release: written by hfsdp/bench/bases.py. The sdist lacks the Makefile that\n"
                 "# megatron.core.datasets.utils.compile_helpers runs at start-up; helpers_cpp was built from this\n"
                 "# release's helpers.cpp beforehand, as installing the sdist builds it, so make has nothing to do.\n")


_LOADS = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('helpers_cpp', sys.argv[1]); "
          "s.loader.exec_module(importlib.util.module_from_spec(s))")


def build_dataset_helpers(tree: Path, prebuilt: Callable[[str], Path | None] = lambda name: None) -> Path | None:
    """Build the release's ``helpers.cpp`` into ``helpers_cpp`` beside it, as installing its sdist does, and give
    its folder a Makefile naming the result, so that upstream's start-up ``make`` finds it built (the sdist has no
    Makefile, so every pristine run would stop there). The compiler command is the fork's (helpers_build.py);
    ``prebuilt(file name)`` may offer the file prepare built from the same sdist, taken when it loads here. A
    release without ``helpers.cpp`` gets nothing (None); one that cannot be built here is one sentence."""
    import importlib.machinery
    import subprocess

    from megatron.core.datasets import helpers_build

    folder = tree / DATASETS
    source = folder / "helpers.cpp"
    if not source.is_file():
        return None
    target = folder / ("helpers_cpp" + importlib.machinery.EXTENSION_SUFFIXES[0])
    if (ready := prebuilt(target.name)) is not None:
        shutil.copyfile(ready, target)
        if subprocess.run([sys.executable, "-c", _LOADS, str(target)], capture_output=True).returncode == 0:
            (folder / "Makefile").write_text(f"{MAKEFILE_NOTE}default: {target.name}\n")
            return target
        target.unlink()  # built elsewhere and does not load here: build it
    try:
        command = [str(source) if arg == str(helpers_build.SOURCE) else arg
                   for arg in helpers_build.build_command(target)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(last_error_line(done.stderr) or f"the compiler exited with {done.returncode}")
    except (RuntimeError, OSError) as exc:
        raise UserError(f"megatron-core {tree.name.rsplit('-', 1)[-1]}'s dataset helpers (helpers.cpp, which its "
                        f"pretrain builds at start-up) cannot be built here: {str(exc).splitlines()[0]}",
                        "install a C++ compiler and pybind11 (pip install pybind11), or drop the release from "
                        "--base") from None
    (folder / "Makefile").write_text(f"{MAKEFILE_NOTE}default: {target.name}\n")
    return target


def hfsdp_only(dest: Path) -> Path:
    """A folder holding only our hfsdp package (a link), for a base run's PYTHONPATH."""
    import hfsdp

    folder = dest / "hfsdp-only"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "hfsdp"
    if not link.exists():
        link.symlink_to(Path(hfsdp.__file__).resolve().parent, target_is_directory=True)
    return folder


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a release offers the benchmark's rows: its parser's flags, and whether it has local-spec hybrid
    layers (hfsdp/training/specs.py HYBRID_LOCAL_SPEC, which the fork adds)."""

    flags: frozenset[str]
    local_hybrid: bool


# Run in a release's environment: what Capabilities holds, as JSON on the last line.
_PROBE = """
import argparse, importlib.util, sys
from hfsdp.atomic import json_text
from hfsdp.training import upstream_base
upstream_base.ensure(upstream_base.active())
from megatron.training.arguments import add_megatron_arguments
parser = argparse.ArgumentParser(allow_abbrev=False)
add_megatron_arguments(parser)
flags = sorted(s for a in parser._actions for s in a.option_strings)
try:
    local_hybrid = importlib.util.find_spec(sys.argv[1]) is not None
except ModuleNotFoundError:  # a package on the way is missing
    local_hybrid = False
print(json_text({"flags": flags, "local_hybrid": local_hybrid}, indent=None), end="")
"""


def capabilities(base: str, trees: Mapping[str, Path], caller: Mapping[str, str]) -> Capabilities:
    """Asked of the release in its run environment (a Python process on its tree, its own argument parser);
    a release that cannot build its parser here is one sentence, before any run."""
    import subprocess

    from hfsdp.launch.env import job_env
    from hfsdp.training.specs import HYBRID_LOCAL_SPEC

    env = job_env(caller, run_env(run_name(base, "no_db"), trees, caller))
    done = subprocess.run([sys.executable, "-c", _PROBE, HYBRID_LOCAL_SPEC[0]], env=env, capture_output=True,
                          text=True, cwd=trees[base])
    try:
        if done.returncode != 0:
            raise ValueError
        found = json.loads(done.stdout.strip().splitlines()[-1])
        return Capabilities(frozenset(f for f in found["flags"] if isinstance(f, str)), found["local_hybrid"] is True)
    except (ValueError, IndexError, KeyError, TypeError):
        said = last_error_line(done.stderr) or f"exit status {done.returncode}"
        raise UserError(f"{base}'s Megatron argument parser cannot be built here: {said}",
                        f"install what megatron-core {version(base)} imports, or drop {base} from --base") from None


def refusal(name: str, model_flags: Sequence[str], offers: Capabilities) -> str | None:
    """Why row ``name`` cannot run on its release (one sentence), or None."""
    from hfsdp.launch.pretrain import flag_value

    base, _ = split(name)
    if base == FORK:
        return None
    flags = [*model_flags, *config(name).flags]
    given = [f.split("=", 1)[0] for f in flags if f.startswith("--")]
    if missing := list(dict.fromkeys(f for f in given if f not in offers.flags)):
        return (f"megatron-core {version(base)} has no {', '.join(missing)} "
                f"({'flags' if len(missing) > 1 else 'a flag'} of the fork or of a later release)")
    impl = flag_value(flags, "--transformer-impl") or "transformer_engine"  # Megatron's default
    if "--hybrid-layer-pattern" in given and "--spec" not in given and impl == "local" and not offers.local_hybrid:
        return (f"megatron-core {version(base)} has no local-spec hybrid layers (the fork adds them), so it runs "
                "this hybrid model only on Transformer Engine specs (the te_* configurations)")
    return None


def run_env(name: str, trees: Mapping[str, Path], caller: Mapping[str, str]) -> dict[str, str | None]:
    """What a row's environment layers on the caller's: nothing for the fork (and no upstream tree named); for
    a release, its tree and hfsdp alone on PYTHONPATH (caller entries holding a megatron/ dropped)."""
    from hfsdp.training import upstream_base

    base, _ = split(name)
    if base == FORK:
        return {upstream_base.ENV: None}
    tree = trees[base]
    kept = [p for p in caller.get("PYTHONPATH", "").split(os.pathsep) if p and not Path(p, "megatron").exists()]
    return {"PYTHONPATH": os.pathsep.join([str(tree), str(trees[FORK_ONLY]), *kept]),
            "PYTHONSAFEPATH": "1", upstream_base.ENV: str(tree)}


def fork_version(root: Path | None = None) -> str:
    """The fork's version as its tree says (the stamp of the checkout's ``megatron/``, whichever base it was
    built from); without a readable stamp, the version of the base ``HFSDP_BASE`` chooses (else the default)."""
    from hfsdp.patchset.errors import PatchsetError
    from hfsdp.patchset.project import Project
    from hfsdp.patchset.stamp import read_stamp

    project = Project.default() if root is None else Project(root)
    try:
        stamp = read_stamp(project.root)
    except PatchsetError:
        stamp = None
    return stamp.fork_version if stamp is not None else project.with_base(None).pin().fork_version


def resolve(bases: Sequence[str], folder: Path, stack: contextlib.ExitStack,
            build: bool = True) -> tuple[dict[str, Path], dict[str, dict[str, str]]]:
    """Trees of the releases among ``bases``, extracted into a folder ``stack`` removes (keyed by base, plus
    FORK_ONLY), with their dataset helpers built unless ``build`` is false (build_dataset_helpers), and each
    base's meta: the fork's version, or a release's sdist (file name, sha256, where it came from). A release
    that is not prepared is one sentence, before anything is extracted."""
    found = {base: find(base, folder) for base in bases if base != FORK}
    fork = {"version": fork_version(), "tree": "this checkout's megatron/"}
    meta: dict[str, dict[str, Any]] = {base: dict(fork) if base == FORK else found[base].meta() for base in bases}
    trees: dict[str, Path] = {}
    if found:
        dest = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hfsdp-bases-")))
        trees = {base: materialize(prepared, dest) for base, prepared in found.items()}
        for base in found if build else ():
            if (built := build_dataset_helpers(trees[base], found[base].prebuilt)) is not None:
                meta[base]["dataset_helpers"] = (f"{built.name} built from the release's helpers.cpp; Makefile "
                                                 "added so that its start-up make finds it")
        trees[FORK_ONLY] = hfsdp_only(dest)
    return trees, meta


# --- reading the results


_NOISE = re.compile(r"ChildFailedError|^\s*(raise |File |\^|~|Traceback)|errors\.ChildFailedError|elastic")
_ERROR = re.compile(r"(?:^|\s)(?:[A-Za-z_.]*(?:Error|Exception|Interrupt)|AssertionError)(?::|$)|: error: |^error:")
_RANK = re.compile(r"^\[(?:rank|default)\d+\]:\s?")


def last_error_line(text: str) -> str | None:
    """The last line of a run's log that says what went wrong (an exception or a one-sentence error), with a
    rank prefix removed; torchrun's own report of the failed child is not one."""
    for raw in reversed(text.splitlines()):
        line = _RANK.sub("", raw).strip()
        if line and _ERROR.search(line) and not _NOISE.search(line):
            return line
    return None


def failure_line(name: str, why: str, log_text: str) -> str:
    """One line for a row's failed run: ``<base> <config>: failed: <what the log ends with>``."""
    base, config_ = split(name)
    said = last_error_line(log_text) or why.splitlines()[0]
    return f"{base} {config_}: failed: {said}"


def best_per_base(summaries: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per base, its configuration with the shortest median step among those that ran."""
    best: dict[str, Any] = {}
    for s in summaries:
        base, _ = split(s.config)
        if base not in best or s.median_step_s < best[base].median_step_s:
            best[base] = s
    return {b: {"config": split(s.config)[1], "median_step_s": s.median_step_s,
                "peak_allocated_bytes": s.peak_allocated_bytes} for b, s in best.items()}


def format_best(best: Mapping[str, Mapping[str, Any]]) -> list[str]:
    if len(best) < 2 and FORK in best:
        return []
    ref = best.get(FORK)
    lines = ["best configuration per base (shortest median step):"]
    for base, b in best.items():
        vs = (f"  {b['median_step_s'] / ref['median_step_s']:.2f} x the fork's best"
              if ref is not None and base != FORK else "")
        lines.append(f"  {base:<16} {b['config']:<20} {b['median_step_s'] * 1e3:9.1f} ms  "
                     f"peak alloc {b['peak_allocated_bytes'] / 2**20:9.1f} MiB{vs}")
    return lines


# --- python -m hfsdp.bench.bases prepare VERSION ...


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hfsdp.bench.bases", lambda: _main(sys.argv[1:] if argv is None else list(argv)))


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hfsdp.bench.bases",
                                description="Prepare pristine megatron-core releases for the benchmark's --base.")
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="fetch and verify each release's sdist into --dir (needs network)")
    prep.add_argument("releases", nargs="+", metavar="VERSION", help=f"e.g. {' '.join(VERSIONS)}, or an sdist file")
    prep.add_argument("--dir", default=DEFAULT_DIR, help=f"where to put them (default {DEFAULT_DIR})")
    opts = p.parse_args(argv)
    from hfsdp.usererror import output_folder

    output_folder("--dir", opts.dir)
    for target in opts.releases:
        got = prepare(target, Path(opts.dir))
        print(f"prepared upstream-{got.version}: {got.sdist} ({got.sdist.stat().st_size / 2**20:.1f} MiB), "
              f"sha256 {got.sha256}")
    print(f"carry {opts.dir}/ to the GPU machine; the benchmark takes --base upstream-<version> --bases-dir {opts.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
