"""The patched ``training_log`` ([Note: host reads in a step]) on the CPU: it reads the norm and the loss scale
only at a log or TensorBoard iteration, and what it prints and writes there is what it prints and writes given the
host numbers upstream's ``train_step`` and ``train`` passed it (``HFSDP_HOST_READS_EVERY_STEP=1``).

Megatron's globals (arguments, timers, writers, the micro-batch count) are stood in for; one model-parallel rank.
"""

from __future__ import annotations

import re
import types

import pytest
import torch

from megatron.core import step_host_reads as shr
from megatron.training import training as T


class Timers:
    def __call__(self, name, log_level=None):
        return types.SimpleNamespace(elapsed=lambda barrier=False, reset=True: 0.5, start=lambda barrier=False: None,
                                     stop=lambda: None)

    def log(self, *args, **kwargs):
        pass

    def write(self, *args, **kwargs):
        pass


class Writer:
    def __init__(self):
        self.scalars: list[tuple[str, object, int]] = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def upstream_max(stat):
    """reduce_max_stat_across_model_parallel_group over one rank, on the CPU."""
    value = torch.tensor([-1.0 if stat is None else stat], dtype=torch.float32)
    return None if value.item() == -1.0 else value.item()


@pytest.fixture
def megatron_globals(monkeypatch):
    args = types.SimpleNamespace(
        log_interval=2, tensorboard_log_interval=4, timing_log_level=0, perform_rl_step=False, micro_batch_size=1,
        data_parallel_size=1, world_size=1, seq_length=8, consumed_train_samples=0, skipped_train_samples=0,
        log_loss_scale_to_tensorboard=True, log_world_size_to_tensorboard=False, log_memory_to_tensorboard=False,
        log_max_attention_logit=False, num_experts=None, mtp_num_layers=None, dsa_indexer_loss_coeff=None,
        record_memory_history=False, log_timers_to_tensorboard=False, log_throughput=False, log_energy=False,
        train_iters=4, rl_use_sequence_packing=False, log_memory_interval=None,
        gtp_weight_remat_size=1, rl_profile=False, freeze_all_layers=False)  # the last three: 0.19.2's
    writer = Writer()
    printed: list[str] = []
    monkeypatch.setattr(T, "get_args", lambda: args)
    monkeypatch.setattr(T, "get_timers", Timers)
    monkeypatch.setattr(T, "get_tensorboard_writer", lambda: writer)
    monkeypatch.setattr(T, "get_wandb_writer", lambda: None)
    monkeypatch.setattr(T, "get_one_logger", lambda: None)
    monkeypatch.setattr(T, "get_energy_monitor", lambda: None)
    monkeypatch.setattr(T, "get_num_microbatches", lambda: 1)
    monkeypatch.setattr(T, "num_floating_point_operations", lambda *a, **k: 1.0)
    monkeypatch.setattr(T, "print_rank_last", printed.append)
    monkeypatch.setattr(T.one_logger_utils, "track_app_tag", lambda *a, **k: None)
    monkeypatch.setattr(T.one_logger_utils, "track_e2e_metrics", lambda *a, **k: None)
    monkeypatch.setattr(T, "reduce_max_stat_across_model_parallel_group", upstream_max)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(shr, "_model_parallel_group", lambda group: object())
    monkeypatch.setattr(shr, "new_sum", lambda environ=None: torch.zeros(1))  # the CPU's accumulator
    return args, writer, printed


def run(iterations, norms, scale, *, host_numbers: bool):
    """training_log for ``iterations``, given what the fork's train_step/train hand it (device tensors) or, with
    ``host_numbers``, what upstream's hand it (floats read on the host)."""
    total: dict = {}
    for it, norm in zip(iterations, norms, strict=True):
        grad_norm = upstream_max(norm.item()) if host_numbers else shr.max_device_stat(norm, upstream_max, environ={})
        loss_scale = scale.item() if host_numbers else shr.loss_scale(scale, {})
        T.training_log({"lm loss": torch.tensor([3.0 - it / 8])}, total, 1e-4, it, loss_scale, False, 0, grad_norm,
                       None, None, None, is_first_iteration=it == 1)


def without_time(line: str) -> str:
    return re.sub(r"^ \[[^]]*\]", "", line)


def test_logged_and_written_values_are_upstreams(megatron_globals, monkeypatch):
    _, writer, printed = megatron_globals
    norms = [torch.tensor([v]) for v in (0.7314159, 1.5e-3, 2.0, 12.25)]
    run(range(1, 5), norms, torch.tensor([1.0]), host_numbers=False)
    fork = [without_time(line) for line in printed], list(writer.scalars)
    printed.clear(), writer.scalars.clear()
    run(range(1, 5), norms, torch.tensor([1.0]), host_numbers=True)
    assert [without_time(line) for line in printed] == fork[0]
    assert writer.scalars == fork[1]
    assert [it for it in (1, 2, 4) if any(f"iteration {it:8d}/" in line for line in fork[0])] == [1, 2, 4]
    assert "grad norm: 0.731 |" in fork[0][0] and " loss scale: 1.0 |" in fork[0][0]
    written = {tag: value for tag, value, _ in fork[1]}
    assert written["grad-norm"] == pytest.approx(12.25) and isinstance(written["grad-norm"], float)
    assert isinstance(written["loss-scale"], float)


def test_norm_and_scale_are_read_only_where_written(megatron_globals, monkeypatch):
    """Log iterations 1 (the first), 2 and 4, TensorBoard iteration 4: none of the reads at iteration 3."""
    reads: list[int] = []
    iteration = {"now": 0}
    for name in ("host_stat", "host_float"):
        real = getattr(shr, name)
        monkeypatch.setattr(shr, name, lambda value, real=real: (reads.append(iteration["now"]), real(value))[1])
    total: dict = {}
    for it in range(1, 5):
        iteration["now"] = it
        T.training_log({"lm loss": torch.tensor([2.0])}, total, 1e-4, it, torch.tensor([1.0]), False, 0,
                       torch.tensor([0.5]), None, None, None, is_first_iteration=it == 1)
    assert sorted(set(reads)) == [1, 2, 4] and reads.count(4) == 4  # iteration 4: TensorBoard and log
