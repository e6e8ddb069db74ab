"""The worker's host-profile writer (used to find host overhead in double buffering)."""

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
