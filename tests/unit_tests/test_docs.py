"""The docs stay references: feature pages fit one read and carry no dates or commit hashes (those
live in docs/results.md and CHANGELOG.md), the README's two set-up commands come early, and every
local link points at a file the repo has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
JOURNALS = {"results.md"}  # measurements, each with its date and commit
FEATURE_PAGES = sorted(p for p in DOCS.glob("*.md") if p.name not in JOURNALS)
MAX_PAGE_LINES = 200
MAX_COMMAND_LINE = 40
# A generated block (a table a tool writes between <!-- NAME:start --> and <!-- NAME:end -->) is reference data,
# not prose a newcomer reads through: it does not count towards the line limits.
GENERATED = re.compile(r"<!-- ([\w-]+):start -->\n.*?<!-- \1:end -->\n", re.S)


def prose_lines(text: str) -> int:
    return GENERATED.sub("", text).count("\n")

DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# A commit hash as written in prose: 7 to 40 hex digits, with a digit and a letter, standing alone.
COMMIT = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_there_are_feature_pages() -> None:
    assert len(FEATURE_PAGES) >= 5, [p.name for p in FEATURE_PAGES]


@pytest.mark.parametrize("page", FEATURE_PAGES, ids=[p.name for p in FEATURE_PAGES])
def test_a_feature_page_is_a_reference(page: Path) -> None:
    text = page.read_text()
    lines = prose_lines(text)
    assert lines <= MAX_PAGE_LINES, f"{page.name} has {lines} lines (at most {MAX_PAGE_LINES})"
    assert not DATE.findall(text), f"{page.name} has dates {DATE.findall(text)}: measurements go to results.md"
    assert not COMMIT.findall(text), f"{page.name} names commits {COMMIT.findall(text)}: they go to results.md"


MAX_DOCS_LINES = 2200  # README.md and docs/*.md together: what a newcomer reads


def test_the_readme_fits_a_page_and_all_docs_one_read() -> None:
    readme = (REPO / "README.md").read_text().count("\n")
    assert readme <= MAX_PAGE_LINES, f"README.md has {readme} lines (at most {MAX_PAGE_LINES})"
    pages = {p.name: prose_lines(p.read_text()) for p in [REPO / "README.md", *DOCS.glob("*.md")]}
    assert sum(pages.values()) <= MAX_DOCS_LINES, f"the docs have {sum(pages.values())} lines: {pages}"


def test_the_readme_gives_its_two_commands_early() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    where = {cmd: next((i + 1 for i, line in enumerate(lines) if line.startswith(f"bash scripts/{cmd}")), None)
             for cmd in ("run_main.sh", "run_tests.sh")}
    assert all(n is not None and n <= MAX_COMMAND_LINE for n in where.values()), where


@pytest.mark.parametrize("page", [REPO / "README.md", REPO / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))],
                         ids=lambda p: p.name)
def test_local_links_point_at_files_the_repo_has(page: Path) -> None:
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or a heading of the same page
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.name} links to files the repo lacks: {missing}"


def slug(heading: str) -> str:
    """The anchor a heading gets on GitHub: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of the headings of ``page`` (outside code blocks)."""
    found, code = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            code = not code
        elif not code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


@pytest.mark.parametrize("page", [REPO / "README.md", REPO / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))],
                         ids=lambda p: p.name)
def test_links_to_a_heading_find_it(page: Path) -> None:
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or "#" not in target:
            continue
        name, anchor = target.split("#", 1)
        linked = (page.parent / name).resolve() if name else page
        if linked.suffix == ".md" and linked.is_file() and anchor not in anchors(linked):
            missing.append(target)
    assert not missing, f"{page.name} links to headings that do not exist: {missing}"


def test_the_patterns_catch_what_they_are_for() -> None:
    assert DATE.findall("measured on 2026-11-24 on an H100") == ["2026-11-24"]
    assert COMMIT.findall("at cf5c87a and (b794119)") == ["cf5c87a", "b794119"]
    assert not COMMIT.findall("2000000 steps, deadbeef, results/cf5c87a.json, dgx_h100_shared")


# A measurement as the docs write one: a number with a unit of time, memory, speed or ratio.
MEASUREMENT = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s|GiB|MiB|GB|TFLOP/s|%|x)(?![\w/])")
MAX_UNRELEASED_LINES = 80


def unreleased(changelog: str) -> str:
    """The ``[Unreleased]`` section of the CHANGELOG, heading excluded."""
    start = changelog.index("## [Unreleased]")
    end = changelog.find("\n## [", start + 1)
    return changelog[start:end if end != -1 else None].split("\n", 1)[1]


def test_unreleased_is_short() -> None:
    section = unreleased((REPO / "CHANGELOG.md").read_text())
    assert section.count("\n") <= MAX_UNRELEASED_LINES, f"[Unreleased] has {section.count(chr(10))} lines"


def test_the_changelog_holds_no_measurements() -> None:
    """Users read what changed, in every section, released or not; measurements, with date, commit
    and machine, are in results.md."""
    text = (REPO / "CHANGELOG.md").read_text()
    found = [(n, m) for n, line in enumerate(text.splitlines(), 1) for m in MEASUREMENT.findall(line)]
    assert not found, f"CHANGELOG.md (line, measurement): {found}"


def test_the_measurement_pattern_catches_what_it_is_for() -> None:
    found = MEASUREMENT.findall("59.8 ms, 0.99x, 26 %, 43.3 GiB, 989 TFLOP/s; EP=4, DP=2, schema 4, 30 s")
    assert found == ["59.8 ms", "0.99x", "26 %", "43.3 GiB", "989 TFLOP/s", "30 s"]


MAX_LINE = 120


def long_prose_lines(text: str) -> list[int]:
    """Numbers of the lines over :data:`MAX_LINE` characters outside tables and code (fenced, or
    indented four spaces)."""
    found, code = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            code = not code
        elif not (code or line.startswith(("|", "    "))) and len(line) > MAX_LINE:
            found.append(number)
    return found


@pytest.mark.parametrize("page", [REPO / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_prose_lines_fit_a_screen(page: Path) -> None:
    assert not long_prose_lines(page.read_text()), f"{page.name}: lines {long_prose_lines(page.read_text())}"


MAX_RESULTS_LINES = 300
RESULTS = DOCS / "results.md"


def test_results_hold_the_current_figures_only() -> None:
    """results.md keeps the current run of each thing measured; every file under docs/results/ is
    one of its figures' files, linked from it, and every file it links exists."""
    text = RESULTS.read_text()
    assert text.count("\n") <= MAX_RESULTS_LINES, f"results.md has {text.count(chr(10))} lines"
    linked = {(DOCS / t.split("#", 1)[0]).resolve() for t in LINK.findall(text)
              if t.startswith("results/") and not t.endswith("/")}
    files = {p.resolve() for p in (DOCS / "results").rglob("*") if p.is_file()}
    assert not linked - files, f"results.md links to missing files: {sorted(map(str, linked - files))}"
    assert not files - linked, f"files under docs/results/ no figure cites: {sorted(p.name for p in files - linked)}"


def test_long_lines_are_found_outside_tables_and_code_only() -> None:
    text = "\n".join(["x" * 121, "| " + "x" * 130, "  ```", "y" * 140, "  ```", "    " + "z" * 130, "ok"])
    assert long_prose_lines(text) == [1]
