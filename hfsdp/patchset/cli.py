"""``scripts/patchset`` / ``python -m hfsdp.patchset``: quilt/gbp-pq style verbs for the series.

Verbs that write (materialize, refresh, export) hold the checkout's lock and write all or
nothing; the read-only verbs (status, check, diff, lint, overlay, prefixes) write nothing in the checkout, so
they work on a read-only one. Errors are two lines, cause and way out, exit status 2; set
``HFSDP_DEBUG=1`` for a traceback (hfsdp/usererror.py). README, "What the tools guarantee".

Standard library only: it runs inside pip's isolated build environment during
``pip install -e .`` as well as from a plain checkout.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from pathlib import Path

from hfsdp.usererror import kind_of, positive, quoted, run_cli

from .check import check_against, check_base
from .diff import local_diff, series_diff
from .errors import PatchDoesNotApply, PatchsetError
from .export import export_queue
from .leftovers import parked_originals
from .lint import lint
from .lock import writing
from .materialize import kept_summary, materialize, tree_status
from .prefixes import check_prefixes, first_breaking
from .project import BASE_ENV, Project
from .queue import continue_queue, make_queue
from .refresh import refresh
from .series import patch_name
from .source import require_sdist_file


def _cmd_materialize(project: Project, args: argparse.Namespace) -> int:
    materialize(project, sdist=args.sdist, backup=args.backup)
    return 0


def _build_advice(unlisted: list[str], project: Project) -> str:
    """How to get a current tree: materialize, which refuses a series that lost patches patches/ still holds."""
    verb = "materialize" if project.base is None else f"--base {project.base} materialize"
    if unlisted:
        series = f"{project.base_label}series"
        return (f"restore {series} first (`git checkout -- {series}`) or delete the patch files it does "
                f"not list, then run `scripts/patchset {verb}`")
    return f"run `scripts/patchset {verb}`"


def _cmd_status(project: Project, args: argparse.Namespace) -> int:
    st = tree_status(project)
    pin = project.pin()
    print(f"base:    {pin.distribution} {pin.version} (sha256 {pin.sha256[:16]}...)")
    print(f"fork:    {pin.fork_version}")
    for item in st.leftovers:
        print(f"leftover: {item.path.name}: left by a killed run; the next writing command will {item.action}")
    for name in st.unlisted:
        where = project.base_label
        print(f"unlisted: {where}{name} is not in {where}series, so it is never applied -> add its name to "
              f"{where}series, or move the file out of {where}")
    if not st.exists:
        print(f"tree:    megatron/ not materialized -> {_build_advice(st.unlisted, project)}")
        return 1
    if not st.stamped and not project.megatron_dir.is_dir():
        print("tree:    megatron is a file, not a folder -> `scripts/patchset materialize --backup` keeps it as "
              "megatron.bak-* and builds the tree")
        return 1
    if not st.stamped:
        print("tree:    megatron/ exists but has no stamp (not made by this tool) -> "
              "`scripts/patchset materialize --backup` keeps it as megatron.bak-* and builds a fresh one")
        return 1
    applied = set(st.applied)
    for name in st.series:
        mark = "changed" if name in st.changed_patches else ("applied" if name in applied else "pending")
        print(f"  [{mark:7}] {name}")
    for name in st.applied:
        if name not in st.series:
            print(f"  [removed] {name} (applied, no longer in series)")
    changed = f", {len(st.changed_overlay)} changed since the tree was built" if st.changed_overlay else ""
    print(f"overlay: {st.overlay_files} file(s) in patches/overlay/{changed}")
    for path, kind in st.changed_overlay.items():
        print(f"  [{kind:7}] {path}")
    if st.base_mismatch:
        print(f"base:    STALE: {st.base_mismatch}")
    if st.fork_mismatch:
        print(f"fork:    STALE: {st.fork_mismatch}")
    print("stamp:   " + ("up to date" if st.up_to_date else f"STALE -> {_build_advice(st.unlisted, project)}"))
    if st.edits:
        how = ("`scripts/patchset diff` / `refresh`" if st.up_to_date
               else "`scripts/patchset diff`, then see materialize's advice")
        print(f"edits:   {len(st.edits)} file(s) differ from the stamp -> {how}")
        in_overlay = set(st.overlay_edits)
        for path, kind in st.edits.items():
            print(f"  {kind:8} {path}" + (" (overlay)" if path in in_overlay else ""))
    else:
        print("edits:   none")
    if st.kept:
        print(f"kept:    {len(st.kept)} entr{'y' if len(st.kept) == 1 else 'ies'} not made by this tool "
              "(a rebuild carries them over)")
        for line in kept_summary(st.kept):
            print(f"  {line}")
    return 0 if st.up_to_date and not st.edits and not st.leftovers and not st.unlisted else 1


def _cmd_check(project: Project, args: argparse.Namespace) -> int:
    if args.against is None:
        count = check_base(project, args.sdist)
        files = len(project.overlay_files())
        print(f"patchset: the overlay ({files} files) and all {count} patches apply to a pristine "
              f"{project.pin().filename} with no fuzz")
        return 0
    report = check_against(project, args.against)
    for note in report.notes:
        print(f"note:    {note}")
    for r in report.patches:
        extra = (f" ({', '.join(r.files)})" if r.files else "") + (f" [{r.note}]" if r.note else "")
        print(f"  {r.state:9} {r.patch}{extra}")
    for c in report.overlay:
        print(f"  {'conflicts':9} overlay {c.path}: {c.reason}")
    tally = {state: sum(r.state == state for r in report.patches)
             for state in ("upstream", "declared", "conflicts", "applies")}
    print(f"patchset: against {args.against}: {tally['upstream']} already upstream (reverse-apply; drop them), "
          f"{tally['declared']} declared upstream by Applied-Upstream (verify, then drop), "
          f"{tally['conflicts']} conflict (rebase them), {tally['applies']} apply; "
          f"{len(report.overlay)} overlay conflict(s) (rename, move or drop those files)")
    return 1 if report.conflicts else 0


def _cmd_refresh(project: Project, args: argparse.Namespace) -> int:
    refresh(project, patch=args.patch, new=args.new, description=args.description, sdist=args.sdist)
    return 0


def _cmd_lint(project: Project, args: argparse.Namespace) -> int:
    problems = lint(project, args.sdist, chains=args.chains)
    for problem in problems:
        print(f"lint: {problem}")
    verdict = f"found {len(problems)} problem(s)" if problems else f"clean ({len(project.series())} patches)"
    print(f"patchset: lint {verdict}")
    return 1 if problems else 0


def _cmd_prefixes(project: Project, args: argparse.Namespace) -> int:
    count = len(project.series())
    what = "the imports and each patch's X-Smoke command" if args.smoke else "the imports"
    print(f"patchset: prefixes: {count} prefixes of {project.base_label}series, {what}, {args.jobs} at a time")
    started = time.monotonic()
    results = check_prefixes(project, args.sdist, smoke=args.smoke, jobs=args.jobs)
    took = time.monotonic() - started
    failed = [r for r in results if not r.ok]
    if not failed:
        print(f"patchset: prefixes: all {len(results)} prefixes import megatron.core and megatron.training"
              f"{' and pass their smoke commands' if args.smoke else ''} ({took:.0f}s)")
        return 0
    culprit = first_breaking(results)
    if culprit is not None:
        print(f"patchset: prefixes: patch {culprit.k} ({culprit.patch}) breaks the tree: patches 1..{culprit.k} "
              f"fail ({culprit.detail})" + ("" if culprit.k == 1 else f", patches 1..{culprit.k - 1} pass")
              + f"; {len(failed)} of {len(results)} prefixes fail ({took:.0f}s)")
    queue, export = project.command("queue --dir DIR"), project.command("export --queue DIR")
    print(f"  -> fix {failed[0].patch if culprit is None else culprit.patch} so that the tree up to it works (in a "
          f"queue: `{queue}`, amend its commit, `{export}`)")
    return 1


def _cmd_diff(project: Project, args: argparse.Namespace) -> int:
    sys.stdout.write(series_diff(project, args.sdist) if args.series else local_diff(project, args.sdist))
    return 0


def _cmd_queue(project: Project, args: argparse.Namespace) -> int:
    queue = continue_queue(project, args.dir) if args.cont else make_queue(project, args.dir, args.sdist)
    print(f"patchset: queue at {args.dir}: base {queue.base[:12]} (tag patchset/base), the overlay commit, then "
          "one commit per patch")
    print("  edit with git (commit --fixup, rebase -i, new commits), "
          f"then `{project.command(f'export --queue {quoted(args.dir)}')}`")
    return 0


def _cmd_overlay(project: Project, args: argparse.Namespace) -> int:
    for path in project.overlay_files():
        print(path)
    return 0


def _cmd_export(project: Project, args: argparse.Namespace) -> int:
    drop = tuple(patch_name(name, "--drop") for name in args.drop)  # refused before the lock, too
    with writing(project, f"export --queue {args.queue}", print):
        export_queue(project, args.queue, args.sdist, drop=drop)
    return 0


WRITERS = ("materialize", "refresh", "export")  # the verbs that take the lock and recover leftovers first


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="patchset", description=__doc__)
    root_help, sdist_help = "project checkout (default: this one)", "use this local sdist (offline installs)"
    base_help = f"the base (upstream release) to work on (default: ${BASE_ENV}, else patches/base.toml's)"
    parser.add_argument("--root", type=Path, default=None, help=root_help)
    parser.add_argument("--sdist", type=Path, default=None, help=sdist_help)
    parser.add_argument("--base", default=None, metavar="VERSION", help=base_help)
    sub = parser.add_subparsers(dest="command", required=True)

    def verb(name: str, help: str, uses_sdist: bool = True) -> argparse.ArgumentParser:
        """A verb's parser; --root (and --sdist where the verb reads the sdist) are accepted after it too."""
        p = sub.add_parser(name, help=help)
        p.add_argument("--root", type=Path, default=argparse.SUPPRESS, help=root_help)
        p.add_argument("--base", default=argparse.SUPPRESS, metavar="VERSION", help=base_help)
        if uses_sdist:
            p.add_argument("--sdist", type=Path, default=argparse.SUPPRESS, help=sdist_help)
        return p

    p = verb("materialize", "build megatron/ from the pinned sdist + patches/series")
    p.add_argument("--backup", action="store_true", help="move a foreign or edited tree to megatron.bak-* and rebuild")
    p.set_defaults(func=_cmd_materialize)
    verb("status", "applied vs series, stale stamp, local edits", uses_sdist=False).set_defaults(func=_cmd_status)
    p = verb("check", "overlay + series apply with no fuzz; --against VERSION|SDIST finds upstreamed patches and "
                      "overlay conflicts")
    p.add_argument("--against", default=None, metavar="VERSION|SDIST")
    p.set_defaults(func=_cmd_check)
    p = verb("refresh", "fold edits made in megatron/ back into patches/overlay/ and the patches")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--patch", default=None, help="patch to fold the edits into (default: the one owning the files)")
    group.add_argument("--new", default=None, metavar="NAME", help="add the edits as a new patch at the end")
    p.add_argument("--description", default=None, help="Description line for --new")
    p.set_defaults(func=_cmd_refresh)
    p = verb("lint", "DEP-3 headers valid; patches change only sdist files; the overlay only adds files")
    p.add_argument("--chains", action="store_true",
                   help="also flag a patch that rewrites lines an earlier patch added (builds the series)")
    p.set_defaults(func=_cmd_lint)
    verb("overlay", "the overlay's files as megatron/ paths (where they are materialized), one a line",
         uses_sdist=False).set_defaults(func=_cmd_overlay)
    p = verb("prefixes", "build each prefix of the series (the overlay + patches 1..k) in a temporary folder and "
                         "import megatron.core and megatron.training from it (--smoke: and run patch k's X-Smoke)")
    p.add_argument("--smoke", action="store_true", help="also run each patch's X-Smoke command on its prefix")
    p.add_argument("--jobs", type=positive(int), default=min(2, os.cpu_count() or 1), metavar="N",
                   help="prefixes checked at once (default: 2, or 1 on one core)")
    p.set_defaults(func=_cmd_prefixes)
    p = verb("diff", "local edits in megatron/ as a patch (--series: the overlay, then the series)")
    p.add_argument("--series", action="store_true")
    p.set_defaults(func=_cmd_diff)
    p = verb("queue", "gbp-pq import: a git repo (base, overlay commit, one commit per patch), for editing")
    p.add_argument("--dir", type=Path, required=True, help="a new folder outside the checkout")
    p.add_argument("--continue", dest="cont", action="store_true",
                   help="after fixing the patch a queue stopped at: commit it and apply the rest")
    p.set_defaults(func=_cmd_queue)
    p = verb("export", "gbp-pq export: rewrite patches/, series and patches/overlay/ from a queue (all or nothing)")
    p.add_argument("--queue", type=Path, required=True)
    p.add_argument("--drop", action="append", default=[], metavar="NAME.patch",
                   help="a patch of the series the queue no longer has, to be removed (repeatable)")
    p.set_defaults(func=_cmd_export)
    return parser


# Errors of the machine, not of this tool: a folder that cannot be written, a full disk. Anything else is a bug
# and keeps its traceback.
_ENVIRONMENT = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG}


def main(argv: list[str] | None = None) -> int:
    def checked() -> int:
        args = build_parser().parse_args(argv)  # inside run_cli: --help into a closed pipe ends quietly
        project = Project(args.root.resolve()) if args.root else Project.default()
        if (project.patches_dir / "base.toml").is_file():  # else refused below, with the way out
            project = project.with_base(args.base)
        if args.sdist is not None:  # refused even where the verb turns out not to need it
            try:
                filename: str | None = project.pin().filename
            except PatchsetError:
                filename = None  # the verb says what is wrong with the pin
            require_sdist_file(args.sdist, "--sdist", filename)
        if not (project.patches_dir / "series").is_file() and not (project.patches_dir / "base.toml").is_file():
            parked = [path for path, name in parked_originals(project.root) if name == "patches"]
            patches = project.patches_dir
            if not parked and os.path.lexists(patches) and not patches.is_dir():
                raise PatchsetError(f"{project.root} is not a checkout of this project as it stands: its patches is "
                                    f"{kind_of(patches)}, not a folder",
                                    f"move it aside (`mv {quoted(patches)} {quoted(f'{patches}.away')}`) and put the "
                                    f"folder back (`git -C {quoted(project.root)} checkout -- patches`), or pass the "
                                    "checkout with --root")
            if not parked:
                raise PatchsetError(f"{project.root} is not a checkout of this project (no patches/series or "
                                    "patches/base.toml)", "pass the checkout with --root, or run scripts/patchset "
                                    "from it")
            if args.command not in WRITERS:  # a writer puts it back first, under the lock (leftovers.py)
                raise PatchsetError(f"patches/ is missing: a writing command moved it aside to {parked[0].name} "
                                    "and was killed (or is putting the new one in place right now)",
                                    "`scripts/patchset materialize` puts it back first (or says which writer is "
                                    "still running)")
        try:
            return args.func(project, args)
        except PatchDoesNotApply as exc:  # raised below the project: name its base in the commands
            raise exc.naming(project.command) from None

    def run() -> int:
        try:
            return checked()
        except OSError as exc:
            if exc.errno not in _ENVIRONMENT:
                raise  # a closed pipe (EPIPE) goes on to run_cli, which ends quietly
            where = f" ({exc.filename})" if exc.filename else ""
            raise PatchsetError(f"{exc.strerror}{where}; nothing was left half-written",
                                "make that path writable (or free space), then run the command again; "
                                "`scripts/patchset status` lists anything a writer left to clean up") from exc

    return run_cli("patchset", run, lambda: "nothing was left half-written\n"
                   "  -> `scripts/patchset status` lists anything the next writing command cleans up")
