"""Every command our tools suggest runs as printed from a checkout whose path holds a space and a
non-ASCII character: each test provokes the message, takes the command between backticks, splits
it as a shell would (shlex) and runs it, or, where running it is a training run, checks the argv it
parses to and that the paths it names are there.

The checkout is a symbolic link to this one under such a path, so that the tools see that path
(``__file__``, ``sys.argv[0]``, the working folder), not this checkout's. The commands of
``scripts/patchset`` are run by tests/unit_tests/patchset/test_advice.py in a fake checkout whose path
holds both too; the import guard's by test_real_series.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hfsdp import extras
from hfsdp.functional import golden
from hfsdp.slurm import sbatch
from hfsdp.training import entry

REPO_ROOT = Path(__file__).resolve().parents[3]
SMOKE = Path("tests/functional_tests/test_cases/smoke/cpu_gloo_smoke")
GPU_CASE = Path("tests/functional_tests/test_cases/hybrid/hybrid_mcore_local_fsdp_1gpu_eager_no_db")


def commands(message: str) -> list[list[str]]:
    """The commands quoted in ``message`` (between backticks), each split as a shell reads it."""
    return [shlex.split(c) for c in re.findall(r"`([^`]+)`", message)]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """This checkout, seen through a path with a space and a non-ASCII character."""
    link = tmp_path / "check out ö"
    link.symlink_to(REPO_ROOT, target_is_directory=True)
    return link


def env_in(checkout: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HFSDP_DEBUG", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(checkout), **extra}


def test_the_flags_fix_runs_in_the_checkout(checkout, monkeypatch):
    """A flag a training entry point refuses: `python pretrain_gpt.py --help`, run where the script is."""
    monkeypatch.setattr(sys, "argv", [str(checkout / "pretrain_gpt.py"), "--bogus"])
    [argv] = commands(entry.flags_fix())
    assert argv == ["python", "pretrain_gpt.py", "--help"]
    done = subprocess.run([sys.executable, *argv[1:]], cwd=checkout, env=env_in(checkout), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--megatron-fsdp-max-pool-double-buffer" in done.stdout


@pytest.mark.real_environment_probe
def test_the_re_record_command_of_a_broken_golden_runs_and_records_it(checkout, tmp_path):
    """A golden that cannot be read: its fix re-records it, from a case folder with a space and a
    non-ASCII character in its path. Run as printed (the CPU smoke case: two gloo ranks on CPU), in this
    machine's environment, whose golden it is."""
    from hfsdp.functional import environment, selection

    case = tmp_path / "ca sé ö" / "smoke" / "cpu_gloo_smoke"
    shutil.copytree(REPO_ROOT / SMOKE, case)
    here = environment.probe()
    broken = case / f"golden_values_{here.label()}_{selection.platform_of(here)}.json"
    broken.write_text('{"lm loss": NaN}')
    with pytest.raises(golden.GoldenError) as info:
        golden.read_golden(broken, ["lm loss"])
    [argv] = commands(info.value.fix)
    assert argv == ["python", "-m", "hfsdp.functional.run_case", str(case), "--record"]
    done = subprocess.run([sys.executable, *argv[1:]], cwd=checkout, capture_output=True, text=True, timeout=600,
                          env=env_in(checkout, HFSDP_FUNCTIONAL_OUT=str(tmp_path / "out ö")))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert golden.read_golden(broken, ["lm loss"])["lm loss"], "the golden was not recorded"


@pytest.mark.no_cuda  # the message is the one of a machine without a GPU
def test_the_cpu_case_suggested_for_a_gpu_case_is_there(checkout, tmp_path):
    """A GPU case on a machine without one: the CPU smoke case it suggests instead is a path in the
    checkout the command runs in (running it is the test above)."""
    done = subprocess.run([sys.executable, "-m", "hfsdp.functional.run_case", str(GPU_CASE)], cwd=checkout,
                          capture_output=True, text=True, timeout=300,
                          env=env_in(checkout, HFSDP_FUNCTIONAL_OUT=str(tmp_path / "out")))
    assert done.returncode == 2, done.stderr[-3000:]
    [argv] = commands(done.stderr)
    assert argv[:3] == ["python", "-m", "hfsdp.functional.run_case"] and len(argv) == 4, argv
    assert (checkout / argv[3] / "model_config.yaml").is_file(), argv


def test_an_sbatch_script_runs_from_a_checkout_with_a_space(checkout, tmp_path):
    """The job script's commands quote the checkout and the case: bash reads them back as the paths
    (checked with ``bash -n`` and by echoing the ``cd`` line's folder, not by sbatch)."""
    case = checkout / SMOKE
    spec = sbatch.JobSpec(case_dir=case, repo_root=checkout, log_dir=tmp_path / "logs", use_gpus=False)
    text = sbatch.render_sbatch(spec)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    [cd] = [line for line in text.splitlines() if line.startswith("cd ")]
    shown = subprocess.run(["bash", "-c", f"{cd} && pwd"], capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.strip() == str(checkout), shown.stderr
    assert shlex.quote(str(case)) in text


@pytest.mark.parametrize("extra", sorted(extras.EXTRAS))
def test_the_install_command_of_an_extra_is_no_glob(checkout, extra):
    """``pip install ... -e '.[te]'``, as printed, run by a shell that refuses a pattern matching nothing
    (zsh's default; bash's failglob) in the checkout, with ``pip`` a function printing its arguments: the
    brackets reach pip as they are, and ``.`` is the checkout (its setup.py)."""
    [command] = re.findall(r"`([^`]+)`", extras.install_hint(extra))
    script = f"pip() {{ printf '%s\\n' \"$@\"; }}; {command}"
    done = subprocess.run(["bash", "-O", "failglob", "-c", script], cwd=checkout, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["install", "--no-build-isolation", "-e", f".[{extra}]"], done.stdout
    assert (checkout / "setup.py").is_file()

