"""What a new user tries on the functional driver, as a table: each row is an input, the exit
status it must end with, and a fragment of the one sentence it must print; no row may end in a
traceback. (Interrupts have their own tests: test_interrupts.py.)"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
CASES = REPO_ROOT / "tests/functional_tests/test_cases"
SMOKE = str(CASES / "smoke/cpu_gloo_smoke")  # NPROC 2, runs on CPU
GPU_CASE = str(CASES / "hybrid/hybrid_mcore_local_fsdp_1gpu_eager_no_db")
RUN_CASE = ["-m", "hfsdp.functional.run_case"]
BATCH = ["-m", "hfsdp.functional.batch"]

# Recipes written under {tmp}/<name>/model_config.yaml.
RECIPES = {
    "list": "- a\n",
    "bad_yaml": "MODEL_ARGS: {a: [1\n",
    "duplicate": "MODEL_ARGS: {--train-iters: 2}\nMODEL_ARGS: {--train-iters: 3}\n",
    "nproc_word": "NPROC: two\nMODEL_ARGS: {--train-iters: 2}\n",
    "nproc_huge": "NPROC: 100000000000\nMODEL_ARGS: {--train-iters: 2}\n",
    "metrics_string": "METRICS: lm loss\nMODEL_ARGS: {--train-iters: 2}\n",
    "no_args": "TEST_TYPE: regular\n",
    "script_missing": "TRAINING_SCRIPT: no_such_script.py\nMODEL_ARGS: {--train-iters: 2}\n",
    "bad_regex": "CHECKS: {log_absent: ['(']}\nMODEL_ARGS: {--train-iters: 2}\n",
    "rtol_word": "TEST_TYPE: ckpt-resume\nRESUME_COMPARE: {exact_steps: 1, rtol: abc}\n"
                 "MODEL_ARGS: {--train-iters: 2}\n",
    "env_list": "ENV_VARS: [A]\nMODEL_ARGS: {--train-iters: 2}\n",
    "yaml_tag": "MODEL_ARGS: !!python/object:os.system {}\n",
    "metrics_typo": "METRICS: [lm_loss]\nMODEL_ARGS: {--train-iters: 2}\n",
}

# (id, argv, exit status, fragment of the output, runs only without CUDA)
ROWS = [
    ("no case", [*RUN_CASE], 2, "the following arguments are required: case_dir", False),
    ("missing case folder", [*RUN_CASE, "{tmp}/nowhere"], 2, "is not a test case", False),
    ("empty folder", [*RUN_CASE, "{tmp}/empty"], 2, "model_config.yaml does not exist", False),
    ("the recipe file itself", [*RUN_CASE, f"{SMOKE}/model_config.yaml"], 2, "is the recipe file", False),
    ("a folder of cases", [*RUN_CASE, str(CASES)], 2, "is not a test case but holds", False),
    ("a file", [*RUN_CASE, str(REPO_ROOT / "README.md")], 2, "is a file, not a test case folder", False),
    ("recipe folder named like the file", [*RUN_CASE, "{tmp}/recipe_folder"], 2, "is a folder, not a regular file",
     False),
    ("recipe is a list", [*RUN_CASE, "{tmp}/list"], 2, "must be a mapping of keys", False),
    ("recipe is bad YAML", [*RUN_CASE, "{tmp}/bad_yaml"], 2, "is not valid YAML (line 2, column 1)", False),
    ("recipe key twice", [*RUN_CASE, "{tmp}/duplicate"], 2, "key 'MODEL_ARGS' is given twice", False),
    ("NPROC a word", [*RUN_CASE, "{tmp}/nproc_word"], 2, "NPROC must be an integer >= 1, got 'two'", False),
    ("NPROC absurd", [*RUN_CASE, "{tmp}/nproc_huge"], 2, "more ranks on one node than any launch", False),
    ("METRICS a string", [*RUN_CASE, "{tmp}/metrics_string"], 2, "METRICS must be a list", False),
    ("no MODEL_ARGS", [*RUN_CASE, "{tmp}/no_args"], 2, "MODEL_ARGS is missing", False),
    ("TRAINING_SCRIPT missing", [*RUN_CASE, "{tmp}/script_missing"], 2, "no_such_script.py does not exist", False),
    ("CHECKS bad regex", [*RUN_CASE, "{tmp}/bad_regex"], 2, "is not a valid regular expression", False),
    ("rtol a word", [*RUN_CASE, "{tmp}/rtol_word"], 2, "rtol must be a number in [0, 1e-3], got 'abc'", False),
    ("ENV_VARS a list", [*RUN_CASE, "{tmp}/env_list"], 2, "ENV_VARS must be a mapping", False),
    ("YAML python tag", [*RUN_CASE, "{tmp}/yaml_tag"], 2, "could not determine a constructor", False),
    ("--evaluate-log a folder", [*RUN_CASE, SMOKE, "--evaluate-log", "{tmp}", "--output-dir", "{tmp}/out"], 2,
     "is a folder, not a log file", False),
    ("--evaluate-log missing", [*RUN_CASE, SMOKE, "--evaluate-log", "{tmp}/no.log", "--output-dir", "{tmp}/out"],
     2, "no.log does not exist", False),
    ("--evaluate-log a named pipe", [*RUN_CASE, SMOKE, "--evaluate-log", "{tmp}/pipe", "--output-dir", "{tmp}/out"],
     2, "pipe is a named pipe, not a regular file", False),
    ("--evaluate-log /dev/null", [*RUN_CASE, SMOKE, "--evaluate-log", "/dev/null", "--output-dir", "{tmp}/out"],
     2, "/dev/null is a character device, not a regular file", False),
    ("--evaluate-log a link to nothing", [*RUN_CASE, SMOKE, "--evaluate-log", "{tmp}/broken", "--output-dir",
                                          "{tmp}/out"], 2, "broken is a symbolic link to nothing", False),
    ("recipe a named pipe", [*RUN_CASE, "{tmp}/pipe_case"], 2, "is a named pipe, not a regular file, so", False),
    ("recipe a link to /dev/zero", [*RUN_CASE, "{tmp}/device_case"], 2, "is a character device, not a regular", False),
    ("case path with a space and non-ASCII", [*RUN_CASE, "{tmp}/ca sé/bad_yaml"], 2, "is not valid YAML", False),
    ("HFSDP_STACK_DUMP_AFTER_S a word", [*RUN_CASE, SMOKE, "--output-dir", "{tmp}/out", "--env",
                                         "HFSDP_STACK_DUMP_AFTER_S=soon"], 2,
     "HFSDP_STACK_DUMP_AFTER_S='soon': 'soon' is not a number", False),
    ("HFSDP_ITER_TIME_MAX_RATIO nan", ["ENV:HFSDP_ITER_TIME_MAX_RATIO=nan", *RUN_CASE, SMOKE, "--output-dir",
                                       "{tmp}/out"], 2, "HFSDP_ITER_TIME_MAX_RATIO='nan' is not a number >= 1", False),
    ("HFSDP_FUNCTIONAL_OUT a named pipe", ["ENV:HFSDP_FUNCTIONAL_OUT={tmp}/pipe", *RUN_CASE, SMOKE], 2,
     "pipe, which is a file", False),
    ("MASTER_PORT a word", ["ENV:MASTER_PORT=abc", *RUN_CASE, SMOKE, "--output-dir", "{tmp}/out"], 2,
     "MASTER_PORT='abc' is not a TCP port", False),
    ("--ranks-per-gpu 0", [*RUN_CASE, SMOKE, "--ranks-per-gpu", "0"], 2, "--ranks-per-gpu: must be > 0, got 0",
     False),
    ("--ranks-per-gpu -1", [*RUN_CASE, SMOKE, "--ranks-per-gpu", "-1"], 2, "must be > 0, got -1", False),
    ("--ranks-per-gpu abc", [*RUN_CASE, SMOKE, "--ranks-per-gpu", "abc"], 2, "'abc' is not a whole number", False),
    ("--ranks-per-gpu auto", [*RUN_CASE, SMOKE, "--ranks-per-gpu", "auto"], 2,
     "'auto' is taken only by `python -m hfsdp.launch`", False),
    ("more ranks per GPU than NPROC", [*RUN_CASE, SMOKE, "--ranks-per-gpu", "4"], 2,
     "--ranks-per-gpu 4 is more than the 2 ranks of this launch", False),
    ("several ranks per GPU without one", [*RUN_CASE, SMOKE, "--ranks-per-gpu", "2"], 2,
     "shares CUDA GPUs between ranks, and this machine has none", True),
    ("--nproc 0", [*RUN_CASE, SMOKE, "--nproc", "0"], 2, "--nproc: must be > 0, got 0", False),
    ("--output-dir a file", [*RUN_CASE, SMOKE, "--output-dir", str(REPO_ROOT / "README.md")], 2,
     "README.md is a file", False),
    ("--output-dir the case", [*RUN_CASE, SMOKE, "--output-dir", SMOKE], 2, "is the test case", False),
    ("--compare-to nowhere", [*RUN_CASE, SMOKE, "--compare-to", "{tmp}/empty", "--output-dir", "{tmp}/out"], 2,
     "--compare-to: ", False),
    ("--env without =", [*RUN_CASE, SMOKE, "--env", "FOO"], 2, "is not KEY=VALUE", False),
    ("GPU case without a GPU", [*RUN_CASE, GPU_CASE, "--output-dir", "{tmp}/out"], 2,
     "which needs CUDA GPUs, and its ranks would see none here", True),
    ("METRICS a misspelt name", [*RUN_CASE, "{tmp}/metrics_typo"], 2,
     "METRICS names 'lm_loss' (did you mean 'lm loss'?), which is no metric name", False),
    ("output folder's lock a named pipe", [*RUN_CASE, SMOKE, "--output-dir", "{tmp}/lockpipe"], 2,
     ".cpu_gloo_smoke.lock is a named pipe, not a regular file; the driver locks a file of its own", False),
    ("batch: no cases", [*BATCH], 2, "the following arguments are required: cases", False),
    ("batch: missing case", [*BATCH, "{tmp}/nowhere"], 2, "is not a test case", False),
    ("batch: bad recipe among good", [*BATCH, SMOKE, "{tmp}/bad_yaml"], 2, "is not valid YAML", False),
    ("batch: --summary a folder", [*BATCH, SMOKE, "--summary", "{tmp}"], 2, "is a folder, not a file", False),
    ("batch: --jobs 2 and one CUDA_VISIBLE_DEVICES", [*BATCH, SMOKE, "--jobs", "2", "--env", "CUDA_VISIBLE_DEVICES=0"],
     2, "would give every case the same ones", False),
    ("batch: --jobs 0", [*BATCH, SMOKE, "--jobs", "0"], 2, "--jobs: must be > 0, got 0", False),
    ("batch: --ranks-per-gpu auto", [*BATCH, SMOKE, "--ranks-per-gpu", "auto"], 2, "'auto' is taken only", False),
    ("batch: --output-dir a file", [*BATCH, SMOKE, "--output-dir", str(REPO_ROOT / "README.md")], 2,
     "README.md is a file", False),
    ("batch: --summary a named pipe", [*BATCH, SMOKE, "--summary", "{tmp}/pipe"], 2,
     "pipe is a named pipe, not a regular file; writing", False),
    ("batch: HFSDP_STACK_DUMP_AFTER_S junk", ["ENV:HFSDP_STACK_DUMP_AFTER_S=x", *BATCH, SMOKE, "--output-dir",
                                              "{tmp}/out"], 2, "HFSDP_STACK_DUMP_AFTER_S='x'", False),
    ("batch: HFSDP_ITER_TIME_MAX_RATIO 0.5", ["ENV:HFSDP_ITER_TIME_MAX_RATIO=0.5", *BATCH, SMOKE, "--output-dir",
                                              "{tmp}/out"], 2, "RATIO='0.5' is not a number", False),
    ("batch: GPU case without a GPU", [*BATCH, SMOKE, GPU_CASE, "--output-dir", "{tmp}/out"], 2,
     "train on CUDA GPUs and their ranks would see none here", True),
    ("batch: several ranks per GPU without one", [*BATCH, SMOKE, "--ranks-per-gpu", "2"], 2,
     "shares CUDA GPUs between ranks, and this machine has none", True),
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("probe")
    for name, text in RECIPES.items():
        (root / name).mkdir()
        (root / name / "model_config.yaml").write_text(text)
    (root / "empty").mkdir()
    (root / "recipe_folder" / "model_config.yaml").mkdir(parents=True)
    os.mkfifo(root / "pipe")
    (root / "broken").symlink_to(root / "nowhere")
    (root / "pipe_case").mkdir()
    os.mkfifo(root / "pipe_case" / "model_config.yaml")
    (root / "device_case").mkdir()
    (root / "device_case" / "model_config.yaml").symlink_to("/dev/zero")
    (root / "ca sé" / "bad_yaml").mkdir(parents=True)
    (root / "ca sé" / "bad_yaml" / "model_config.yaml").write_text(RECIPES["bad_yaml"])
    (root / "lockpipe" / "smoke").mkdir(parents=True)
    os.mkfifo(root / "lockpipe" / "smoke" / ".cpu_gloo_smoke.lock")
    return root


@pytest.mark.parametrize(("argv", "status", "fragment"), [
    pytest.param(*r[1:4], id=r[0], marks=[pytest.mark.no_cuda] if r[4] else []) for r in ROWS])
def test_probe_row(tmp, argv, status, fragment):
    env = {k: v for k, v in os.environ.items() if k not in ("HFSDP_DEBUG", "MASTER_PORT")}
    env["HFSDP_FUNCTIONAL_OUT"] = str(tmp / "default-out")
    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    while argv[0].startswith("ENV:"):  # "ENV:NAME=VALUE": the row's environment
        env.update([argv.pop(0)[4:].split("=", 1)])  # type: ignore[list-item]
    proc = subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == status, output[-3000:]
    assert fragment.replace("{tmp}", str(tmp)) in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert stat.S_ISFIFO(os.lstat(tmp / "pipe").st_mode), "the named pipe was replaced"
