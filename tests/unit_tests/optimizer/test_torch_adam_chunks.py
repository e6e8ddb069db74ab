"""Chunked torch Adam/AdamW: the same bits as one foreach step, groups restored (CPU)."""

import pytest
import torch

from megatron.core.optimizer.torch_adam_chunks import param_chunks, with_bounded_temporaries


def test_param_chunks_bound_the_elements_per_chunk():
    sizes = [3, 4, 10, 1, 1, 2]
    params = [torch.zeros(n) for n in sizes]
    chunks = list(param_chunks(params, 5))
    assert [[p.numel() for p in c] for c in chunks] == [[3], [4], [10], [1, 1, 2]]
    assert [p for c in chunks for p in c] == params  # order kept, nothing lost
    assert list(param_chunks([], 5)) == []
    with pytest.raises(ValueError, match="positive"):
        list(param_chunks(params, 0))


def _model(seed):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n)) for n in (7, 300, 5, 64, 64, 1000, 3)]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_chunked_step_is_bit_identical(cls):
    ref_params, new_params = _model(0), _model(0)

    def groups(params):  # two groups with different hyperparameters, as Megatron builds them
        return [{"params": params[:4], "weight_decay": 0.1},
                {"params": params[4:], "weight_decay": 0.0, "lr": 3e-4}]

    ref = cls(groups(ref_params), lr=1e-3, foreach=True)
    new = with_bounded_temporaries(cls, chunk_numel=100)(groups(new_params), lr=1e-3, foreach=True)
    assert isinstance(new, cls) and type(new).__name__ == f"Chunked{cls.__name__}"
    torch.manual_seed(1)
    for _ in range(4):
        grads = [torch.randn_like(p) for p in ref_params]
        for p, q, g in zip(ref_params, new_params, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        new.step()
        for p, q in zip(ref_params, new_params, strict=True):
            assert torch.equal(p, q)
    for p, q in zip(ref_params, new_params, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[p][key], new.state[q][key])
        assert float(ref.state[p]["step"]) == float(new.state[q]["step"]) == 4.0
    assert [len(g["params"]) for g in new.param_groups] == [4, 3]
    assert new.state_dict()["param_groups"] == ref.state_dict()["param_groups"]


def test_groups_are_restored_when_a_step_fails(step_fails):
    params = _model(0)
    opt = with_bounded_temporaries(torch.optim.AdamW, chunk_numel=10)(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    step_fails(opt, params)
