"""CPU tests of HFSDP_DIGEST_STEPS (hfsdp/step_digest.py): which records, when, and their values."""

from __future__ import annotations

import pytest
import torch

from hfsdp import step_digest


def test_parse_steps():
    assert step_digest.parse_steps("11,12") == {11, 12}
    assert step_digest.parse_steps("11-13, 20") == {11, 12, 13, 20}
    for bad in ("x", "13-11", "-1", ","):
        with pytest.raises(ValueError, match=step_digest.ENV):
            step_digest.parse_steps(bad)


def _run(steps, rank=0, n_steps=3, microbatches=2):
    """Train a 2-layer model for n_steps through the digest's hooks; return the emitted lines."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    lines: list[str] = []
    state = {"step": 0}
    d = step_digest.Digest(frozenset(steps), lambda: state["step"], rank, emit=lines.append)
    handles = step_digest.install_hooks(d)
    try:
        for step in range(1, n_steps + 1):
            state["step"] = step
            for _ in range(microbatches):
                model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        for h in handles:
            h.remove()
    return lines, model


def test_records_only_listed_steps_once_per_module():
    lines, _ = _run({2})
    fwd = [line for line in lines if " fwd " in line]
    # Sequential + 2 Linears run twice (2 micro-batches); only the Linears have parameters,
    # and each is recorded once: weight and bias of each, in call order.
    assert [line.split()[5] for line in fwd] == ["Linear.weight", "Linear.bias"] * 2
    assert [line.split()[4] for line in fwd] == ["idx=0", "idx=1", "idx=2", "idx=3"]
    assert all("step=2" in line for line in lines)
    opt = [line for line in lines if " opt " in line]
    assert [line.split()[4] for line in opt] == ["when=pre", "when=post"]
    assert "steps=[1.0]" in opt[0] and "steps=[2.0]" in opt[1]  # Adam's count, before/after


def test_forward_values_are_the_weights_in_use():
    lines, _ = _run({3})
    first = next(line for line in lines if "idx=0" in line)
    # Step 3's forward sees the weights after two optimizer steps (the current ones).
    _, after_two = _run(set(), n_steps=2)
    w = after_two[0].weight.detach().double()
    s, sq = (float(v) for v in first.split("sum=")[1].split(" sumsq="))
    assert s == pytest.approx(float(w.sum()), rel=1e-12, abs=1e-12)
    assert sq == pytest.approx(float((w * w).sum()), rel=1e-12)


def test_other_ranks_record_optimizer_state_only():
    lines, _ = _run({1}, rank=1)
    assert lines and all(" opt " in line and "rank=1" in line for line in lines)


def test_install_from_env_is_off_by_default():
    assert step_digest.install_from_env({}) is None


def test_install_from_env_maps_megatron_iterations_to_logged_steps(monkeypatch):
    import types

    import megatron.training

    d = step_digest.install_from_env({step_digest.ENV: "2", "RANK": "0"})
    try:
        assert d is not None and d.steps == {2} and len(d.handles) == 3
        # Before training (no curr_iteration) is step 0; curr_iteration counts completed steps.
        monkeypatch.setattr(megatron.training, "get_args", lambda: types.SimpleNamespace())
        assert d.current_step() == 0
        monkeypatch.setattr(megatron.training, "get_args",
                            lambda: types.SimpleNamespace(curr_iteration=1))
        assert d.current_step() == 2
    finally:
        for h in d.handles:
            h.remove()


def test_grad_groups_per_parameter_group():
    """Before the step: each group's gradient size and sum of squares, expert groups marked
    (Megatron's is_expert_parallel key); not after it."""
    dense, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    dense.grad, expert.grad = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0, 4.0])
    opt = torch.optim.SGD([{"params": [dense]}, {"params": [expert], "is_expert_parallel": True}], lr=0.1)
    lines: list[str] = []
    d = step_digest.Digest(frozenset({1}), lambda: 1, 0, emit=lines.append)
    d.optimizer_step(opt, "pre")
    d.optimizer_step(opt, "post")
    groups = lines[0].split("grad_groups=")[1].split()[0].split(",")
    assert [g.split(":")[0] for g in groups] == ["2", "3"] and groups[1].endswith("e")
    assert [float(g.split(":")[1].rstrip("e")) for g in groups] == pytest.approx([5.0, 25.0])
    assert "grad_groups" not in lines[1]


def test_optimizer_lines_list_every_state_tensor_kept_with_its_dtype_and_bytes():
    """What the optimizer keeps per parameter (a master copy would show here): AdamW's two fp32 moments
    of 4*3 + 3 + 3*1 + 1 = 19 elements, 76 bytes each; nothing before the first step."""
    lines, _ = _run({1, 2})
    opt = [line for line in lines if " opt " in line]
    assert opt[0].endswith(" state=none")  # step 1, before AdamW made its state
    assert opt[1].endswith(" state=exp_avg:float32:76,exp_avg_sq:float32:76"), opt[1]
