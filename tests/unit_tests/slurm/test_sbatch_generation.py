"""sbatch text generation, scontrol parsing and summary verdicts (no scheduler needed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hfsdp.slurm import sbatch, summary
from hfsdp.slurm.scontrol import JobInfo, parse_show_job
from hfsdp.usererror import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]
CASE = REPO_ROOT / "tests/functional_tests/test_cases/hybrid/hybrid_mcore_local_fsdp_maxpool_db"


def _spec(tmp_path: Path, **kw) -> sbatch.JobSpec:
    return sbatch.JobSpec(case_dir=CASE, repo_root=REPO_ROOT, log_dir=tmp_path, **kw)


def _block(text: str, first: str, last: str) -> str:
    """The script's lines from the one starting with ``first`` to the one starting with ``last``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(first))
    end = next(i for i, ln in enumerate(lines) if i >= start and ln.startswith(last))
    return "\n".join(lines[start:end + 1])


def test_torchrun_per_node_script(tmp_path: Path) -> None:
    text = sbatch.render_sbatch(_spec(tmp_path, nodes=2, gpus_per_node=8, time_limit_min=45,
                                      partition="batch"))
    assert text.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=2", "#SBATCH --time=45", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --partition=batch",
                 "set -euo pipefail", "MASTER_PORT=$(( 61000 + SLURM_JOB_ID % 4536 ))", "LIMIT_S=2700"):
        assert line in text, line
    assert "--node-rank \"$SLURM_NODEID\"" in text and "--nproc 8" in text
    assert "srun --kill-on-bad-exit=1 --label" in text and "timeout --signal=TERM" in text
    assert "--exit-duration-in-mins" in text and "--record" not in text
    assert "NVLS" not in text and "MULTICAST" not in text  # the user's environment decides


def test_srun_per_gpu_script(tmp_path: Path) -> None:
    text = sbatch.render_sbatch(_spec(tmp_path, launcher="srun", gpus_per_node=4, record=True))
    assert "#SBATCH --ntasks-per-node=4" in text
    assert "RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS" in text
    assert "srun --kill-on-bad-exit=1 --label" in text
    assert '--nproc "$SLURM_NTASKS"' in text  # the evaluation knows the world size the job ran
    assert "--evaluate-log" in text and "--record" in text


@pytest.mark.parametrize("launcher", sbatch.LAUNCHERS)
def test_scripts_are_valid_bash(tmp_path: Path, launcher: str) -> None:
    path = sbatch.write_sbatch(_spec(tmp_path, launcher=launcher))
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_time_budget_helpers() -> None:
    assert sbatch.exit_duration_minutes(30 * 60, 5) == 25
    assert sbatch.exit_duration_minutes(3 * 60, 5) == 1  # never below one minute
    assert sbatch.master_port(4536) == 61000 and sbatch.master_port(4537) == 61001
    with pytest.raises(UserError, match="no room"):
        sbatch.render_sbatch(sbatch.JobSpec(CASE, REPO_ROOT, Path("/tmp"), time_limit_min=1,
                                            kill_buffer_s=60))


def test_time_limit_arithmetic_in_the_script(tmp_path: Path) -> None:
    """Run the generated budget lines in bash with SLURM's start/end times."""
    text = sbatch.render_sbatch(_spec(tmp_path, time_limit_min=30, exit_buffer_min=5))
    script = _block(text, "LIMIT_S=", "KILL_AFTER_S=") + '\necho "$LIMIT_S $EXIT_MINS $KILL_AFTER_S"\n'
    env = {"SLURM_JOB_START_TIME": "1000", "SLURM_JOB_END_TIME": str(1000 + 20 * 60), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True).stdout.split()
    assert out[0] == "1200" and out[1] == "15.00" and 1130 <= int(out[2]) <= 1140, out


def test_parse_show_job_line() -> None:
    line = ("JobId=7 JobName=hfsdp-smoke-x UserId=root(0) JobState=FAILED Reason=NonZeroExitCode "
            "Dependency=(null) ExitCode=1:0 RunTime=00:00:12 StdOut=/tmp/x-7.out Command=/tmp/a b")
    f = parse_show_job(line)
    assert (f["JobId"], f["JobState"], f["ExitCode"], f["StdOut"]) == ("7", "FAILED", "1:0", "/tmp/x-7.out")


def test_summary_verdicts(tmp_path: Path) -> None:
    out_ok, out_bad = tmp_path / "ok.out", tmp_path / "bad.out"
    out_ok.write_text("...\nHFSDP-FUNCTIONAL RESULT smoke/a: PASS\n")
    out_bad.write_text("...\nHFSDP-FUNCTIONAL RESULT smoke/b: FAIL\n")
    entry = {"case": "/x/smoke/a", "job_id": 1, "stdout": str(out_ok)}
    assert summary.judge(entry, JobInfo(1, "COMPLETED", "0:0", str(out_ok))).verdict == "PASS"
    # A zero exit code with a failing driver verdict is still a failure, and vice versa.
    assert summary.judge(entry, JobInfo(1, "COMPLETED", "0:0", str(out_bad))).verdict == "FAIL"
    assert summary.judge(entry, JobInfo(1, "FAILED", "1:0", str(out_ok))).verdict == "FAIL"
    assert summary.judge(entry, JobInfo(1, "RUNNING", "0:0", str(out_ok))).verdict == "RUNNING"
    assert summary.judge(entry, JobInfo(1, "UNKNOWN", "?", None)).verdict == "PASS"  # file fallback


def test_submit_dry_run_writes_manifest(tmp_path: Path) -> None:
    from hfsdp.slurm.submit import main

    assert main([str(CASE), "--log-dir", str(tmp_path), "--dry-run", "--time", "20"]) == 0
    manifest = json.loads((tmp_path / "jobs.json").read_text())
    assert manifest[0]["case"] == str(CASE) and manifest[0]["job_id"] is None
    assert Path(manifest[0]["script"]).is_file()


def test_local_cluster_finds_sbin_tools_on_a_non_login_path() -> None:
    """runuser, slurmctld and munged live in sbin, which `env -i PATH=/usr/bin:/bin` lacks."""
    from hfsdp.slurm.local_cluster import SBIN_DIRS, with_sbin

    path = with_sbin({"PATH": "/usr/bin:/bin:/usr/sbin"})["PATH"].split(":")
    assert path == ["/usr/bin", "/bin", "/usr/sbin", "/usr/local/sbin", "/sbin"], path
    assert with_sbin({})["PATH"].split(":")[-len(SBIN_DIRS):] == list(SBIN_DIRS)


# What `scontrol` says on the local CI cluster: node names n1.. that do not resolve, NodeAddr set.
FAKE_SCONTROL = """#!/bin/sh
case "$*" in
  "show hostnames n[1-2]") printf 'n1\\nn2\\n' ;;
  "show node -o n1") echo "NodeName=n1 Arch=x86_64 CPUAlloc=2 NodeAddr=${FAKE_ADDR} NodeHostName=vm \\
    OS=Linux 6.1.0 #1 SMP RealMemory=1 State=ALLOCATED" ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""


@pytest.mark.parametrize(("addr", "expected"), [("127.0.0.1", "127.0.0.1"), ("10.1.2.3", "10.1.2.3"),
                                                ("", "n1")])
def test_master_address_is_the_first_nodes_node_addr(tmp_path: Path, addr: str, expected: str) -> None:
    """Run the script's master lines in bash against a stand-in scontrol: the first node's NodeAddr,
    not its name (a name such as n1 need not resolve); the name only where Slurm gives no address."""
    fake = FAKE_SCONTROL if addr else FAKE_SCONTROL.replace(" NodeAddr=${FAKE_ADDR}", "")  # no such field
    (tmp_path / "scontrol").write_text(fake)
    (tmp_path / "scontrol").chmod(0o755)
    text = sbatch.render_sbatch(_spec(tmp_path, nodes=2))
    script = "set -euo pipefail\n" + _block(text, "FIRST_NODE=", "export MASTER_ADDR") + \
        '\necho "addr=$MASTER_ADDR port=$MASTER_PORT"\n'
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "4537",
           "FAKE_ADDR": addr}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"addr={expected} port=61001", proc.stdout


def test_node_script_names_the_node_when_the_time_limit_stops_it(tmp_path: Path) -> None:
    """Each node's task: the driver under `timeout`, its node rank from Slurm; when the limit less
    the buffer runs out, exit 124 and a line naming the node (the summary reads it)."""
    env = {"PATH": "/usr/bin:/bin", "SLURM_NODEID": "1", "SLURMD_NODENAME": "n2"}
    args = ["python3", "-c", "import sys, time; print(sys.argv[1:], flush=True); time.sleep(30)"]
    proc = subprocess.run(["bash", "-c", sbatch.NODE_SCRIPT, "node", "1", *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 124, proc
    assert "['--node-rank', '1']" in proc.stdout
    assert "HFSDP-SLURM STOPPED node=n2: time limit" in proc.stdout
    fast = subprocess.run(["bash", "-c", sbatch.NODE_SCRIPT, "node", "30", "sh", "-c", "exit 3"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert fast.returncode == 3 and "STOPPED" not in fast.stdout  # a failure is passed through as is


@pytest.mark.parametrize("launcher", sbatch.LAUNCHERS)
def test_submit_env_reaches_the_driver_and_wins_over_env_vars(tmp_path: Path, launcher: str) -> None:
    """`submit --env` used to be exported in the script only, where the case's ENV_VARS overrode it;
    now the driver (torchrun per node) or launch_cmd (srun per rank) gets it as its own --env."""
    text = sbatch.render_sbatch(_spec(tmp_path, launcher=launcher, env={"HFSDP_SMOKE_FAIL_RANK": "0"}))
    assert "export HFSDP_SMOKE_FAIL_RANK=0" in text
    launch_line = next(ln for ln in text.splitlines()
                       if ln.startswith(("RUN_CASE=(", "CMD_TEXT=$(")))
    assert "--env HFSDP_SMOKE_FAIL_RANK=0" in launch_line, launch_line


def test_launch_cmd_env_wins_over_env_vars_and_unsets_what_the_case_unsets(tmp_path: Path) -> None:
    from hfsdp.slurm.launch_cmd import command

    case = tmp_path / "smoke" / "c"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(
        "TRAINING_SCRIPT: -m x\nTEST_TYPE: smoke\nREQUIRE_GOLDEN: false\nMETRICS:\n  - lm loss\n"
        "ENV_VARS:\n  A: '1'\n  GONE: null\nMODEL_ARGS:\n  --train-iters: 3\n")
    cmd = command(case, tmp_path / "out", None, python="py", env={"A": "2"})
    assert cmd[:cmd.index("py")] == ["env", "-u", "GONE", "A=2"], cmd
    shared = command(case, tmp_path / "out", None, python="py", ranks_per_gpu=2)
    assert shared[shared.index("py"):][:6] == ["py", "-m", "hfsdp.launch.shared_gpu", "--ranks-per-gpu", "2", "--"]


@pytest.mark.parametrize("launcher", sbatch.LAUNCHERS)
def test_ranks_per_gpu_is_passed_through(tmp_path: Path, launcher: str) -> None:
    """--ranks-per-gpu 2 on 2 GPUs: 4 ranks on the node, 2 GPUs asked for, the option reaches the
    launcher (the driver's torchrun, or each srun task through hfsdp.launch.shared_gpu)."""
    text = sbatch.render_sbatch(_spec(tmp_path, launcher=launcher, gpus_per_node=2, ranks_per_gpu=2))
    assert "#SBATCH --gpus-per-node=2" in text
    if launcher == "torchrun":
        assert "#SBATCH --cpus-per-task=4" in text
        run_case = next(ln for ln in text.splitlines() if ln.startswith("RUN_CASE=("))
        assert "--nproc 4" in run_case and "--ranks-per-gpu 2" in run_case, run_case
    else:
        assert "#SBATCH --ntasks-per-node=4" in text
        lines = [ln for ln in text.splitlines() if "--ranks-per-gpu 2" in ln]
        assert [ln.split()[2] for ln in lines] == ["hfsdp.slurm.launch_cmd", "hfsdp.functional.run_case"], lines
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


LABELLED_KILL = """\
hfsdp: case=/r/smoke/cpu_gloo_smoke nodes=2 (n[1-2]) master=n1@127.0.0.1:61012 limit=600s exit_mins=8.00
1:  iteration        1/       8 | consumed samples:            4 | lm loss: 4.8E+00 |
0: smoke: rank 0 stalls 600 s before iteration 2 (HFSDP_SMOKE_STALL_S)
srun: error: n2: task 1: Exited with exit code 1
1:   - run 1 exited with 1
1: HFSDP-FUNCTIONAL RESULT smoke/cpu_gloo_smoke: FAIL
0:   - stopped by SIGTERM: the run was ended
0: HFSDP-FUNCTIONAL RESULT smoke/cpu_gloo_smoke: FAIL
srun: error: n1: task 0: Exited with exit code 143
"""


def test_summary_names_the_node_where_the_failure_began(tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    out.write_text(LABELLED_KILL)
    read = summary.read_output(str(out), "smoke/cpu_gloo_smoke")
    assert read.verdict == "FAIL" and read.first_error == "n2 task 1: Exited with exit code 1"
    row = summary.judge({"case": "/r/smoke/cpu_gloo_smoke", "job_id": 12},
                        JobInfo(12, "FAILED", "1:0", str(out), "NonZeroExitCode"))
    assert row.verdict == "FAIL"
    assert "first failure: n2 task 1: Exited with exit code 1" in row.detail, row.detail
    assert "driver: task 1: run 1 exited with 1 (+1 more)" in row.detail, row.detail


def test_summary_says_the_time_limit_stopped_the_run(tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    out.write_text("0: HFSDP-SLURM STOPPED node=n1: time limit (...)\n1: HFSDP-SLURM STOPPED node=n2: time limit\n"
                   "srun: error: n1: task 0: Exited with exit code 124\n")
    row = summary.judge({"case": "/r/smoke/x", "job_id": 3}, JobInfo(3, "FAILED", "124:0", str(out)))
    assert row.verdict == "FAIL" and "time limit: the run was ended on n1, n2" in row.detail, row.detail
    slurm = summary.judge({"case": "/r/smoke/x", "job_id": 3}, JobInfo(3, "TIMEOUT", "0:15", None, "TimeLimit"))
    assert slurm.verdict == "FAIL" and "Slurm's time limit ended the job" in slurm.detail


def test_one_failing_node_fails_the_case_whatever_the_order(tmp_path: Path) -> None:
    """Every node's driver prints a verdict; the last line is not the verdict of the job."""
    out = tmp_path / "job.out"
    out.write_text("1: HFSDP-FUNCTIONAL RESULT smoke/x: FAIL\n0: HFSDP-FUNCTIONAL RESULT smoke/x: PASS\n")
    assert summary.read_output(str(out), "smoke/x").verdict == "FAIL"


def test_a_verdict_on_another_case_passes_no_job(tmp_path: Path) -> None:
    """The job of smoke/x whose output holds smoke/y's PASS (another case's script, say) fails."""
    out = tmp_path / "job.out"
    out.write_text("HFSDP-FUNCTIONAL RESULT smoke/y: PASS\n")
    assert summary.read_output(str(out), "smoke/x").verdict is None
    for info in (JobInfo(4, "COMPLETED", "0:0", str(out)), JobInfo(4, "UNKNOWN", "?", None)):
        row = summary.judge({"case": "/r/smoke/x", "job_id": 4, "stdout": str(out)}, info)
        assert row.verdict == "FAIL" and "gives the verdict of smoke/y, not of smoke/x" in row.detail, row.detail
    row = summary.judge({"case": "/r/smoke/y", "job_id": 4}, JobInfo(4, "COMPLETED", "0:0", str(out)))
    assert row.verdict == "PASS", row.detail


def test_summary_without_scontrol_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from hfsdp.slurm.submit import MANIFEST

    (tmp_path / MANIFEST).write_text(json.dumps([{"case": "/r/smoke/x", "script": "s", "job_id": 7,
                                                  "stdout": None}]))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert summary.main(["--log-dir", str(tmp_path)]) == 2
    assert "scontrol is not installed here (not on PATH)" in capsys.readouterr().err


def test_local_cluster_conf_has_one_slurmd_per_node_on_loopback(tmp_path: Path) -> None:
    """Several nodes on one host: each its own port, all this host at 127.0.0.1, per-node paths."""
    from hfsdp.slurm.local_cluster import LocalCluster

    conf = LocalCluster(tmp_path, nodes=4, partitions={"four": 4, "two": 2})._slurm_conf().splitlines()
    nodes = [ln for ln in conf if ln.startswith("NodeName=")]
    assert [ln.split()[0] for ln in nodes] == ["NodeName=n1", "NodeName=n2", "NodeName=n3", "NodeName=n4"]
    assert all("NodeAddr=127.0.0.1" in ln and "NodeHostname=" in ln for ln in nodes)
    assert len({ln.split("Port=")[1].split()[0] for ln in nodes}) == 4  # one port per slurmd
    assert f"SlurmdPidFile={tmp_path}/slurmd-%n.pid" in conf and f"SlurmdSpoolDir={tmp_path}/spool/%n" in conf
    parts = [ln for ln in conf if ln.startswith("PartitionName=")]
    assert parts[0].startswith("PartitionName=four Nodes=n1,n2,n3,n4 Default=YES")
    assert parts[1].startswith("PartitionName=two Nodes=n1,n2 Default=NO")
    with pytest.raises(ValueError, match="need 1 to 2 nodes"):
        LocalCluster(tmp_path, nodes=2, partitions={"big": 3})


def test_the_two_node_dp16_example_of_the_docs(tmp_path: Path) -> None:
    """docs/slurm.md's example, done as it says: a copy of a recipe with batch sizes valid at DP=16,
    submitted (dry run) on 2 nodes x 8 GPUs."""
    import shutil

    from hfsdp.functional.recipe import load_recipe
    from hfsdp.slurm.submit import main

    doc = (REPO_ROOT / "docs/slurm.md").read_text()
    assert '"--global-batch-size: 32" (2 x 16)' in doc and "--nodes 2 --gpus-per-node 8" in doc
    case = tmp_path / "my_cases" / "hybrid" / "maxpool_db_dp16"
    shutil.copytree(CASE, case)
    for golden in case.glob("golden_values_*.json"):
        golden.unlink()
    text = (case / "model_config.yaml").read_text()
    assert "  --global-batch-size: 8\n" in text and "COMPARE_TO:" in text
    text = "\n".join(ln for ln in text.replace("  --global-batch-size: 8\n", "  --global-batch-size: 32\n")
                     .splitlines() if not ln.startswith("COMPARE_TO:")) + "\nREQUIRE_GOLDEN: false\n"
    (case / "model_config.yaml").write_text(text)
    recipe = load_recipe(case)
    gbs, mbs = int(recipe.model_args["--global-batch-size"]), int(recipe.model_args["--micro-batch-size"])
    assert gbs % (mbs * 16) == 0 and "--tensor-model-parallel-size" not in recipe.model_args
    logs = tmp_path / "out" / "slurm-dp16"
    assert main([str(case), "--log-dir", str(logs), "--nodes", "2", "--gpus-per-node", "8", "--time", "30",
                 "--partition", "batch", "--dry-run"]) == 0
    script = (logs / "hfsdp-hybrid-maxpool_db_dp16.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --partition=batch", "LIMIT_S=1800"):
        assert line in script, line
    run_case = next(ln for ln in script.splitlines() if ln.startswith("RUN_CASE=("))
    assert "--nproc 8 --nnodes \"$SLURM_JOB_NUM_NODES\"" in run_case, run_case


def test_srun_per_rank_stops_when_launch_cmd_refuses_the_case(tmp_path: Path) -> None:
    """launch_cmd's refusal once vanished in a process substitution, and srun ran an empty command."""
    fake_py, fake_srun, called = tmp_path / "py", tmp_path / "srun", tmp_path / "srun-called"
    fake_py.write_text("#!/bin/sh\necho 'launch_cmd: error: no such case' >&2\nexit 2\n")
    fake_srun.write_text(f"#!/bin/sh\ntouch {called}\n")
    for f in (fake_py, fake_srun):
        f.chmod(0o755)
    text = sbatch.render_sbatch(_spec(tmp_path, launcher="srun", python=str(fake_py)))
    script = "set -euo pipefail\n" + _block(text, "PY=", "CASE=") + "\n" + _block(text, "CMD_TEXT=", "timeout ")
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "KILL_AFTER_S": "60", "EXIT_MINS": "5"}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no such case" in proc.stderr, proc
    assert not called.exists(), "srun ran although launch_cmd refused the case"
