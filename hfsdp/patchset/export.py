"""``export``: write a queue's commits back as ``patches/`` (gbp-pq export), all or nothing.

[Note: export writes all or nothing] Everything is checked before a byte is written:

1. the queue's root commit is the pristine base, the queue is not stopped at a patch, and
   every commit subject is a unique patch name, except the overlay commit's (``overlay``), which
   comes right after the base ([Note: the queue] in tree.py);
2. no patch or overlay file changed after the queue was made (the queue's state records the
   series and the overlay; a pull or an edit since would otherwise be undone), unless ``patches/``
   already holds exactly what the queue exports (a second export, or one killed after it wrote
   ``patches/``): then nothing is written;
3. every patch of the series is in the queue, or named with ``--drop`` (a queue that lacks
   patches once made ``export`` delete them); a queue without an overlay commit is refused while
   ``patches/overlay/`` has files (exporting it would delete them);
4. the overlay commit only adds files, each one an overlay file ([Note: the overlay] in
   overlay.py); a patch commit creates no file (new files belong in the overlay commit), except
   those that the patch of the same name already creates in ``patches/`` (``lint`` names these,
   and a queue of such a series still round-trips unchanged);
5. the rendered overlay and patches, applied to a fresh pristine base, give exactly the queue's
   tree (not checked when ``patches/`` already holds them: nothing is written then).

Then the new ``patches/`` (series and overlay included) is built beside the old one and swapped in
with the guarded swap (guarded_swap.py), against a snapshot of ``patches/`` taken before any of it was read:
a file saved there while the queue was read and checked undoes the swap instead of being
overwritten. The same export is byte-identical every time, so review diffs show only real changes.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hfsdp.usererror import UserError, env_number, not_a_regular_file, quoted

from . import gitops
from .errors import PatchsetError, SeriesError
from .guarded_swap import TMP_PREFIX, swap_in
from .lint import SUMMARY_MAX, lint_header
from .overlay import OVERLAY_DIR_NAME, OVERLAY_SUBJECT, Overlay, path_problem, read_overlay, source_name, write_files
from .project import Project
from .queue import BASE_TAG, read_state, require_queue_folder
from .scan import describe, scan
from .series import NAME_RULE, Patch, as_patch_name, is_patch_name, parse_header, parse_patch, patch_name, render_patch
from .source import locate_sdist
from .tree import BASE_SUBJECT, build_queue, extract_base

SERIES_HEADER = (
    "# Ordered patch series applied to the pinned megatron-core sdist (patches/base.toml).\n"
    "# One file name per line; '#' starts a comment. Maintained by `scripts/patchset export`.\n"
)


def today() -> str:
    """Last-Update date; SOURCE_DATE_EPOCH (seconds since 1970, UTC) makes it reproducible."""
    epoch = env_number("SOURCE_DATE_EPOCH", None, zero=True, unset_means="today's date")
    if epoch is None:
        return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
    try:
        return _dt.datetime.fromtimestamp(epoch, _dt.UTC).strftime("%Y-%m-%d")
    except (OverflowError, OSError, ValueError):
        raise UserError(f"SOURCE_DATE_EPOCH={epoch} is past the last date a patch header can carry (9999-12-31); "
                        "nothing was written",
                        "set it to seconds since 1970-01-01 UTC (`date +%s`), or unset it") from None



@dataclass
class ExportPlan:
    """What an export will write: patch texts in series order, the patches it removes, the overlay."""

    texts: dict[str, str]  # name -> file text, in order
    dropped: list[str]
    tree: str  # the queue's HEAD tree, which the overlay and the texts must reproduce
    overlay: Overlay
    series: str | None  # the new series file, or None to keep it as it is (same patches, same order)
    already_there: bool = False  # patches/ holds exactly this already (:func:`holds`): export writes nothing

    def patches(self, patches_dir: Path) -> list[Patch]:
        return [parse_patch(name, text, patches_dir / name) for name, text in self.texts.items()]


def _queue_base(repo: Path) -> str:
    """The queue's root commit (its pristine upstream tree)."""
    require_queue_folder(repo, "export --queue")
    roots = gitops.git(["rev-list", "--max-parents=0", "HEAD"], cwd=repo).stdout.split()
    if len(roots) != 1:
        raise PatchsetError(f"queue {repo} has {len(roots)} root commits",
                            "a queue is one linear branch on the base commit")
    return roots[0]


def _pristine_tree_id(project: Project, sdist: Path | None) -> str:
    pin = project.pin()
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        repo = Path(tmp) / "base"
        repo.mkdir()
        gitops.init_repo(repo)
        extract_base(pin, locate_sdist(pin, sdist), repo)
        gitops.commit_all(repo, BASE_SUBJECT + "\n")
        return gitops.tree_of(repo, "HEAD")


def _patch_from_commit(repo: Path, commit: str, parent: str, previous: Patch | None, changed: bool) -> tuple[str, str]:
    """(file name, file text) for one queue commit. Subject = name; body = DEP-3 header."""
    text = gitops.message(repo, commit)
    subject, _, body = text.partition("\n")
    name = as_patch_name(subject).removesuffix(".patch")
    if not is_patch_name(f"{name}.patch"):
        raise SeriesError(
            f"queue commit {commit[:12]} has subject {subject!r}, which is not a patch name; the subject must be "
            "the patch name. Nothing was written",
            f"reword it to a lowercase-dashed name ({NAME_RULE}; `git -C {quoted(repo)} rebase -i {BASE_TAG}`, then "
            f"`reword`), then `scripts/patchset export --queue {quoted(repo)}` again",
        )
    header = body.strip("\n")
    if previous is not None and not header:
        header = previous.header_text.strip("\n")
    fields = parse_header(header)
    if changed and "Last-Update" in fields:
        header = "\n".join(
            f"Last-Update: {today()}" if line.startswith("Last-Update:") else line for line in header.splitlines()
        )
    diff = gitops.diff_commits(repo, parent, commit)
    if "diff --git " not in diff:
        raise SeriesError(f"queue commit {commit[:12]} ({name}) changes nothing. Nothing was written",
                          f"drop the commit (`git -C {quoted(repo)} rebase -i {BASE_TAG}`) and pass "
                          f"`--drop {name}.patch` if the patch is to go")
    return f"{name}.patch", render_patch(header, diff)


def _refuse_invalid_header(repo: Path, commit: str, name: str, text: str, refresh: bool) -> None:
    """A patch is written only with a valid DEP-3 header (what ``lint`` checks): a queue commit with no header, or
    one that lacks a field, is refused, not written for lint to flag afterwards."""
    if not (problems := lint_header(parse_patch(name, text, repo / name))):
        return
    listing = "; ".join(problem.message for problem in problems)
    if refresh:
        raise SeriesError(f"the header refresh would write for {name} is not a valid DEP-3 header ({listing}); "
                          "nothing was written", "give --description a one-line summary of at most "
                          f"{SUMMARY_MAX} characters, then run the refresh again")
    raise SeriesError(
        f"queue commit {commit[:12]} ({name}) has no valid DEP-3 header in its message ({listing}); nothing was "
        "written",
        f"reword it (`git -C {quoted(repo)} rebase -i {BASE_TAG}`, then `reword`): the subject line, a blank line, "
        "then the header, one field a line: 'Description: what and why', 'Origin: vendor, hfsdp', 'Bug: none', "
        "'Forwarded: no', 'Applied-Upstream: no', 'Last-Update: YYYY-MM-DD'; then export again")


def _same_change(project: Project, repo: Path, parent: str, commit: str, previous: Patch) -> bool:
    """On a base other than the default: whether the series' patch (a shared one, written against another
    release) turns ``parent`` into exactly ``commit``'s tree. Its diff then differs from the queue's in line
    numbers or context only, and it is kept as it is rather than becoming this base's variant."""
    if project.base is None:
        return False
    return gitops.tree_after(repo, parent, previous.diff) == gitops.tree_of(repo, commit)


def _header(name: str, text: str) -> str:
    """A patch file's DEP-3 header (everything before its ``---`` line)."""
    return parse_patch(name, text, Path(name)).header_text


def _same_but_date(text: str, other: str) -> bool:
    """Whether two patch texts differ at most in their Last-Update line (a patch whose diff and header are the
    queue's keeps its file byte for byte: exporting again, after a first export or a killed one, rewrites
    nothing)."""
    def undated(t: str) -> list[str]:
        return [line for line in t.splitlines() if not line.startswith("Last-Update:")]
    return undated(text) == undated(other)


def _subject(repo: Path, commit: str) -> str:
    return gitops.message(repo, commit).partition("\n")[0].strip()


def split_queue(repo: Path, base: str) -> tuple[str | None, list[str]]:
    """(the overlay commit, or None if the queue has none; the patch commits, oldest first)."""
    commits = gitops.rev_list(repo, base)
    misplaced = [c for c in commits[1:] if _subject(repo, c) == OVERLAY_SUBJECT]
    if misplaced:
        raise SeriesError(
            f"queue commit {misplaced[0][:12]} of {repo} has the subject '{OVERLAY_SUBJECT}', but the overlay commit "
            "comes right after the base; nothing was written",
            f"move its line first, or fold it into the first one, in `git -C {quoted(repo)} rebase -i {BASE_TAG}`, "
            "then "
            f"`scripts/patchset export --queue {quoted(repo)}` again",
        )
    if commits and _subject(repo, commits[0]) == OVERLAY_SUBJECT:
        return commits[0], commits[1:]
    return None, commits


def overlay_of_commit(repo: Path, base: str, commit: str, members: tuple[str, ...]) -> Overlay:
    """The files the overlay commit adds; it may only add overlay files (step 4 of the note)."""
    changes = gitops.name_status(repo, base, commit)
    if changed := [f"{status} {path}" for status, path in changes if status != "A"]:
        raise SeriesError(
            f"the overlay commit {commit[:12]} of {repo} changes or deletes files of the base; it may only add "
            f"files. Nothing was written:\n{describe(changed)}",
            f"move those changes into patch commits (`git -C {quoted(repo)} rebase -i {BASE_TAG}`), then "
            f"`scripts/patchset export --queue {quoted(repo)}` again",
        )
    files: dict[str, str] = {}
    refused: list[str] = []
    for _, path in changes:
        if (why := path_problem(path, members)) is not None:
            refused.append(f"{path} {why}")
            continue
        try:
            files[path] = gitops.blob(repo, commit, path).decode("utf-8")
        except UnicodeDecodeError:
            refused.append(f"{path} is not UTF-8 text")
    if refused:
        raise SeriesError(
            f"the overlay commit {commit[:12]} of {repo} adds what cannot be an overlay file; nothing was "
            f"written:\n{describe(refused)}",
            f"remove those files from the overlay commit (`git -C {quoted(repo)} rebase -i {BASE_TAG}`), then "
            f"`scripts/patchset export --queue {quoted(repo)}` again",
        )
    return Overlay.of(files)


def _refuse_created_files(repo: Path, commit: str, parent: str, name: str, previous: Patch | None) -> None:
    """A patch commit creates no file, except those the patch of that name already creates (step 4 of the note)."""
    before = {new for old, new in previous.touched_files() if old == "/dev/null"} if previous is not None else set()
    created = [path for status, path in gitops.name_status(repo, parent, commit)
               if status == "A" and path not in before]
    if created:
        raise SeriesError(
            f"queue commit {commit[:12]} ({name}) creates {', '.join(created)}; a file upstream does not have belongs "
            "in the overlay commit. Nothing was written",
            f"move it there: in `git -C {quoted(repo)} rebase -i {BASE_TAG}` mark the overlay commit `edit`, add "
            "the file there (`git commit --amend`), `git rebase --continue` (the patch commit then no longer "
            "creates it); "
            f"then `scripts/patchset export --queue {quoted(repo)}` again",
        )


def _refuse_changed_since(project: Project, repo: Path, then_series: list[list[str]],
                          then_overlay: list[list[str]] | None) -> None:
    """Step 2 of the note: patch or overlay files that changed after the queue was made."""
    old = {p.name: p.sha256 for p in project.series()}
    then = {name: sha256 for name, sha256 in then_series}
    changed = sorted(n for n in set(then) | set(old) if then.get(n) != old.get(n))
    if then_overlay is not None:
        now_overlay, was = dict(project.overlay().digests()), {path: sha256 for path, sha256 in then_overlay}
        changed += [source_name(p) for p in sorted(set(was) | set(now_overlay)) if was.get(p) != now_overlay.get(p)]
    if changed:
        raise PatchsetError(
            f"patches changed after the queue {repo} was made ({', '.join(changed)}); exporting it would "
            "undo those changes, so nothing was written",
            "make a fresh queue from the current patches (`scripts/patchset queue --dir DIR`, DIR: a new "
            "folder) and redo your queue changes there",
        )


def plan_export(project: Project, repo: Path, drop: tuple[str, ...] = (), sdist: Path | None = None,
                check_state: bool = True, keep: dict[str, str] | None = None) -> ExportPlan:
    """Steps 1-4 of the note, then step 5 (:func:`validate`): what ``repo`` exports to; raises before anything
    is written. With ``check_state`` (export), a plan that ``patches/`` already holds is returned as it is,
    ``already_there``, without the rest of step 2 and step 5: it writes nothing. ``keep`` (refresh): patch
    name -> its diff as the queue was built; a patch whose diff is still that keeps its file byte for byte,
    and ``series`` is kept when it lists the same patches."""
    drop = tuple(patch_name(name, "--drop") for name in drop)
    today()  # SOURCE_DATE_EPOCH is checked on every path that writes patches/, whether it dates a patch or not
    repo = repo.absolute()
    base = _queue_base(repo)
    state = read_state(repo) if check_state else None
    if state is not None and state.stopped_at is not None:
        raise PatchsetError(f"queue {repo} is stopped at {state.stopped_at}, which does not apply yet; "
                            "nothing was written",
                            f"finish it: apply the rejected hunks, delete the *.rej files, "
                            f"`scripts/patchset queue --continue --dir {quoted(repo)}`; then export again")
    if state is not None and state.pending:
        raise PatchsetError(f"queue {repo}: a `queue --continue` was killed before it applied "
                            f"{', '.join(state.pending)}; nothing was written",
                            f"finish it: `scripts/patchset queue --continue --dir {quoted(repo)}`, then export again")
    if gitops.tree_of(repo, base) != _pristine_tree_id(project, sdist):
        raise PatchsetError(
            f"the root commit of {repo} is not the pristine {project.pin().filename} tree; nothing was written",
            "build queues with `scripts/patchset queue --dir DIR` (or from a clone of one)",
        )
    old = {p.name: p for p in project.series()}
    overlay_commit, patch_commits = split_queue(repo, base)
    overlay = Overlay() if overlay_commit is None else overlay_of_commit(repo, base, overlay_commit,
                                                                           project.pin().members)
    if overlay_commit is None and (had := project.overlay_files()):
        raise SeriesError(
            f"the queue {repo} has no overlay commit (subject '{OVERLAY_SUBJECT}', right after the base), but "
            f"patches/overlay/ has {len(had)} file(s); exporting would delete them, so nothing was written",
            "make a new queue from the current patches (`scripts/patchset queue --dir DIR`, DIR: a new folder), "
            "which has one, and redo your queue changes there",
        )
    texts: dict[str, str] = {}
    parent = base if overlay_commit is None else overlay_commit
    for commit in patch_commits:
        name_guess = _subject(repo, commit) + ".patch"
        previous = old.get(name_guess)
        fresh = gitops.diff_commits(repo, parent, commit).rstrip("\n")
        changed = previous is None or previous.diff.rstrip("\n") != fresh
        # On another base, a shared patch written against another release differs from the queue's diff in line
        # numbers or context while making the same change: it is kept as it is, not turned into a variant.
        same_change = (keep is None and changed and previous is not None
                       and _same_change(project, repo, parent, commit, previous))
        name, text = _patch_from_commit(repo, commit, parent, previous, changed)
        if name in texts:
            raise SeriesError(f"two queue commits are both named {name}; nothing was written",
                              "give each patch commit a unique subject")
        _refuse_created_files(repo, commit, parent, name, previous)
        if previous is None:
            unchanged = False
        elif keep is not None:
            unchanged = keep.get(name) == fresh
        elif same_change:
            unchanged = _same_but_date(_header(name, text), _header(name, previous.text))
        else:
            unchanged = not changed and _same_but_date(text, previous.text)
        texts[name] = previous.text if unchanged and previous is not None else text
        if texts[name] is text:
            _refuse_invalid_header(repo, commit, name, text, refresh=keep is not None)
        parent = commit
    unknown = sorted(set(drop) - set(old))
    if unknown:
        raise SeriesError(f"--drop {', '.join(unknown)}: not in {project.base_label}series; nothing was written",
                          f"name patches listed in {project.base_label}series")
    kept_but_dropped = sorted(set(drop) & set(texts))
    if kept_but_dropped:
        raise SeriesError(f"--drop {', '.join(kept_but_dropped)}: the queue still has a commit for it; "
                          "nothing was written", "remove the commit from the queue, or do not --drop it")
    missing = [n for n in old if n not in texts and n not in drop]
    if missing:
        raise SeriesError(
            f"the queue {repo} has no commit for {', '.join(missing)} (in {project.base_label}series); exporting would "
            "delete them, so nothing was written",
            "if you removed them on purpose, say so: "
            + " ".join(f"`--drop {n}`" for n in missing)
            + "; otherwise the queue is incomplete: make a new one with `scripts/patchset queue --dir DIR`",
        )
    _refuse_overwriting_unlisted(project, [n for n in texts if n not in old])
    _refuse_dropping_what_another_base_applies(project, drop)
    same_series = keep is not None and list(texts) == list(old)
    series = None if same_series else render_series(project, list(texts))
    plan = ExportPlan(texts, sorted(drop), gitops.tree_of(repo, "HEAD"), overlay, series)
    if check_state:  # export (refresh writes what it plans)
        plan.already_there = holds(project, plan)  # a second export, or a killed one that wrote patches/
        if plan.already_there:  # nothing will be written: nothing to undo (step 2), nothing to check (step 5)
            return plan
        if state is not None:
            _refuse_changed_since(project, repo, state.series, state.overlay)
    _refuse_overlay_change_on_another_base(project, overlay)
    validate(project, plan, sdist)
    return plan


def _refuse_overlay_change_on_another_base(project: Project, overlay: Overlay) -> None:
    """The overlay is every base's ([Note: bases] in project.py): a base other than the default leaves it alone."""
    now = project.overlay().files
    if project.base is None or overlay.files == now:
        return
    differ = sorted(p for p in set(overlay.files) | set(now) if overlay.files.get(p) != now.get(p))
    raise SeriesError(
        f"the queue changes the overlay ({', '.join(differ)}), which every base shares, but this is base "
        f"{project.base}; nothing was written",
        "make overlay changes on the default base (a queue made without --base), or as a patch of this base")


def _refuse_dropping_what_another_base_applies(project: Project, drop: tuple[str, ...]) -> None:
    """The default base's --drop deletes the shared file: refuse while another base applies it from there."""
    if project.base is not None or not drop:
        return
    users = []
    for version in project.bases()[1:]:
        other = project.with_base(version)
        names = {p.name for p in other.series()}
        users += [f"{name} ({other.base_label}series)" for name in drop
                  if name in names and not (other.base_dir / name).exists()]
    if users:
        raise SeriesError(
            f"--drop would delete {', '.join(users)}, which another base applies from patches/; nothing was written",
            "take it out of that base's series first, or give that base its own copy (a variant in its folder)")


def render_series(project: Project, names: list[str]) -> str:
    """The series file listing ``names``. The default base's has the standard header; another base's keeps its
    file's comments (which say why each patch is carried or left out): those before its first name, then the
    names (each with the comment on its line), then every other comment line."""
    if project.base is None:
        return SERIES_HEADER + "".join(f"{n}\n" for n in names)
    lines = (project.base_dir / "series").read_text(encoding="utf-8").splitlines(keepends=True)
    is_name = [bool(line.strip()) and not line.lstrip().startswith("#") for line in lines]
    own = {line.split("#", 1)[0].strip(): line if line.endswith("\n") else line + "\n"
           for line, name in zip(lines, is_name, strict=True) if name}  # a name's line, its own comment kept
    first = is_name.index(True) if True in is_name else len(lines)
    after = [line for line, name in zip(lines[first:], is_name[first:], strict=True) if not name]
    return "".join(lines[:first]) + "".join(own.get(n, f"{n}\n") for n in names) + "".join(after)


def holds(project: Project, plan: ExportPlan) -> bool:
    """Whether ``patches/`` already holds exactly what ``plan`` writes (then exporting writes nothing)."""
    now = [(p.name, p.text) for p in project.series()]
    series = (project.base_dir / "series").read_text(encoding="utf-8")
    return (not plan.dropped and list(plan.texts.items()) == now and plan.series in (None, series)
            and plan.overlay.files == project.overlay().files)


def _refuse_overwriting_unlisted(project: Project, new_names: list[str]) -> None:
    """A new patch must not take the place of a file in patches/ that the series does not list (it may be
    someone's only copy of a change)."""
    taken = [n for n in new_names if os.path.lexists(project.base_dir / n)]
    if taken:
        where = project.base_label
        raise SeriesError(
            f"{', '.join(taken)} would be written as a new patch, but {where} already has a file of that name that "
            f"is not in {where}series; nothing was written",
            f"move that file out of {where} (it may be your only copy of a change), or give the new patch another name",
        )


def validate(project: Project, plan: ExportPlan, sdist: Path | None = None) -> None:
    """Step 5: the rendered overlay and patches rebuild exactly the queue's tree from a pristine base."""
    pin = project.pin()
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        rebuilt = build_queue(pin, locate_sdist(pin, sdist), plan.patches(Path(tmp)), Path(tmp) / "check",
                              plan.overlay)
        got = gitops.tree_of(rebuilt.repo, "HEAD")
    if got != plan.tree:
        raise PatchsetError("the exported overlay and patches would not rebuild the queue's tree (tree "
                            f"{got[:12]} != {plan.tree[:12]}); nothing was written",
                            "this is a bug in the tool; please report it with the queue")


def _write_overlay(built: Path, members: tuple[str, ...], overlay: Overlay) -> list[str]:
    """Make ``built/overlay`` (a copy of patches/overlay) hold exactly ``overlay``'s files: write the new and
    changed ones, remove the ones it no longer has and the folders that leaves empty; anything else there (a
    cache) stays. Returns the overlay paths written or removed."""
    folder = built / OVERLAY_DIR_NAME
    old = read_overlay(folder, members)
    gone = [path for path in old.paths if path not in overlay.files]
    for path in gone:
        (folder / path).unlink()
        for parent in (folder / path).parents:
            if parent == built or any(parent.iterdir()):
                break
            parent.rmdir()
    changed = {path: text for path, text in overlay.files.items() if old.files.get(path) != text}
    write_files(folder, changed)
    return sorted([*gone, *changed])


def snapshot_patches(project: Project) -> dict:
    """``patches/`` as the guarded swap compares it (guarded_swap.py): take it before anything in it is read, so that a
    file saved there while the queue is built and checked undoes the swap instead of being overwritten. An entry
    that is no file, folder or link (a named pipe, a socket) is refused here, before any work: the new patches/
    starts as a copy of the old one, which cannot hold it."""
    snapshot = scan(project.patches_dir, prefix="patches")
    if odd := [path for path, entry in snapshot.items() if entry.kind == "other"]:
        where = project.root / odd[0]
        raise PatchsetError(f"{where} {not_a_regular_file(where) or 'is not a regular file'}; refresh and export "
                            "write patches/ as a new copy of it, which cannot hold that; nothing was written",
                            f"move {quoted(where)} out of patches/, then run the command again")
    return snapshot


def write_plan(project: Project, plan: ExportPlan, snapshot: dict, rerun: str, log: Callable[[str], None]) -> None:
    """Build the new patches/ (patches, series, overlay) beside the old one and swap it in, guarded against
    any change since ``snapshot`` (:func:`snapshot_patches`)."""
    target = project.patches_dir
    scratch = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=project.root))
    try:
        built = scratch / "patches"
        shutil.copytree(target, built, symlinks=True)
        # Another base writes its own folder only ([Note: bases] in project.py): a dropped patch leaves its series
        # (and its variant, if it has one); a changed shared patch becomes a variant; shared ones stay as they are.
        home = built / project.base_dir.relative_to(target)
        for name in plan.dropped:
            (home / name).unlink(missing_ok=True)
        for name, text in plan.texts.items():
            shared = built / name
            if (home != built and not os.path.lexists(home / name) and shared.is_file()
                    and shared.read_text(encoding="utf-8") == text):
                continue
            (home / name).write_text(text, encoding="utf-8")
        if plan.series is not None:
            (home / "series").write_text(plan.series, encoding="utf-8")
        overlay_changed = _write_overlay(built, project.pin().members, plan.overlay)
        swap_in(target, built, snapshot, lambda d: scan(d, prefix="patches"), rerun)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for name in plan.dropped:
        log(f"patchset: removed {name} (--drop)")
    if overlay_changed:
        log(f"patchset: patches/overlay/: {len(overlay_changed)} file(s) written or removed "
            f"(it holds {len(plan.overlay.files)})")


def export_queue(project: Project, repo: Path, sdist: Path | None = None, drop: tuple[str, ...] = (),
                 log: Callable[[str], None] = print) -> list[str]:
    """gbp-pq export (see the note); the caller holds the checkout lock."""
    snapshot = snapshot_patches(project)
    plan = plan_export(project, repo, drop, sdist)
    if plan.already_there:
        log(f"patchset: patches/ already holds what {repo} exports (the overlay, {len(plan.texts)} patches); "
            "nothing was written")
        return list(plan.texts)
    write_plan(project, plan, snapshot, project.command(f"export --queue {repo.absolute()}"), log)
    log(f"patchset: exported the overlay ({len(plan.overlay.files)} files) and {len(plan.texts)} patches to "
        f"{project.base_dir}")
    return list(plan.texts)
