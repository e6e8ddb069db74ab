"""Thin wrappers around git, the patch engine (apply, queue commits, diffs).

Commits are made with a fixed identity and date so that a queue built twice from the same
inputs has the same hashes, and exported diffs are byte-identical.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import PatchDoesNotApply, PatchsetError, ToolMissing
from .series import crlf_line

_FIXED_DATE = "2000-01-01T00:00:00+0000"
_ENV = {
    "GIT_AUTHOR_NAME": "patchset",
    "GIT_AUTHOR_EMAIL": "patchset@localhost",
    "GIT_COMMITTER_NAME": "patchset",
    "GIT_COMMITTER_EMAIL": "patchset@localhost",
    "GIT_AUTHOR_DATE": _FIXED_DATE,
    "GIT_COMMITTER_DATE": _FIXED_DATE,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_TERMINAL_PROMPT": "0",
    "LC_ALL": "C",
}
# What `git rev-parse --local-env-vars` lists: variables that point git at another repository, object store,
# index or config. One set in the caller's environment (a git hook's GIT_DIR, a GIT_OBJECT_DIRECTORY) would
# make the throw-away repositories write elsewhere or read the user's config, so none reaches git.
_REPOSITORY_LOCAL = frozenset({
    "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_CONFIG", "GIT_CONFIG_PARAMETERS", "GIT_CONFIG_COUNT",
    "GIT_OBJECT_DIRECTORY", "GIT_DIR", "GIT_WORK_TREE", "GIT_IMPLICIT_WORK_TREE", "GIT_GRAFT_FILE", "GIT_INDEX_FILE",
    "GIT_NO_REPLACE_OBJECTS", "GIT_REPLACE_REF_BASE", "GIT_PREFIX", "GIT_INTERNAL_SUPER_PREFIX", "GIT_SHALLOW_FILE",
    "GIT_COMMON_DIR",
})
# Options that keep diffs stable whatever the user's git config says.
_DIFF_OPTS = [
    "-c", "core.quotepath=off", "-c", "diff.noprefix=false", "-c", "diff.mnemonicprefix=false",
    "-c", "diff.renames=false", "-c", "diff.algorithm=myers", "-c", "core.autocrlf=false",
]
_FAILED_FILE = re.compile(
    r"^error: (?:patch failed: (?P<a>[^:\n]+):\d+|(?P<b>[^:\n]+): (?:patch does not apply|No such file or directory"
    r"|already exists in (?:working directory|index)|does not exist in index|does not match index))$",
    re.MULTILINE,
)


def _git_env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The neutral environment every git call runs in (git must be installed)."""
    if shutil.which("git") is None:
        raise ToolMissing("git is not installed", "install git (apt-get install git); it applies the patch series")
    env = {key: value for key, value in os.environ.items() if key not in _REPOSITORY_LOCAL}
    return {**env, **_ENV, **(extra_env or {})}


def git(args: list[str], cwd: Path, check: bool = True, input_text: str | None = None,
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run git with a neutral environment; raise PatchsetError with git's words on failure."""
    env = _git_env(extra_env)
    proc = subprocess.run(
        ["git", *_DIFF_OPTS, *args], cwd=cwd, env=env, text=True, capture_output=True, input=input_text
    )
    if check and proc.returncode != 0:
        raise PatchsetError(f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip()}",
                            "git's own message above says why; if the folder is not a queue made by "
                            "`scripts/patchset queue`, make one")
    return proc


def init_repo(path: Path) -> None:
    """Create an isolated repository for a queue (no hooks, no user config)."""
    git(["init", "-q", "-b", "queue", str(path)], cwd=path.parent)
    git(["config", "commit.gpgsign", "false"], cwd=path)
    git(["config", "core.hooksPath", "/dev/null"], cwd=path)


def commit_all(path: Path, message: str) -> str:
    """Stage everything and commit; return the commit id."""
    git(["add", "-A", "."], cwd=path)
    git(["commit", "-q", "--allow-empty", "--no-verify", "-F", "-"], cwd=path, input_text=message)
    return git(["rev-parse", "HEAD"], cwd=path).stdout.strip()


def apply_patch(repo: Path, name: str, diff: str, reverse: bool = False, check_only: bool = False) -> None:
    """Apply (or check) one diff with no fuzz: context must match exactly (offsets allowed)."""
    args = ["apply", "--index", "--whitespace=nowarn", "-C3"]
    if reverse:
        args.append("--reverse")
    if check_only:
        args.append("--check")
    proc = git([*args, "-"], cwd=repo, check=False, input_text=diff)
    if proc.returncode != 0:
        files = sorted({m["a"] or m["b"] for m in _FAILED_FILE.finditer(proc.stderr)})
        raise PatchDoesNotApply(name, files, proc.stderr, line_endings=crlf_line(diff) is not None)


def apply_with_rejects(repo: Path, diff: str) -> str:
    """Apply the hunks of ``diff`` that fit; the others go to ``<file>.rej``. Returns git's report."""
    proc = git(["apply", "--reject", "--whitespace=nowarn", "-C3", "-"], cwd=repo, check=False, input_text=diff)
    return proc.stderr


def is_clean(repo: Path, untracked: bool = True) -> bool:
    """No uncommitted change (``untracked``: untracked files count as changes)."""
    return not git(["status", "--porcelain", f"--untracked-files={'normal' if untracked else 'no'}"],
                   cwd=repo).stdout.strip()


def diff_commits(repo: Path, old: str, new: str) -> str:
    """Deterministic full-index diff between two commits."""
    return git(
        ["diff", "--no-color", "--no-ext-diff", "--no-renames", "--full-index", "-U3",
         "--src-prefix=a/", "--dst-prefix=b/", old, new],
        cwd=repo,
    ).stdout


def rev_list(repo: Path, base: str, head: str = "HEAD") -> list[str]:
    """Commits in (base, head], oldest first."""
    out = git(["rev-list", "--reverse", f"{base}..{head}"], cwd=repo).stdout
    return [line for line in out.splitlines() if line]


def message(repo: Path, commit: str) -> str:
    return git(["log", "-1", "--format=%B", commit], cwd=repo).stdout


def tree_of(repo: Path, rev: str) -> str:
    return git(["rev-parse", f"{rev}^{{tree}}"], cwd=repo).stdout.strip()


def tree_after(repo: Path, rev: str, diff: str) -> str | None:
    """The tree ``diff`` makes of ``rev``'s (``git apply``, exact context, in a scratch index: the repository's
    own index and work tree are not touched), or None where it does not apply."""
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(["read-tree", rev], cwd=repo, extra_env=env)
        text = diff if diff.endswith("\n") else diff + "\n"
        if git(["apply", "--cached", "-"], cwd=repo, input_text=text, extra_env=env, check=False).returncode != 0:
            return None
        return git(["write-tree"], cwd=repo, extra_env=env).stdout.strip()


def name_status(repo: Path, old: str, new: str) -> list[tuple[str, str]]:
    """(status letter, path) of each file that differs between two commits: A added, M modified, D deleted,
    T type changed (no renames; paths exactly as stored, whatever characters they hold)."""
    out = git(["diff", "--name-status", "--no-renames", "-z", old, new], cwd=repo).stdout
    fields = out.split("\0")
    return [(fields[i][:1], fields[i + 1]) for i in range(0, len(fields) - 1, 2)]


def blob(repo: Path, rev: str, path: str) -> bytes:
    """The bytes of ``path`` at commit ``rev``."""
    proc = subprocess.run(["git", "cat-file", "blob", f"{rev}:{path}"], cwd=repo, env=_git_env(), capture_output=True)
    if proc.returncode != 0:
        raise PatchsetError(f"git cat-file blob {rev}:{path} failed in {repo}: "
                            f"{proc.stderr.decode('utf-8', 'replace').strip()}",
                            "git's own message above says why; if the folder is not a queue made by "
                            "`scripts/patchset queue`, make one")
    return proc.stdout
