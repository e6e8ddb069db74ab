"""Fixtures shared across test folders: a real ParamAndGradBuffer on CPU.

``cpu_fsdp_buffer`` builds Megatron-FSDP's ParamAndGradBuffer for real, with
``optim_grads_params`` and double buffering, over a ``fake`` process group of ``FAKE_DP``
ranks (this process is rank 0; collectives are no-ops). ``torch.cuda.current_device`` points
at the CPU while the buffer allocates its temporary buckets.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from fake_environments import fake_environment
from pristine_release import extract_pristine

FAKE_DP = 2
MAMBA_OPT_OUT = "HFSDP_WITH_MAMBA"  # =0: the Mamba tests may skip (scripts/setup_env.sh, run_tests.sh)


ROOT_SKIP = ("this process may write into a read-only folder (root with its capabilities); scripts/run_tests.sh "
             "runs this test again without them")


@functools.cache
def writes_anywhere() -> bool:
    """Whether this process may write into a folder whose mode forbids it (root, capabilities kept)."""
    probe = Path(tempfile.mkdtemp(prefix="hfsdp-lock-probe-"))
    try:
        probe.chmod(0o555)
        return os.access(probe, os.W_OK)
    finally:
        probe.chmod(0o755)
        probe.rmdir()


@pytest.fixture
def lock_folder() -> Iterator[Callable[[Path], Path]]:
    """``lock_folder(path)`` makes ``path`` (creating it) read-only for the test and writable again
    after it. The tests that use it (marked ``unprivileged``) skip where the process may write
    anyway; scripts/run_tests.sh runs them again as root without its capabilities."""
    if writes_anywhere():
        pytest.skip(ROOT_SKIP)
    locked: list[Path] = []

    def lock(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o555)
        locked.append(path)
        return path

    yield lock
    for path in locked:
        path.chmod(0o755)


Interrupted = tuple[int, tuple[str, str], bool]  # (the run's pid, proc.communicate(), whether it is gone)


@pytest.fixture
def sigterm_once_started() -> Callable[[subprocess.Popen, Path, float, float], Interrupted]:
    """``sigterm_once_started(proc, pidfile, start_s, gone_s)``: wait up to ``start_s`` for the run
    that ``proc`` launches to write its pid to ``pidfile``, SIGTERM ``proc``, collect its output,
    then give the run ``gone_s`` to disappear (a launcher must end the run it started)."""
    def run(proc: subprocess.Popen, pidfile: Path, start_s: float, gone_s: float) -> Interrupted:
        try:
            deadline = time.monotonic() + start_s
            while not (pidfile.is_file() and pidfile.read_text()) and time.monotonic() < deadline:
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.1)
            pid = int(pidfile.read_text())
            proc.send_signal(signal.SIGTERM)
            output = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        gone = time.monotonic() + gone_s
        while Path(f"/proc/{pid}").exists() and time.monotonic() < gone:
            time.sleep(0.1)
        return pid, output, not Path(f"/proc/{pid}").exists()

    return run


@pytest.fixture(scope="session")
def pristine_megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pinned release's own megatron/, extracted once per test session (pristine_release.py)."""
    return extract_pristine(tmp_path_factory.mktemp("pristine"))


@functools.cache
def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU here; asked once, in a child, so this process never touches CUDA."""
    code = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# [Note: skips in CI]
# CI (HFSDP_CI=1, set by .ci/run) is a CPU machine with everything the CPU tests need, so a skip
# there hides a test that never runs. It may skip a test only if the test needs GPUs (marker
# ``gpu``), or for a reason below: an opt-in service CI did not opt into, or root's capabilities,
# for the tests scripts/run_tests.sh runs again without them. Any other skip fails in CI.
ALLOWED_CI_SKIPS = (
    "set HFSDP_SLURM_CI=1",  # the one-node Slurm cluster (opt-in)
    "set HFSDP_NETWORK_TESTS=1",  # tests that talk to PyPI (opt-in)
    ROOT_SKIP,  # only while the unprivileged pass runs (HFSDP_UNPRIVILEGED_PASS=1)
)


def allowed_ci_skip(reason: str, gpu: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether CI may skip a test (see the note): it needs GPUs, or ``reason`` is listed."""
    if gpu:
        return True
    if ROOT_SKIP in reason:
        return environ.get("HFSDP_UNPRIVILEGED_PASS") == "1"
    return any(allowed in reason for allowed in ALLOWED_CI_SKIPS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """In CI, a skip the note does not allow becomes a failure that says why."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if os.environ.get("HFSDP_CI") != "1" or not report.skipped or getattr(report, "wasxfail", None):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")  # pytest's prefix of a skip's reason
    if not allowed_ci_skip(reason, item.get_closest_marker("gpu") is not None):
        report.outcome = "failed"
        report.longrepr = (f"skipped in CI ({reason}); CI allows only the skips ALLOWED_CI_SKIPS lists "
                           "(tests/unit_tests/conftest.py, [Note: skips in CI])")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that need an unprivileged user (``lock_folder``) are marked ``unprivileged``."""
    for item in items:
        if "lock_folder" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.unprivileged)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.no_cuda`` tests describe a machine without CUDA: they skip where torch sees a
    GPU. ``@pytest.mark.mamba`` tests need mamba_ssm (below)."""
    if item.get_closest_marker("no_cuda") is not None and cuda_available():
        pytest.skip("the test describes a machine without CUDA, and this one has a GPU")
    mamba_needed(item)


def mamba_needed(item: pytest.Item) -> None:
    """``@pytest.mark.mamba`` tests need mamba_ssm, imported the way Megatron imports it. Without
    it they fail, unless ``HFSDP_WITH_MAMBA=0`` opts out: then they skip, naming the opt-out. Mamba
    units are what this fork is for; a missing mamba_ssm must not pass their tests by skipping."""
    if item.get_closest_marker("mamba") is None:
        return
    from hfsdp.training.requirements import import_problem

    problem = import_problem("mamba_ssm")
    if problem is None:
        return
    if os.environ.get(MAMBA_OPT_OUT) == "0":
        pytest.skip(f"mamba_ssm does not import ({problem}); {MAMBA_OPT_OUT}=0 opts out of the Mamba tests")
    pytest.fail(f"mamba_ssm does not import the way Megatron imports it ({problem}): install it "
                f"({MAMBA_OPT_OUT}=1 . scripts/setup_env.sh, or pip install --no-build-isolation -e '.[ssm]'), "
                f"or opt out of the Mamba tests with {MAMBA_OPT_OUT}=0", pytrace=False)


# NVTE_* as the test session found them (conftest is imported before any test or fixture runs).
_NVTE_AT_START = {k: v for k, v in os.environ.items() if k.startswith("NVTE_")}


@pytest.fixture(autouse=True)
def restore_nvte_environment() -> Iterator[None]:
    """After each test, put NVTE_* back as the session found them.

    Building a model in-process runs Megatron's LanguageModule, which writes NVTE_FLASH_ATTN,
    NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN into os.environ from --attention-backend (also from
    module- or session-scoped fixtures, set up before this one); a later test's subprocess would
    inherit them and meet the TE argument check that rejects them.
    """
    yield
    for key in [k for k in os.environ if k.startswith("NVTE_")]:
        if key not in _NVTE_AT_START:
            del os.environ[key]
    os.environ.update(_NVTE_AT_START)


def _parse_megatron_args(monkeypatch: pytest.MonkeyPatch, flags: Sequence[str], world_size: int) -> Any:
    """Megatron's own ``parse_args`` on ``flags`` (every upstream flag and the fork's), as rank 0 of
    ``world_size``: it reads the command line from ``sys.argv`` and WORLD_SIZE/RANK from the
    environment, and sets ``args.world_size`` and ``args.rank`` from them."""
    import sys

    import megatron.training.arguments as arguments

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain", *flags])
    return arguments.parse_args()


@pytest.fixture
def call_cli(capsys: pytest.CaptureFixture[str]) -> Callable[[Callable[[list[str]], Any], list[str]], tuple[int, str]]:
    """``call(main, argv)`` -> (exit status, stdout + stderr) of a CLI's ``main`` run in-process;
    argparse's own usage errors (SystemExit) give their status too."""

    def call(main: Callable[[list[str]], Any], argv: list[str]) -> tuple[int, str]:
        capsys.readouterr()
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        out = capsys.readouterr()
        return int(rc or 0), out.out + out.err

    return call


@pytest.fixture
def megatron_args(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """``make(flags=(), **fields)`` -> the args Megatron's own ``parse_args`` gives ``flags`` as
    rank 0 of a world of 1 (before ``validate_args``), then ``fields`` set on them (e.g.
    ``world_size=2``).

    For unit tests of code that reads Megatron's args: it meets every field the parser defines,
    with its real default, as in training; a hand-built namespace would hide a misspelt field. A
    field in ``fields`` that the parsed args lack is refused (TypeError) for the same reason."""

    def make(flags: Sequence[str] = (), **fields: Any) -> Any:
        args = _parse_megatron_args(monkeypatch, flags, world_size=1)
        unknown = sorted(set(fields) - set(vars(args)))
        if unknown:
            raise TypeError(f"Megatron's parse_args sets no {', '.join(unknown)}")
        for name, value in fields.items():
            setattr(args, name, value)
        return args

    return make


@pytest.fixture
def megatron_validator(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Callable[[list[str]], Any]]:
    """``make(base_flags, world_size)`` -> ``run(extra_flags)``: the args after Megatron's own
    ``parse_args`` + ``validate_args``, on a CPU box (this process is rank 0 of ``world_size``)."""
    import megatron.training.arguments as arguments
    from hfsdp.training.assumed_device import assumed_device

    def make(base: Sequence[str], world_size: int) -> Callable[[list[str]], Any]:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)

        def run(extra: list[str]) -> Any:
            args = _parse_megatron_args(monkeypatch, [*base, *extra], world_size)
            with assumed_device():  # validate_args asks for the GPU; the entry's assumed one answers
                arguments.validate_args(args, {})
            return args

        return run

    return make


@pytest.fixture
def fake_dp_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_DP)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    yield
    dist.destroy_process_group()


@pytest.fixture
def cpu_fsdp_buffer(fake_dp_world: None) -> Callable[..., Any]:
    """``build(model, unit_classes, pool_scope="", **ddp_config_fields)`` -> a ParamAndGradBuffer on CPU
    (``pool_scope``: its double-buffer policy's, megatron_fsdp/model_pools.py)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

    def build(model: torch.nn.Module, unit_classes: Sequence[type], pool_scope: str = "", **ddp_kwargs: Any) -> Any:
        mesh = init_device_mesh("cpu", (FAKE_DP, 1), mesh_dim_names=("dp", "tp"))
        index = FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp",
                                     expt_device_mesh=mesh)
        cfg = DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params", use_distributed_optimizer=True,
            use_megatron_fsdp=True, fsdp_double_buffer=True, **ddp_kwargs)
        if pool_scope:
            from megatron.core.distributed.fsdp.src.megatron_fsdp.model_pools import with_pool_scope

            with_pool_scope(cfg, pool_scope)
        policy = pgb.BucketingPolicy(fsdp_unit_modules=list(unit_classes))
        return pgb.ParamAndGradBuffer(cfg, model, policy, index, device=torch.device("cpu"))

    return build


@pytest.fixture(autouse=True)
def fake_environment_probe(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "real_environment_probe" in request.keywords:
        return
    from hfsdp.functional import environment

    monkeypatch.setattr(environment, "probe", lambda environ=None: fake_environment())  # fake_environments.py
