"""The README's commands run as written in the environment it describes.

The README says once, in its set-up, how to enter the environment the two set-up commands make
(``. .venv/bin/activate``); every command after that is typed in it, from the checkout. This test
reads the README's fenced shell blocks and, in that environment (this interpreter's ``bin/`` first on
PATH, as activating does; no PYTHONPATH), runs the cheap ones exactly as written: the fork's flag
list, the memory planner on the default model, the ``$(python -c ...)`` that gives the model's flags.
Every entry point a command starts is run with ``--help``. Every other command (GPU runs, Slurm,
installs) must at least name programs, scripts, modules and paths that exist.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
ACTIVATE = ". .venv/bin/activate"
# Run exactly as written: cheap on a CPU machine (the planner's default model takes seconds to a minute).
RUN_AS_WRITTEN = ("python -m hfsdp.flags", "python scripts/fsdp_memory_planner.py --plan-dp-size 8")
# What a command may start with besides our scripts: the environment's programs and the shell's.
PROGRAMS = {"python", "torchrun", "pip", "bash", "export", "."}
# Repo paths a command names (outputs the command makes, like out/ or wheelhouse/, are not checked).
REPO_PATH = re.compile(r"^(scripts|tests|hfsdp|patches|docs)/|\.(py|sh)$|^pretrain_\w+\.py$")
INLINE = re.compile(r"`([^`\n]+)`")
SUBSTITUTION = re.compile(r"\$\((python -c '[^']*')\)")  # $(python -c '...'): a command's output as its words


def fenced_commands(text: str) -> list[str]:
    """The commands of the README's ``bash`` blocks, one per line, comments dropped, ``&&`` chains split."""
    commands, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside:
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.extend(part.strip() for part in line.split(" && "))
    return commands


def readme_env() -> dict[str, str]:
    """The environment the README's commands run in: the set-up's environment entered (its bin/ first
    on PATH, VIRTUAL_ENV set, as ``. .venv/bin/activate`` does), nothing else of ours."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "HFSDP_DEBUG")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = sys.prefix
    return env


def run(command: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=readme_env(), capture_output=True, text=True,
                          timeout=timeout)


COMMANDS = fenced_commands(README.read_text())


def entry_point(command: str) -> list[str] | None:
    """The script or module a ``python``/``torchrun`` command starts (``-m X`` or ``X.py``), else None."""
    words = shlex.split(SUBSTITUTION.sub("", command))
    if words[0] not in ("python", "torchrun"):
        return None
    for i, word in enumerate(words[1:], 1):
        if word == "-m":
            return ["-m", words[i + 1]]
        if word.endswith(".py"):
            return [word]
    return None


def test_the_readme_says_once_and_early_how_to_enter_the_environment():
    text = README.read_text()
    setup = text[text.index("## Set-up"):text.index("\n## ", text.index("## Set-up") + 1)]
    assert f"`{ACTIVATE}`" in setup and "`.venv/bin/python`" in setup
    assert text.index(ACTIVATE) < text.index("## Running")
    assert COMMANDS[:2] == ["bash scripts/run_main.sh", "bash scripts/run_tests.sh"]  # the set-up's two commands


def test_the_environment_is_this_checkout_s():
    """The commands below run from the checkout with this interpreter, which is the set-up's kind of environment."""
    assert shutil.which("python", path=readme_env()["PATH"]) == str(Path(sys.executable).parent / "python")
    assert importlib.util.find_spec("torch") is not None


@pytest.mark.parametrize("command", RUN_AS_WRITTEN)
def test_a_cheap_command_runs_as_written(command):
    assert command in COMMANDS, f"the README no longer shows `{command}`"
    proc = run(command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()


def test_the_model_flags_substitution_runs():
    substitutions = {s for c in COMMANDS for s in SUBSTITUTION.findall(c)}
    assert substitutions
    for command in substitutions:
        proc = run(command)
        assert proc.returncode == 0 and "--hybrid-layer-pattern" in proc.stdout, proc.stderr[-3000:]


ENTRY_POINTS = sorted({" ".join(e) for c in COMMANDS if (e := entry_point(c))})


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_a_command_starts_answers_help(entry):
    proc = run(f"python {entry} --help")
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-3000:]


def named_paths(command: str) -> list[str]:
    """The repo paths and modules a command names: its script arguments and ``-m`` modules."""
    words = shlex.split(SUBSTITUTION.sub("", command).replace("[", " ").replace("]", " "))
    return [w for w in words if REPO_PATH.search(w) and not w.startswith(("-", "$"))]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_names_what_exists(command):
    words = shlex.split(SUBSTITUTION.sub("", command))
    first = next(w for w in words if "=" not in w or w.startswith("-"))  # past VAR=value assignments
    assert first in PROGRAMS or (REPO / first).is_file(), f"`{command}` starts with {first!r}"
    if first in ("python", "torchrun", "pip"):
        assert shutil.which(first, path=readme_env()["PATH"]), f"the environment has no {first}"
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[0] in ("python", "torchrun"):
            assert importlib.util.find_spec(words[i + 1]) is not None, f"`{command}`: no module {words[i + 1]}"
    for path in named_paths(command):
        assert glob.glob(str(REPO / path)), f"`{command}` names {path}, which the checkout lacks"


def test_every_script_the_prose_names_exists():
    """Inline commands in the README's prose and tables (``bash X``, ``python X``, ``tests/gpu/X.sh``) name
    scripts and modules that exist."""
    missing = []
    for span in INLINE.findall(README.read_text()):
        for command in span.split("; "):
            for path in named_paths(command.replace("<script>", "run_functional.sh")):
                if not glob.glob(str(REPO / path)) and "/" in path:
                    missing.append(path)
            if (m := re.search(r"python -m ([\w.]+)", command)) and importlib.util.find_spec(m.group(1)) is None:
                missing.append(m.group(1))
    assert not missing, missing


def test_the_extraction_finds_what_it_is_for():
    text = "x\n```bash\n# c\npython -m a.b --x 1   # what\nbash s.sh && python t.py\n```\n```\nnot bash\n```\n"
    assert fenced_commands(text) == ["python -m a.b --x 1", "bash s.sh", "python t.py"]
    command = "torchrun --nproc-per-node 2 pretrain_hybrid.py $(python -c 'print(\" \".join(f))') --y"
    assert entry_point(command) == ["pretrain_hybrid.py"]
    assert SUBSTITUTION.findall(command) == ["python -c 'print(\" \".join(f))'"]
    assert named_paths("python -m hfsdp.x tests/a/* --out out/b.json [flags ...]") == ["tests/a/*"]
