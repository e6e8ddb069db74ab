"""``lint --chains``: a patch that changes lines an earlier patch of the same series added.

[Note: rewrite chains] Each patch is one logical change to upstream files. When a later patch removes
or rewrites a line that an earlier patch added, the two are one change told twice: a reviewer reads
the first version in one patch and its correction in another, and a rebase resolves the same lines
twice. Such a pair is a rewrite chain; the way out is to fold the later change into the earlier patch
(in a queue: ``git commit --fixup`` onto the earlier commit, ``git rebase -i --autosquash``, then
``export``).

How it is found: the series is built as a queue ([Note: the queue] in tree.py); for each patch
commit, the lines its diff removes (``git diff -U0`` against the previous commit; a rewrite is a
removal and an addition) are blamed in the previous commit. A removed line that an earlier patch
commit introduced is a chain; lines of the base (upstream) are not, nor are lines the patch only adds
next to an earlier patch's lines. Blank lines are not counted: where an addition puts a blank line,
the diff may credit an earlier one. Lines of the overlay commit are not counted here either (``lint``
already refuses a patch that touches an overlay file).

``lint`` runs this only with ``--chains`` while the series still has chains to fold; it is an error
there like any other lint problem.
"""

from __future__ import annotations

import re
import tempfile
from collections import defaultdict
from pathlib import Path

from . import gitops
from .overlay import Overlay
from .pin import BasePin
from .series import Patch
from .tree import build_queue

_DIFF_FILE = re.compile(r"^diff --git a/(?P<path>\S+) b/\S+$")
_HUNK = re.compile(r"^@@ -(?P<start>\d+)(?:,(?P<count>\d+))? \+\d+(?:,\d+)? @@")
_BLAME_LINE = re.compile(r"^(?P<commit>[0-9a-f]{40}) \d+ (?P<line>\d+)")
SHOWN_LINES = 3  # lines named per pair of patches; the rest are counted


def removed_lines(repo: Path, old: str, new: str) -> dict[str, list[tuple[int, int]]]:
    """Per file changed from ``old`` to ``new``: the (start, count) ranges of ``old``'s lines that ``new``
    removes (a rewritten line is removed, then added)."""
    diff = gitops.git(["diff", "--no-color", "--no-ext-diff", "--no-renames", "-U0", old, new], cwd=repo).stdout
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    path = ""
    for line in diff.splitlines():
        if (m := _DIFF_FILE.match(line)) is not None:
            path = m["path"]
        elif (h := _HUNK.match(line)) is not None and path:
            count = 1 if h["count"] is None else int(h["count"])
            if count:
                out[path].append((int(h["start"]), count))
    return dict(out)


def blame(repo: Path, commit: str, path: str, ranges: list[tuple[int, int]]) -> list[tuple[int, str, str]]:
    """(line number, commit that introduced it, text) of each line of ``path`` at ``commit`` in ``ranges``."""
    spans = [arg for start, count in ranges for arg in ("-L", f"{start},+{count}")]
    out = gitops.git(["blame", "--line-porcelain", *spans, commit, "--", path], cwd=repo).stdout
    lines: list[tuple[int, str, str]] = []
    current: tuple[int, str] | None = None
    for line in out.splitlines():
        if (m := _BLAME_LINE.match(line)) is not None:
            current = (int(m["line"]), m["commit"])
        elif line.startswith("\t") and current is not None:
            lines.append((current[0], current[1], line[1:]))
            current = None
    return lines


def rewrite_chains(pin: BasePin, sdist: Path, patches: list[Patch], overlay: Overlay) -> list[tuple[str, str]]:
    """(later patch, sentence) for each pair of patches where the later rewrites lines the earlier added (see
    the note), in series order. Builds the series in a queue in the system's temporary folder."""
    found: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="patchset-") as tmp:
        queue = build_queue(pin, sdist, patches, Path(tmp) / "queue", overlay)
        owner = {commit: name for name, commit in queue.commits}
        parent = queue.overlay
        for name, commit in queue.commits:
            pairs: dict[str, list[str]] = defaultdict(list)  # earlier patch -> "path:line: text"
            for path, ranges in removed_lines(queue.repo, parent, commit).items():
                for number, source, text in blame(queue.repo, parent, path, ranges):
                    if source in owner and text.strip():
                        shown = text.strip() if len(text.strip()) <= 60 else text.strip()[:57] + "..."
                        pairs[owner[source]].append(f"{path}:{number}: {shown!r}")
            for earlier, lines in pairs.items():
                more = f" and {len(lines) - SHOWN_LINES} more" if len(lines) > SHOWN_LINES else ""
                found.append((name, f"rewrites {len(lines)} line(s) that the earlier {earlier} added "
                                    f"({'; '.join(lines[:SHOWN_LINES])}{more}): a rewrite chain; fold this change "
                                    f"into {earlier} (in a queue: `git commit --fixup` onto its commit, "
                                    "`git rebase -i --autosquash`, then export)"))
            parent = commit
    return found
