"""CPU tests of the benchmark worker: host-profile writer and the data iterator train_step needs."""

from __future__ import annotations

import cProfile

from hfsdp.bench.worker import write_pyprofile


def _busy_grad_getter(n: int) -> int:
    return sum(i * i for i in range(n))


def test_pyprofile_names_the_hot_function(tmp_path):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        _busy_grad_getter(2000)
    prof.disable()
    out = tmp_path / "sub" / "maxpool-r0-rank0.pstats.txt"
    write_pyprofile(prof, str(out), steps=3)
    text = out.read_text()
    assert text.startswith("cProfile over 3 timed steps")
    assert "_busy_grad_getter" in text and "tottime" in text


def test_data_iterator_is_accepted_by_train_steps_rerun_check():
    """train_step's rerun state machine rejects a bare generator (it failed on GPU once)."""
    from types import SimpleNamespace

    import pytest

    from hfsdp.bench.worker import data_iterator, synthetic_batches
    from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

    args = SimpleNamespace(micro_batch_size=2, seq_length=8, padded_vocab_size=32)
    it = data_iterator(args)
    # Megatron's default mode (validate_results) runs the check that raised on the GPU.
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    assert machine._sanitize_data_iterators(it) == [it]
    with pytest.raises(AssertionError, match="not wrapped with RerunDataIterator"):
        machine._sanitize_data_iterators(synthetic_batches(args))
    batch = next(it)
    assert batch["tokens"].shape == (2, 8) and batch["labels"].shape == (2, 8)
    assert batch["attention_mask"].shape == (1, 1, 8, 8)
