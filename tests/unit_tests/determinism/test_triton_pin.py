"""CPU tests of HFSDP_TRITON_PIN_AUTOTUNE (hfsdp/determinism.py)."""

from __future__ import annotations

import builtins

import pytest

from hfsdp import determinism

INF = float("inf")


class FakeAutotuner:
    """Triton's Autotuner as far as the pin touches it: prune, then time each candidate."""

    def __init__(self, configs, times, reject=()):
        self.configs, self.times, self.reject = configs, times, set(reject)

    def prune_configs(self, kwargs):
        return [c for c in self.configs if c not in self.reject]

    def _bench(self, *args, config, **meta):
        return [self.times[config]] * 3

    def choose(self):
        """What Autotuner.run does with the timings: the fastest candidate wins."""
        timings = {c: self._bench(config=c) for c in self.prune_configs({})}
        return min(timings, key=timings.get)


def fresh_class():
    return type("Autotuner", (FakeAutotuner,), {})


def test_unpinned_choice_follows_the_clock():
    tuner = fresh_class()(["a", "b", "c"], {"a": 3.0, "b": 1.0, "c": 2.0})
    assert tuner.choose() == "b"


def test_pinned_choice_follows_candidate_order_not_the_clock():
    cls = fresh_class()
    assert determinism.pin_autotuner_class(cls) is True
    assert determinism.pin_autotuner_class(cls) is False  # idempotent: no double wrap
    for times in ({"a": 3.0, "b": 1.0, "c": 2.0}, {"a": 1.0, "b": 3.0, "c": 0.5}):
        assert cls(["a", "b", "c"], times).choose() == "a"


def test_pinned_choice_skips_unrunnable_and_pruned_candidates():
    cls = fresh_class()
    determinism.pin_autotuner_class(cls)
    # 'a' is out of resources on this GPU (Triton reports inf): the next runnable one wins.
    assert cls(["a", "b", "c"], {"a": INF, "b": 9.0, "c": 1.0}).choose() == "b"
    # The kernel's own pruning runs first: a pruned candidate is never chosen.
    assert cls(["a", "b", "c"], {"a": 1.0, "b": 9.0, "c": 1.0}, reject={"a"}).choose() == "b"


def test_env_off_by_default_and_rejects_bad_values():
    assert determinism.pin_triton_autotune_from_env({}) is False
    assert determinism.pin_triton_autotune_from_env({determinism.ENV: "0"}) is False
    with pytest.raises(ValueError, match="HFSDP_TRITON_PIN_AUTOTUNE='yes'"):
        determinism.pin_triton_autotune_from_env({determinism.ENV: "yes"})


def test_missing_triton_is_logged_not_fatal(monkeypatch, caplog):
    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name.startswith("triton"):
            raise ImportError("no triton here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    assert determinism.pin_triton_autotune_from_env({determinism.ENV: "1"}) is False
    assert "triton is not installed" in caplog.text


def _real_tuner(autotuner, clock, cache_results=False, unrunnable=(), bench_calls=None,
                launches=None):
    """A real triton Autotuner around a stub kernel; do_bench reads a fake clock per config.

    A config in ``unrunnable`` raises Triton's OutOfResources at launch, as a too-large block
    does on a real GPU; ``bench_calls`` (a list) records each do_bench call and ``launches``
    each kernel launch (its BLOCK).
    """
    from triton.runtime.errors import OutOfResources

    def kernel(x, BLOCK):  # Autotuner walks .fn down to a plain function
        pass

    class StubKernel:
        arg_names, fn, last = ["x"], staticmethod(kernel), None

        def run(self, *args, BLOCK, **kwargs):
            if launches is not None:
                launches.append(BLOCK)
            if BLOCK in unrunnable:
                raise OutOfResources(BLOCK * 1024, 228 * 1024, "shared memory")
            StubKernel.last = BLOCK
            return BLOCK

    def do_bench(kernel_call, quantiles):
        if bench_calls is not None:
            bench_calls.append(1)
        kernel_call()
        return [clock[StubKernel.last]] * 3

    configs = [autotuner.Config({"BLOCK": b}) for b in clock]
    return autotuner.Autotuner(StubKernel(), ["x"], configs, ["x"], None, None, do_bench=do_bench,
                               cache_results=cache_results)


def test_real_triton_autotuner_run_is_pinned(monkeypatch):
    autotuner = pytest.importorskip("triton.runtime.autotuner")
    # monkeypatch restores the real methods after the test (other tests may use Triton).
    for name in ("prune_configs", "_bench"):
        monkeypatch.setattr(autotuner.Autotuner, name, getattr(autotuner.Autotuner, name))
    clock = {64: 5.0, 128: 1.0, 256: 0.5}
    calls: list[int] = []
    # Unpinned: every runnable candidate is timed by do_bench, the fastest runnable one wins.
    assert _real_tuner(autotuner, clock, unrunnable={256}, bench_calls=calls).run(7) == 128
    assert len(calls) == 3
    assert determinism.pin_triton_autotune_from_env({determinism.ENV: "1"}) is True
    calls.clear()
    assert _real_tuner(autotuner, clock, unrunnable={256}, bench_calls=calls).run(7) == 64
    # Pinned: the first runnable candidate wins, and nothing is timed (one launch each).
    assert calls == []
    assert _real_tuner(autotuner, clock, unrunnable={64}).run(7) == 128
    tuner = _real_tuner(autotuner, clock, unrunnable={64})
    tuner.run(7)
    assert tuner.do_bench is not determinism._launch_once  # the tuner's own bench is restored
    # A TRITON_CACHE_AUTOTUNING entry holds real timings: the pinned tuner must not read it.
    cached = _real_tuner(autotuner, clock, cache_results=True)
    monkeypatch.setattr(cached, "check_disk_cache",
                        lambda *a, **k: pytest.fail("pinned autotuner read the disk cache"))
    assert cached.run(7) == 64


class _PropertyBenchTuner:
    """An autotuner whose do_bench is a plain property over _do_bench (no instance override)."""

    configs = ["a", "boom"]

    def __init__(self):
        self._do_bench = "timed"

    @property
    def do_bench(self):
        return self._do_bench

    def prune_configs(self, kwargs):
        return ["a"]

    def _bench(self, *args, config, **meta):
        seen.append(self.do_bench)
        if config == "boom":
            raise RuntimeError("launch failed")
        return [1.0] * 3


seen: list = []


@pytest.mark.parametrize("instance_value", [True, False])
def test_bench_swap_is_restored_even_when_the_launch_raises(instance_value):
    cls = type("Autotuner", (FakeAutotuner,), {})
    determinism.pin_autotuner_class(cls)
    tuner = cls(["a"], {"a": 1.0})
    if instance_value:
        tuner.do_bench = "timed"  # Triton 3.7: a cached_property value in the instance dict
    tuner.prune_configs({})  # starts a round, as Triton's run() does before benching
    tuner._bench(config="a")
    tuner.prune_configs({})
    with pytest.raises(KeyError):
        tuner._bench(config="missing")  # the wrapped bench raises (FakeAutotuner's clock)
    assert tuner.__dict__.get("do_bench", None) == ("timed" if instance_value else None)


def test_bench_swap_targets_the_backing_field_of_a_property():
    seen.clear()
    determinism.pin_autotuner_class(_PropertyBenchTuner)
    tuner = _PropertyBenchTuner()
    tuner.prune_configs({})
    tuner._bench(config="a")
    assert seen == [determinism._launch_once] and tuner.do_bench == "timed"
    tuner.prune_configs({})
    with pytest.raises(RuntimeError):
        tuner._bench(config="boom")
    assert tuner._do_bench == "timed"


def test_pinned_tuner_never_launches_candidates_after_the_first_runnable(monkeypatch):
    autotuner = pytest.importorskip("triton.runtime.autotuner")
    for name in ("prune_configs", "_bench"):
        monkeypatch.setattr(autotuner.Autotuner, name, getattr(autotuner.Autotuner, name))
    determinism.pin_triton_autotune_from_env({determinism.ENV: "1"})
    clock = {64: 5.0, 128: 1.0, 256: 0.5, 512: 0.1}
    launches: list[int] = []
    # 64 cannot run, 128 runs: 256 and 512 are never launched (nor compiled); then the real call.
    assert _real_tuner(autotuner, clock, unrunnable={64}, launches=launches).run(7) == 128
    assert launches == [64, 128, 128]
    launches.clear()
    tuner = _real_tuner(autotuner, clock, launches=launches)
    assert tuner.run(7) == 64 and tuner.run(8) == 64  # a new key is a new round
    assert launches == [64, 64, 64, 64]
