"""Probe table of the launcher, ``python -m hfsdp.launch`` (several ranks per GPU): each input, its
exit status and its sentence; none may end in a traceback. On a machine without a GPU the
shared mode is refused, so these rows run on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]

# (id, arguments, exit status, fragment of stderr)
ROWS = [
    ("nothing", [], 2, "the following arguments are required: --nproc"),
    ("no script", ["--nproc", "2", "--ranks-per-gpu", "2"], 2, "give -- and then the script"),
    ("ranks-per-gpu without a value", ["--ranks-per-gpu"], 2, "--ranks-per-gpu: expected one argument"),
    ("ranks-per-gpu a word", ["--nproc", "2", "--ranks-per-gpu", "abc", "--", "x.py"], 2,
     "--ranks-per-gpu: 'abc' is not a whole number"),
    ("ranks-per-gpu 0", ["--nproc", "2", "--ranks-per-gpu", "0", "--", "x.py"], 2, "--ranks-per-gpu: must be > 0"),
    ("nproc negative", ["--nproc", "-1", "--", "x.py"], 2, "--nproc: must be > 0, got -1"),
    ("nproc a float", ["--nproc", "1.5", "--", "x.py"], 2, "--nproc: '1.5' is not a whole number"),
    ("shared mode without a GPU", ["--nproc", "3", "--ranks-per-gpu", "2", "--", "x.py"], 2,
     "shares CUDA GPUs between ranks, and this machine has none"),
    ("auto without a GPU", ["--nproc", "2", "--ranks-per-gpu", "auto", "--", "x.py"], 2,
     "--ranks-per-gpu auto places ranks on CUDA GPUs, and this machine has none"),
    ("script missing", ["--nproc", "2", "--", "/nonexistent.py"], 2, "the script /nonexistent.py does not exist"),
    ("script a folder", ["--nproc", "2", "--", "hfsdp"], 2, "the script hfsdp is a folder, not a regular file"),
    ("module missing", ["--nproc", "2", "--", "-m", "no_such.module"], 2, "-m 'no_such.module' names no module"),
    ("nproc absurd", ["--nproc", "100000000", "--", "{tmp}/s ö.py"], 2,
     "100,000,000 ranks is more ranks on one host than any launch can start"),
    ("script a named pipe", ["--nproc", "1", "--", "{tmp}/pipe"], 2, "pipe is a named pipe, not a regular file"),
    ("script /dev/null", ["--nproc", "1", "--", "/dev/null"], 2, "/dev/null is a character device"),
    ("script a link to nothing", ["--nproc", "1", "--", "{tmp}/broken"], 2, "broken is a symbolic link to nothing"),
    ("HFSDP_STACK_DUMP_AFTER_S junk", ["ENV:HFSDP_STACK_DUMP_AFTER_S=nan", "--nproc", "1", "--", "{tmp}/s ö.py"], 2,
     "HFSDP_STACK_DUMP_AFTER_S='nan': must be >= 0"),
    ("script path with a space and non-ASCII", ["--nproc", "1", "--", "{tmp}/s ö.py"], 0, ""),
]


@pytest.mark.no_cuda  # the rows describe a machine without a GPU
@pytest.mark.parametrize(("args", "rc", "says"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_probe(args, rc, says, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HFSDP_DEBUG", "HFSDP_STACK_DUMP_AFTER_S")}
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    (tmp_path / "s ö.py").write_text("import os\nassert os.environ['RANK'] == '0'\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    while args and args[0].startswith("ENV:"):
        key, value = args.pop(0)[4:].split("=", 1)
        env[key] = value
    proc = subprocess.run([sys.executable, "-m", "hfsdp.launch", *args], cwd=REPO_ROOT, env=env, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == rc, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_failing_rank_ends_the_launch_with_one_line_and_torchruns_status(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    env = {k: v for k, v in os.environ.items() if k != "HFSDP_DEBUG"}
    proc = subprocess.run([sys.executable, "-m", "hfsdp.launch", "--nproc", "2", "--", str(script)], cwd=REPO_ROOT,
                          env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hfsdp.launch: the launch of {script} failed (torchrun exited with 1)"), proc.stderr
