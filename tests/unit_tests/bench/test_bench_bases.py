"""--base: pristine upstream releases beside the fork in one benchmark (hfsdp/bench/bases.py), with the
releases faked by small sdists and the GPU runs faked out."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from patchset.patchset_fake import make_sdist

from hfsdp.bench import bases
from hfsdp.bench import configs as cfgs
from hfsdp.bench import results as R
from hfsdp.bench import run as B
from hfsdp.proc import run_group
from hfsdp.training import upstream_base
from hfsdp.usererror import UserError

REPO = Path(__file__).resolve().parents[3]
GIB = 2**30
# Flags a fake release's parser defines: 0.18.2 lacks the max-pool flag, 0.19.2 has it.
FLAGS_0182 = ("--fsdp-double-buffer", "--cuda-graph-impl", "--rerun-mode", "--transformer-impl",
              "--use-nccl-ub", "--suggested-communication-unit-size", "--micro-batch-size", "--seq-length")
FLAGS_0192 = (*FLAGS_0182, "--megatron-fsdp-max-pool-double-buffer")


def release(folder: Path, version: str, flags: tuple[str, ...], lacks: str = "") -> Path:
    """A fake megatron-core sdist whose arguments.py defines ``flags`` and the default model's (but ``lacks``)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = [f for f in cfgs.model_flags("default") if f.startswith("--") and f != lacks]
    arguments = "".join(f"    parser.add_argument('{f}')\n" for f in dict.fromkeys((*model, *flags)))
    return make_sdist(folder, version, {
        "megatron/core/__init__.py": f"__version__ = {version!r}\n",
        "megatron/training/__init__.py": "",
        "megatron/training/arguments.py": f"def add_megatron_arguments(parser):\n{arguments}    return parser\n",
    })


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    """out/bases as `python -m hfsdp.bench.bases prepare` leaves it, from two local fake sdists."""
    folder = tmp_path / "bases"
    for version, flags in (("0.19.2", FLAGS_0192), ("0.18.2", FLAGS_0182)):
        assert bases.main(["prepare", str(release(tmp_path / "dl" / version, version, flags)),
                           "--dir", str(folder)]) == 0
    return folder


def test_prepare_keeps_the_sdist_and_a_manifest(prepared: Path, tmp_path: Path, capsys) -> None:
    doc = json.loads((prepared / "megatron_core-0.19.2.json").read_text())
    sdist = prepared / "megatron_core-0.19.2.tar.gz"
    assert doc["sdist"] == sdist.name and doc["version"] == "0.19.2"
    assert doc["sha256"] == bases.find("upstream-0.19.2", prepared).sha256
    assert "a local file" in doc["source"]
    with contextlib.ExitStack() as stack:
        trees, meta = bases.resolve(["fork", "upstream-0.18.2"], prepared, stack)
        tree = trees["upstream-0.18.2"]
        assert (tree / "megatron/core/__init__.py").read_text() == "__version__ = '0.18.2'\n"
        offers = bases.capabilities("upstream-0.18.2", trees, os.environ)
        assert "--fsdp-double-buffer" in offers.flags and "--megatron-fsdp-max-pool-double-buffer" not in offers.flags
        assert not offers.local_hybrid  # as upstream: the local-spec hybrid layers are the fork's
        assert meta["upstream-0.18.2"]["sdist"] == "megatron_core-0.18.2.tar.gz"
        assert meta["fork"]["version"].startswith("0.18.2+hfsdp.")
    assert not tree.exists()  # extracted for the invocation only


def test_a_base_not_prepared_or_damaged_is_one_sentence(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"upstream-0.19.2 is not prepared: .* has no megatron_core-0.19.2.json") as exc:
        bases.find("upstream-0.19.2", tmp_path / "empty")
    assert "python -m hfsdp.bench.bases prepare 0.19.2" in exc.value.fix
    (prepared / "megatron_core-0.18.2.tar.gz").write_bytes(b"not the release")
    with pytest.raises(UserError, match="is not the file its manifest describes"):
        bases.find("upstream-0.18.2", prepared)


def test_a_base_run_imports_its_tree_and_never_the_forks(prepared: Path, monkeypatch) -> None:
    """The run's environment, used the way torchrun runs pretrain_gpt.py from this checkout (whose folder
    holds the fork's megatron/): megatron is the release's tree, hfsdp is ours."""
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}/elsewhere")
    with contextlib.ExitStack() as stack:
        trees, _ = bases.resolve(["upstream-0.19.2"], prepared, stack)
        env = B.job_env(os.environ, bases.run_env("upstream-0.19.2:no_db", trees, os.environ))
        entries = env["PYTHONPATH"].split(os.pathsep)
        assert str(REPO) not in entries and entries[0] == str(trees["upstream-0.19.2"])
        assert not any(Path(p, "megatron").exists() for p in entries[1:])
        probe = ("import hfsdp, importlib.util; from hfsdp.training import upstream_base as u; u.ensure(u.active()); "
                 "import megatron.core as m; assert importlib.util.find_spec('megatron.core.models') is None; "
                 "print(m.__version__, m.__file__, hfsdp.__file__)")  # a module the fake release lacks
        out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        version, core, ours = out.stdout.split()
        assert version == "0.19.2" and Path(core).is_relative_to(trees["upstream-0.19.2"])
        assert Path(ours).resolve().is_relative_to(REPO / "hfsdp")
    assert bases.run_env("no_db", trees, os.environ) == {upstream_base.ENV: None}  # the fork's rows: as before


def test_the_entry_refuses_a_tree_that_is_not_the_named_one(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"HFSDP_UPSTREAM_BASE=.*, but megatron.core resolves to .*, not that tree"):
        upstream_base.ensure(tmp_path)  # this process imports the fork's megatron


@pytest.fixture
def faked(monkeypatch):
    """8 GPUs, every package; runs faked: upstream-0.19.2 graphed runs crash, the rest take their times."""
    monkeypatch.setattr(B.fit, "gpu_memory", lambda *a, **k: [80 * GIB] * 8)
    monkeypatch.setattr(B.requirements, "importable", lambda package: True)
    calls = []
    step = {"no_db": 0.300, "maxpool_graph": 0.040, "te_no_db": 0.250, "te_maxpool": 0.240, "te_no_db_graph": 0.035}

    def launch(config, repeat, flags, opts, workdir, timeout_s=None):
        calls.append((config.name, repeat, config.flags))
        base, name = bases.split(config.name)
        if base == "upstream-0.19.2" and config.graphed:  # as on torch < 2.13
            tail = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n"
                    "[rank0]: RuntimeError: stale capture stream\nE1128 torch.distributed.elastic.multiprocessing"
                    ".api: failed (exitcode: 1)\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
            return None, f"rc=1; log tail:\n{tail}"
        t = step[name] * (1.5 if base != "fork" else 1.0)
        return R.RunResult(config=config.name, repeat=repeat, step_times_s=(t,), tokens_per_step=4096,
                           peak_allocated_bytes=GIB, peak_reserved_bytes=GIB), "log"

    monkeypatch.setattr(B, "launch", launch)
    return calls


def test_one_invocation_runs_every_base_and_picks_each_ones_best(prepared: Path, faked, tmp_path: Path,
                                                                   capsys) -> None:
    out = tmp_path / "r.json"
    rc = B.main(["--configs", "no_db,maxpool_graph,te_no_db,te_maxpool,te_no_db_graph", "--repeats", "1",
                 "--base", "fork,upstream-0.19.2", "--base", "upstream-0.18.2", "--bases-dir", str(prepared),
                 "--no-plan", "--no-chart", "--out-json", str(out)])
    assert rc == 1  # upstream-0.19.2's graphed run failed
    text = capsys.readouterr().out
    # Refused before any run, one sentence each: no local-spec hybrid layers upstream, no max-pool in 0.18.2.
    local = "has no local-spec hybrid layers (the fork adds them), so it runs this hybrid model only on Transformer " \
            "Engine specs (the te_* configurations)"
    flag = "has no --megatron-fsdp-max-pool-double-buffer (a flag of the fork or of a later release)"
    assert [line for line in text.splitlines() if line.startswith("skip ")] == [
        f"skip upstream-0.19.2:no_db: megatron-core 0.19.2 {local}",
        f"skip upstream-0.19.2:maxpool_graph: megatron-core 0.19.2 {local}",
        f"skip upstream-0.18.2:no_db: megatron-core 0.18.2 {local}",
        f"skip upstream-0.18.2:maxpool_graph: megatron-core 0.18.2 {flag}",
        f"skip upstream-0.18.2:te_maxpool: megatron-core 0.18.2 {flag}"]
    assert text.index("skip upstream-0.18.2:te_maxpool") < text.index("[prime]")
    assert not {n for n, _, _ in faked} & {"upstream-0.18.2:te_maxpool", "upstream-0.19.2:no_db"}
    # Graphed rows of a release run with the fork's default rerun mode.
    flags = {name: f for name, r, f in faked if r == 0}
    assert flags["upstream-0.18.2:te_no_db_graph"][-2:] == ("--rerun-mode", "disabled")
    assert "--rerun-mode" not in flags["te_no_db_graph"] and "--rerun-mode" not in flags["upstream-0.18.2:te_no_db"]
    # Each start-up class of each base primes once.
    assert [n for n, r, _ in faked if r == -1] == ["no_db", "te_no_db", "upstream-0.19.2:te_no_db",
                                                    "upstream-0.18.2:te_no_db"]
    # A crash is one line, naming what the log ends with (not torchrun's report of it): as it ran, and below.
    said = "upstream-0.19.2 te_no_db_graph: failed: RuntimeError: stale capture stream"
    lines = [line for line in text.splitlines() if "upstream-0.19.2 te_no_db_graph: failed" in line]
    assert [line.split("] repeat 0 ")[-1].split(" (")[0] for line in lines] == [said, said]
    doc = json.loads(out.read_text())
    assert doc["meta"]["best_per_base"] == {
        "fork": {"config": "te_no_db_graph", "median_step_s": pytest.approx(0.035), "peak_allocated_bytes": GIB},
        "upstream-0.19.2": {"config": "te_maxpool", "median_step_s": pytest.approx(0.360),
                            "peak_allocated_bytes": GIB},
        "upstream-0.18.2": {"config": "te_no_db_graph", "median_step_s": pytest.approx(0.0525),
                            "peak_allocated_bytes": GIB},
    }
    assert doc["meta"]["bases"]["upstream-0.19.2"]["sdist"] == "megatron_core-0.19.2.tar.gz"
    assert len(doc["meta"]["bases"]["upstream-0.19.2"]["sha256"]) == 64
    assert doc["meta"]["failures"]["upstream-0.19.2:te_no_db_graph#0"] == said
    assert "upstream-0.18.2:te_maxpool" in doc["meta"]["skipped"]
    assert {s["config"] for s in doc["summary"]} >= {"te_no_db_graph", "upstream-0.19.2:te_maxpool",
                                                       "upstream-0.18.2:te_no_db"}
    assert "upstream-0.19.2  te_maxpool" in text and "10.29 x the fork's best" in text


def test_a_release_row_that_failed_is_not_repeated_nor_relaunched_on_resume(prepared: Path, faked, tmp_path: Path,
                                                                           monkeypatch) -> None:
    """A release fails a configuration it lacks the same way each time: launched once, its other
    repeats recorded as not repeated; a resumed invocation does not launch it again. The fork's
    rows keep every repeat."""
    monkeypatch.setattr(B.run_logs, "machine_identity", lambda: {"host": "h", "gpus": ["GPU-1"]})
    kept = tmp_path / "kept"
    argv = ["--configs", "te_no_db,te_no_db_graph", "--repeats", "3", "--base", "fork,upstream-0.19.2",
            "--bases-dir", str(prepared), "--no-plan", "--no-chart", "--no-prime", "--keep-logs", str(kept),
            "--out-json", str(tmp_path / "r.json")]
    assert B.main(argv) == 1
    launched = [(n, r) for n, r, _ in faked]
    assert launched.count(("upstream-0.19.2:te_no_db_graph", 0)) == 1
    assert not [r for n, r in launched if n == "upstream-0.19.2:te_no_db_graph" and r > 0]
    assert sorted(r for n, r in launched if n == "te_no_db_graph") == [0, 1, 2]
    doc = json.loads((tmp_path / "r.json").read_text())
    said = "upstream-0.19.2 te_no_db_graph: failed: RuntimeError: stale capture stream"
    assert doc["meta"]["failures"]["upstream-0.19.2:te_no_db_graph#2"] == f"not repeated: {said}"
    # The fake launch keeps no logs, so mark the failed repeat as a real launch would have.
    (kept / "upstream-0.19.2:te_no_db_graph-0.log").write_text("")
    (kept / "upstream-0.19.2:te_no_db_graph-0.failed").write_text(said + "\n")
    faked.clear()
    assert B.main([*argv, "--resume"]) == 1
    assert not [n for n, _, _ in faked if n == "upstream-0.19.2:te_no_db_graph"]
    # Summarized from the folder, the later repeats are "not repeated", not missing.
    row = "upstream-0.19.2:te_no_db_graph"
    _, failures = B.run_logs._read_kept(str(kept), [(0, row), (1, row)], [], None)
    assert failures == {f"{row}#0": f"failed when it ran: {said}", f"{row}#1": f"not repeated: {said}"}


def test_release_configs_narrow_what_the_releases_run(prepared: Path, faked, tmp_path: Path, capsys) -> None:
    argv = ["--configs", "te_no_db,te_maxpool", "--repeats", "1", "--base", "fork,upstream-0.19.2",
            "--bases-dir", str(prepared), "--no-plan", "--no-chart", "--no-prime",
            "--out-json", str(tmp_path / "r.json")]
    assert B.main([*argv, "--release-configs", "te_no_db"]) == 0
    assert sorted(n for n, _, _ in faked) == ["te_maxpool", "te_no_db", "upstream-0.19.2:te_no_db"]
    faked.clear()
    assert B.main([*argv, "--release-configs", "te_no_db,maxpool_graph"]) == 2 and not faked
    err = capsys.readouterr().err
    said = "--release-configs names 'maxpool_graph', not a configuration of --configs\n  -> use te_no_db, te_maxpool"
    assert said in err


def test_fork_configs_narrow_what_the_fork_runs(prepared: Path, faked, tmp_path: Path, capsys) -> None:
    argv = ["--configs", "te_no_db,te_maxpool", "--repeats", "1", "--base", "fork,upstream-0.19.2",
            "--bases-dir", str(prepared), "--no-plan", "--no-chart", "--no-prime",
            "--out-json", str(tmp_path / "r.json")]
    assert B.main([*argv, "--fork-configs", "te_maxpool", "--release-configs", "te_no_db"]) == 0
    assert sorted(n for n, _, _ in faked) == ["te_maxpool", "upstream-0.19.2:te_no_db"]
    faked.clear()
    assert B.main([*argv, "--fork-configs", "maxpool_graph"]) == 2 and not faked
    said = "--fork-configs names 'maxpool_graph', not a configuration of --configs\n  -> use te_no_db, te_maxpool"
    assert said in capsys.readouterr().err
    assert B.main([*argv[:4], "--base", "upstream-0.19.2", *argv[6:], "--fork-configs", "te_no_db"]) == 2
    assert "--fork-configs narrows what the fork runs, but --base does not name the fork" in capsys.readouterr().err
    assert not faked


def test_local_specs_refused_only_for_hybrid_models_on_releases_without_them() -> None:
    bare = bases.Capabilities(frozenset({"--hybrid-layer-pattern", "--transformer-impl", "--spec"}), False)
    hybrid = ["--hybrid-layer-pattern", "M*", "--transformer-impl", "local"]
    assert "no local-spec hybrid layers" in (bases.refusal("upstream-0.19.2:no_db", hybrid, bare) or "")
    assert bases.refusal("upstream-0.19.2:no_db", hybrid, dataclasses.replace(bare, local_hybrid=True)) is None
    assert bases.refusal("upstream-0.19.2:no_db", ["--transformer-impl", "local"], bare) is None  # GPT
    assert bases.refusal("upstream-0.19.2:no_db", hybrid[:2], bare) is None  # Megatron's default: TE
    assert bases.refusal("no_db", hybrid, bare) is None  # the fork is never refused here


def test_a_base_that_is_not_prepared_stops_before_any_run(faked, tmp_path: Path, capsys) -> None:
    rc = B.main(["--configs", "no_db", "--base", "upstream-0.19.2", "--bases-dir", str(tmp_path / "none"),
                 "--no-plan", "--no-chart", "--out-json", str(tmp_path / "r.json")])
    assert rc == 2 and not faked
    assert "upstream-0.19.2 is not prepared" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--base", "upstream-0.17.0"], ["--base", "fork,fork"], ["--base", ","]])
def test_bad_bases_are_one_sentence(argv, faked, tmp_path: Path, capsys) -> None:
    assert B.main(["--configs", "no_db", *argv, "--out-json", str(tmp_path / "r.json")]) == 2
    assert "--base names" in capsys.readouterr().err and not faked


def test_model_flags_a_release_lacks_refuse_its_rows(faked, tmp_path: Path, capsys) -> None:
    sdist = release(tmp_path / "dl", "0.18.2", FLAGS_0182, lacks="--disable-mamba-mem-eff-path")
    assert bases.main(["prepare", str(sdist), "--dir", str(tmp_path / "bases")]) == 0
    B.main(["--configs", "no_db", "--repeats", "1", "--base", "fork,upstream-0.18.2", "--bases-dir",
            str(tmp_path / "bases"), "--no-plan", "--no-chart", "--out-json", str(tmp_path / "r.json")])
    assert ("skip upstream-0.18.2:no_db: megatron-core 0.18.2 has no --disable-mamba-mem-eff-path (a flag of the "
            "fork or of a later release)\n") in capsys.readouterr().out
    assert [n for n, _, _ in faked] == ["no_db", "no_db"]  # the fork's priming and timed run only


def test_last_error_line_skips_torchruns_report() -> None:
    log = ("iteration 1\n[rank1]: Traceback (most recent call last):\n[rank1]:   File \"a.py\", line 3, in f\n"
           "[rank1]:     raise AssertionError('x')\n[rank1]: AssertionError: capture needs torch >= 2.13\n"
           "Traceback (most recent call last):\n  File \"run.py\", line 9\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\npretrain_gpt.py FAILED\n")
    assert bases.last_error_line(log) == "AssertionError: capture needs torch >= 2.13"
    assert bases.last_error_line("pretrain_gpt.py: error: unrecognized arguments: --x\n  -> fix the flags\n") == (
        "pretrain_gpt.py: error: unrecognized arguments: --x")
    assert bases.failure_line("upstream-0.18.2:no_db", "rc=timeout", "step 3\n") == (
        "upstream-0.18.2 no_db: failed: rc=timeout")


def test_the_profiling_passes_are_the_forks_alone(prepared: Path, faked, tmp_path: Path, capsys) -> None:
    assert B.main(["--configs", "no_db", "--base", "upstream-0.19.2", "--bases-dir", str(prepared),
                   "--profile-dir", str(tmp_path / "p"), "--out-json", str(tmp_path / "r.json")]) == 2
    assert "profile the fork alone" in capsys.readouterr().err


def test_a_base_run_gets_the_release_environment(prepared: Path, monkeypatch, tmp_path: Path) -> None:
    seen = []

    def fake_run(cmd, *, timeout_s, env, stdout):
        seen.append((cmd, env))
        return run_group([sys.executable, "-c", "raise SystemExit(1)"])

    monkeypatch.setattr(B, "run_group", fake_run)
    opts, _ = B.parse([])
    with contextlib.ExitStack() as stack:
        opts.trees, _ = bases.resolve(["upstream-0.19.2"], prepared, stack)
        run, info = B.launch(bases.config("upstream-0.19.2:no_db_graph"), 0, [], opts, str(tmp_path))
    cmd, env = seen[0]
    assert run is None and info.startswith("rc=1")
    assert env["PYTHONSAFEPATH"] == "1" and env[upstream_base.ENV].endswith("megatron-core-0.19.2")
    assert "--rerun-mode disabled --no-check-for-nan-in-loss-and-grad" in " ".join(cmd)
    assert (tmp_path / "upstream-0.19.2:no_db_graph-0.log").exists()


def test_a_release_that_cannot_build_its_parser_here_is_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "dl").mkdir()
    sdist = make_sdist(tmp_path / "dl", "0.19.2", {
        "megatron/core/__init__.py": "", "megatron/training/__init__.py": "",
        "megatron/training/arguments.py": "import not_installed_here\n"})
    assert bases.main(["prepare", str(sdist), "--dir", str(tmp_path / "bases")]) == 0
    with contextlib.ExitStack() as stack:
        trees, _ = bases.resolve(["upstream-0.19.2"], tmp_path / "bases", stack)
        with pytest.raises(UserError, match=r"upstream-0.19.2's Megatron argument parser cannot be built here: "
                                            r"ModuleNotFoundError: No module named 'not_installed_here'"):
            bases.capabilities("upstream-0.19.2", trees, os.environ)


def test_the_dataset_helpers_are_built_so_that_upstreams_startup_make_finds_them(tmp_path: Path, monkeypatch) -> None:
    """The sdist has helpers.cpp but not the Makefile upstream's compile_helpers runs at start-up. prepare builds
    the extension too, for a machine without a compiler; a damaged copy is built again."""
    from megatron.core.datasets import helpers_build

    (tmp_path / "dl").mkdir()
    helpers = "#include <pybind11/pybind11.h>\nPYBIND11_MODULE(helpers_cpp, m) { m.attr(\"built\") = 1; }\n"
    sdist = make_sdist(tmp_path / "dl", "0.19.2", {
        "megatron/core/__init__.py": "", "megatron/training/__init__.py": "", "megatron/core/datasets/__init__.py": "",
        "megatron/core/datasets/helpers.cpp": helpers})
    assert bases.main(["prepare", str(sdist), "--dir", str(tmp_path / "bases")]) == 0
    (kept,) = json.loads((tmp_path / "bases/megatron_core-0.19.2.json").read_text())["helpers"].values()
    assert (tmp_path / "bases" / kept["file"]).is_file()
    real_command = helpers_build.build_command
    for damaged in (False, True):
        if damaged:
            (tmp_path / "bases" / kept["file"]).write_bytes(b"damaged")
            monkeypatch.setattr(helpers_build, "build_command", real_command)
        else:  # the prepared copy is taken: nothing is compiled
            monkeypatch.setattr(helpers_build, "build_command", lambda output: ["false"])
        with contextlib.ExitStack() as stack:
            trees, meta = bases.resolve(["upstream-0.19.2"], tmp_path / "bases", stack)
            folder = trees["upstream-0.19.2"] / "megatron/core/datasets"
            assert subprocess.run(["make", "-C", str(folder)], capture_output=True).returncode == 0
            env = B.job_env(os.environ, bases.run_env("upstream-0.19.2:no_db", trees, os.environ))
            probe = "from megatron.core.datasets import helpers_cpp; print(helpers_cpp.built)"
            done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
            assert done.stdout == "1\n", done.stderr
            assert "built from the release's helpers.cpp" in meta["upstream-0.19.2"]["dataset_helpers"]


def test_a_failure_far_above_torchruns_report_still_names_the_error() -> None:
    """Four ranks' torchrun report can be longer than the tail the summary keeps."""
    from hfsdp.bench.run import log_tail

    report = "".join(f"[{r}]:\n  time      : 2026-11-28_06:52:33\n  host      : gpu-host\n  rank      : {r}\n"
                     f"  exitcode  : 1 (pid: {5986 + r})\n  error_file: <N/A>\n  traceback : To enable traceback "
                     "see: https://pytorch.org/docs/stable/elastic/errors.html\n" for r in range(4)) * 4
    log = ("[rank0]: torch.AcceleratorError: CUDA error: operation would make the legacy stream depend on a "
           "capturing blocking stream\n" + "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
           + report)
    assert len(report) > 3000 and bases.last_error_line(log[-3000:]) is None
    assert bases.failure_line("upstream-0.19.2:te_maxpool_ub_graph", "rc=1", log_tail(log)) == (
        "upstream-0.19.2 te_maxpool_ub_graph: failed: torch.AcceleratorError: CUDA error: operation would make "
        "the legacy stream depend on a capturing blocking stream")
    assert log_tail("step 1\nstep 2\n") == "step 1\nstep 2\n"
    from hfsdp.environment import REPO_ROOT

    here = f'  File "{REPO_ROOT}/megatron/training/training.py", line 1983\n'
    assert log_tail(here) == '  File "megatron/training/training.py", line 1983\n'  # no machine's folders
