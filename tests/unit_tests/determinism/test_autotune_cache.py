"""Triton's autotune disk cache, extended to kernels whose configs carry a pre_hook (CPU only:
the cache files and the choice, with Triton's real Config and cache manager; no kernel runs)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton import Config  # noqa: E402
from triton.runtime.cache import get_cache_manager  # noqa: E402

from hfsdp import autotune_cache  # noqa: E402

KEY = (4096, 64, "torch.bfloat16")


class FakeFn:
    __name__ = "_chunk_scan_bwd_dx_kernel"
    cache_key = "source-hash"


class FakeTuner:
    """What check_disk_cache reads and writes on Triton's Autotuner."""

    def __init__(self) -> None:
        self.fn = FakeFn()
        self.cache: dict = {}
        self.configs_timings: dict = {}


def candidates(hook_tag: str) -> list[Config]:
    def hook(nargs, reset_only=False):  # a fresh function per "process", as init_to_zero makes
        return hook_tag

    return [Config({"BLOCK_M": m, "BLOCK_N": 64}, num_warps=w, num_stages=3, pre_hook=hook)
            for m, w in ((64, 4), (128, 4), (128, 8))]


def original(self, tuning_key, configs, bench_fn):
    raise AssertionError("Triton's own path taken for pre_hook configs")


@pytest.fixture
def check(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    return autotune_cache.make_check_disk_cache(original, key_parts=lambda fn: ["tk", "backend", fn.cache_key, "[]"],
                                                cache_manager=get_cache_manager)


def bench(tuner: FakeTuner, configs: list[Config], times: list[float], calls: list[int]):
    def run() -> None:
        calls.append(1)
        tuner.configs_timings = {c: [t, t, t] for c, t in zip(configs, times, strict=True)}
        tuner.cache[KEY] = min(tuner.configs_timings, key=tuner.configs_timings.get)
    return run


def test_second_process_reuses_the_choice_with_its_own_hook(check):
    first, calls = FakeTuner(), []
    configs = candidates("first")
    assert check(first, KEY, configs, bench(first, configs, [3.0, 1.0, 2.0], calls)) is False
    assert calls == [1] and first.cache[KEY] is configs[1]

    second, later = FakeTuner(), candidates("second")
    assert check(second, KEY, later, bench(second, later, [9.0, 9.0, 0.5], calls)) is True
    assert calls == [1]  # not timed again
    chosen = second.cache[KEY]
    assert chosen is later[1]  # the live config, with the live hook
    assert chosen.pre_hook(None) == "second"
    assert set(second.configs_timings) == set(later)


def test_another_candidate_list_or_tuning_key_is_timed_again(check):
    calls: list[int] = []
    t1 = FakeTuner()
    configs = candidates("a")
    check(t1, KEY, configs, bench(t1, configs, [3.0, 1.0, 2.0], calls))
    fewer = candidates("b")[:2]
    t2 = FakeTuner()
    assert check(t2, KEY, fewer, bench(t2, fewer, [1.0, 2.0], calls)) is False
    t3 = FakeTuner()
    more = candidates("c")
    assert check(t3, (8192, 64, "torch.bfloat16"), more, bench(t3, more, [1.0, 2.0, 3.0], calls)) is False
    assert len(calls) == 3


@pytest.mark.parametrize("junk", ["", "{", '{"configs_timings": 3}', '{"configs_timings": [[{"BLOCK_M": 1}, 1.0]]}',
                                  '{"configs_timings": [[{"x": 1}, 1.0], [{"x": 1}, 1.0], [{"x": 1}, 1.0]]}'])
def test_a_file_that_does_not_time_exactly_these_candidates_is_timed_again_and_replaced(check, junk):
    configs = candidates("a")
    key = autotune_cache.cache_key(["tk", "backend", FakeFn.cache_key, "[]"], KEY, configs)
    get_cache_manager(key).put(junk, f"{FakeFn.__name__}.autotune.json", binary=False)
    calls: list[int] = []
    t1 = FakeTuner()
    assert check(t1, KEY, configs, bench(t1, configs, [3.0, 1.0, 2.0], calls)) is False
    t2, again = FakeTuner(), candidates("b")
    assert check(t2, KEY, again, bench(t2, again, [0.1, 5.0, 5.0], calls)) is True
    assert calls == [1] and t2.cache[KEY] is again[1]


def test_configs_without_hooks_take_tritons_own_path(tmp_path):
    seen = []
    patched = autotune_cache.make_check_disk_cache(lambda *a: seen.append(a) or True)
    plain = [Config({"BLOCK_M": 64}), Config({"BLOCK_M": 128})]
    assert patched(FakeTuner(), KEY, plain, lambda: None) is True
    assert len(seen) == 1


def test_install_is_idempotent_and_keeps_the_original_for_plain_kernels():
    class Tuner:
        def check_disk_cache(self, tuning_key, configs, bench_fn):
            return "triton"

    assert autotune_cache.install(Tuner) is True
    assert autotune_cache.install(Tuner) is False
    assert Tuner().check_disk_cache(KEY, [Config({"BLOCK_M": 64})], lambda: None) == "triton"

    class Old:  # a Triton without a disk cache: nothing to extend
        pass

    assert autotune_cache.install(Old) is False


def test_tritons_autotuner_still_has_the_method_we_extend():
    """The name and signature install() replaces: a Triton upgrade that renames it fails here."""
    import inspect

    from triton.runtime.autotuner import Autotuner

    assert list(inspect.signature(Autotuner.check_disk_cache).parameters) == ["self", "tuning_key", "configs",
                                                                              "bench_fn"]


def test_a_key_that_cannot_be_computed_falls_back_to_tritons_own_path(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    seen = []

    def broken(fn):
        raise RuntimeError("0 active drivers")

    patched = autotune_cache.make_check_disk_cache(lambda *a: seen.append(a) or False, key_parts=broken,
                                                   cache_manager=get_cache_manager)
    assert patched(FakeTuner(), KEY, candidates("a"), lambda: None) is False
    assert len(seen) == 1


def test_a_candidate_that_cannot_run_keeps_its_infinite_time(check):
    """Triton times a config that cannot run here as inf; the file (strict JSON) holds null, and a
    later process reads inf back, so the choice is the same."""
    import math

    first, calls = FakeTuner(), []
    configs = candidates("a")
    check(first, KEY, configs, bench(first, configs, [math.inf, 2.0, 1.0], calls))
    second, later = FakeTuner(), candidates("b")
    assert check(second, KEY, later, bench(second, later, [0.1, 0.1, 0.1], calls)) is True
    assert calls == [1] and second.cache[KEY] is later[2]
    assert second.configs_timings[later[0]] == [math.inf] * 3
