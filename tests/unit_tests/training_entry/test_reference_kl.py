"""examples/reference_kl/train.py's machinery (hfsdp/training/reference.py) on CPU: its flags, the
loss (a KL weight of 0 leaves the gradients bit-identical), the RNG guard, the batches the
trained model gets and when the reference is freed, and the reference's own DDP config."""

from __future__ import annotations

import dataclasses
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hfsdp.training import entries, reference
from hfsdp.training.reference_flags import ReferenceSettings, split_flags
from hfsdp.usererror import UserError

MEGATRON = ["--use-megatron-fsdp", "--hidden-size", "64", "--bf16"]


def test_the_example_flags_are_split_off_and_the_rest_is_megatrons() -> None:
    settings, rest = split_flags([*MEGATRON[:2], "--reference-kl-weight", "0", "--reference-free-after", "10",
                                  *MEGATRON[2:]])
    assert settings == ReferenceSettings(enabled=True, kl_weight=0.0, free_after=10)
    assert rest == MEGATRON
    assert split_flags(["--no-reference", *MEGATRON]) == (ReferenceSettings(enabled=False), MEGATRON)
    assert split_flags(MEGATRON)[0] == ReferenceSettings()


@pytest.mark.parametrize("argv, said", [
    (["--reference-kl-weight", "-1"], "-1.0 is not a finite number >= 0"),
    (["--reference-kl-weight", "nan"], "nan is not a finite number >= 0"),
    (["--reference-kl-weight", "x"], "takes a number"),
    (["--reference-free-after", "0"], "0 is not a step"),
    (["--no-reference", "--reference-free-after", "3"], "there is no reference to free"),
])
def test_bad_example_flags_are_one_sentence(argv: list[str], said: str) -> None:
    with pytest.raises(UserError, match=said):
        split_flags(argv)


def test_launchers_read_megatrons_part_of_each_entry() -> None:
    flags = [*MEGATRON, "--reference-kl-weight", "0.5"]
    assert entries.megatron_flags("examples/reference_kl/train.py", flags) == MEGATRON
    assert entries.megatron_flags("/repo/examples/reference_kl/train.py", flags) == MEGATRON
    assert entries.megatron_flags("pretrain_gpt.py", flags) == flags  # not the example's: untouched
    assert entries.training_entry("/x/pretrain_hybrid.py") == "pretrain_hybrid.py"
    assert entries.training_entry("train.py") is None and entries.training_entry("other/train.py") is None


def test_the_loader_type_is_the_users_and_megatron_gets_external() -> None:
    assert reference._loader_type(["--a", "1"]) == ("single", ["--a", "1", "--dataloader-type", "external"])
    assert reference._loader_type(["--dataloader-type", "cyclic", "--a"])[0] == "cyclic"
    assert reference._loader_type(["--dataloader-type=cyclic"]) == ("cyclic", ["--dataloader-type", "external"])
    with pytest.raises(UserError, match="builds the data loaders itself"):
        reference._loader_type(["--dataloader-type", "external"])


def _args(**over: Any) -> SimpleNamespace:
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                mtp_num_layers=None, use_megatron_fsdp=True)
    return SimpleNamespace(**{**base, **over})


@pytest.mark.parametrize("over, said", [
    ({"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size 2 splits them"),
    ({"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size 2"),
    ({"context_parallel_size": 2}, "--context-parallel-size 2"),
    ({"mtp_num_layers": 1}, "no multi-token prediction"),
    ({"use_megatron_fsdp": False}, "add --use-megatron-fsdp"),
    ({"cuda_graph_impl": "local"}, "--cuda-graph-impl local captures per-layer graphs"),
    ({"cuda_graph_impl": "transformer_engine"}, "would capture its layers too"),
])
def test_layouts_the_example_does_not_support_are_refused(over: dict[str, Any], said: str) -> None:
    reference.check_args(_args())
    reference.check_args(_args(cuda_graph_impl="full_iteration"))
    with pytest.raises(UserError, match=said):
        reference.check_args(_args(**over))


def _logits(seed: int, b: int = 2, s: int = 5, v: int = 11) -> torch.Tensor:
    return torch.randn(b, s, v, generator=torch.Generator().manual_seed(seed))


def test_the_cross_entropy_is_torchs_and_the_kl_of_a_copy_is_zero() -> None:
    logits, labels = _logits(0), torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    ce, kl = reference.token_losses(logits, labels, logits.clone())
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(ce.reshape(-1), want)
    assert kl is not None and torch.allclose(kl, torch.zeros_like(kl), atol=1e-6)
    _, kl_other = reference.token_losses(logits, labels, _logits(2))
    assert kl_other is not None and bool((kl_other > 0).all())
    with pytest.raises(ValueError, match=r"\(2, 5, 3\) do not match"):
        reference.token_losses(logits, labels, torch.zeros(2, 5, 3))


def _grad(weight: float | None, alive: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    logits = _logits(0).requires_grad_()
    labels = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 1, 0, 1], [1, 0, 1, 1, 1]])
    ref = None if weight is None else _logits(3)
    w = None if weight is None else torch.tensor([weight])
    loss, _, report = reference.loss_func(mask, labels, ref, w, torch.tensor([alive]), logits)
    loss.backward()
    assert logits.grad is not None
    return loss.detach(), logits.grad, report


def test_a_kl_weight_of_zero_leaves_the_loss_and_gradients_bit_identical() -> None:
    loss0, grad0, report0 = _grad(None)
    loss, grad, report = _grad(0.0)
    assert torch.equal(loss, loss0) and torch.equal(grad, grad0)
    assert torch.equal(report["lm loss"], report0["lm loss"]) and "reference kl" not in report0
    assert report["reference kl"][0] > 0 and report["reference kl"][1] == 8  # the unmasked tokens
    _, grad_kl, _ = _grad(0.5)
    assert not torch.equal(grad_kl, grad0)  # the term is trained on when weighted
    assert _grad(0.0, alive=0.0)[2]["reference kl"][0] == 0  # a freed reference reports none


def test_rng_states_are_restored_and_a_draw_is_named() -> None:
    before = reference.RngStates.capture()
    torch.rand(3)
    after = reference.RngStates.capture()
    assert "torch cpu" in after.differs_from(before)
    before.restore()
    assert reference.RngStates.capture().differs_from(before) == []


class FakeModel(torch.nn.Module):
    def __init__(self, vocab: int, draws: bool = False) -> None:
        super().__init__()
        self.vocab, self.draws, self.calls = vocab, draws, 0

    def forward(self, tokens: torch.Tensor, position_ids: Any, attention_mask: Any) -> torch.Tensor:
        self.calls += 1
        if self.draws:
            torch.rand(1)
        return torch.nn.functional.one_hot(tokens, self.vocab).to(torch.bfloat16)


class FakeReference(reference.Reference):
    def free(self) -> str:
        self.chunks = None
        return "freed"


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"tokens": torch.full((2, 4), i), "labels": torch.full((2, 4), i)} for i in range(n)]


def test_each_batch_gets_the_references_logits_until_it_is_freed_after_its_step() -> None:
    model = FakeModel(vocab=7).eval()
    ref = FakeReference([model])
    said: list[str] = []
    settings = ReferenceSettings(kl_weight=0.25, free_after=2)
    batches = reference.ReferenceBatches(iter(_batches(8)), ref, settings, lambda: 2, first_step=0, vocab=7,
                                         log=said.append, device=torch.device("cpu"))
    got = list(batches)
    assert model.calls == 4 and said == ["> reference model freed after step 2: freed"]  # steps 1-2: 2 batches each
    for i, batch in enumerate(got):
        assert torch.equal(batch["tokens"], torch.full((2, 4), i))  # each batch drawn once, in order
        alive = i < 4
        assert batch["ref_logits"].shape == (2, 4, 7) and batch["ref_logits"].dtype == torch.float32
        assert batch["kl_weight"].item() == (0.25 if alive else 0.0) and batch["ref_alive"].item() == float(alive)
        assert bool(batch["ref_logits"].any()) == alive  # zeros once freed


def test_a_reference_in_training_mode_or_drawing_random_numbers_is_refused() -> None:
    batch = _batches(1)[0]
    with pytest.raises(RuntimeError, match="eval mode"):
        reference.Reference([FakeModel(7).train()]).logits(batch)
    with pytest.raises(RuntimeError, match=r"drew random numbers \(torch cpu\)"):
        reference.Reference([FakeModel(7, draws=True).eval()]).logits(batch)
    freed = reference.Reference([FakeModel(7).eval()])
    freed.chunks = None
    with pytest.raises(RuntimeError, match="was freed"):
        freed.logits(batch)


def test_the_references_config_has_its_own_scope_and_no_double_buffer() -> None:
    from megatron.core.distributed import DistributedDataParallelConfig

    trained = DistributedDataParallelConfig(use_megatron_fsdp=True, megatron_fsdp_max_pool_double_buffer=True,
                                            data_parallel_sharding_strategy="optim_grads_params", nccl_ub=True)
    snapshot = dataclasses.asdict(trained)
    ref = reference.reference_ddp_config(trained)
    assert ref is not trained and dataclasses.asdict(trained) == snapshot  # the trained model's is untouched
    assert not (ref.fsdp_double_buffer or ref.megatron_fsdp_max_pool_double_buffer or ref.nccl_ub)
    assert ref.double_buffer_policy.pool_scope == reference.SCOPE and not ref.double_buffer_policy.double_buffer
    assert trained.double_buffer_policy.pool_scope == "" and trained.double_buffer_policy.max_pool


def test_the_trained_model_claims_its_scope_once_and_a_second_model_there_is_refused(cpu_fsdp_buffer,
                                                                                      monkeypatch) -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import model_pools

    monkeypatch.setattr(model_pools, "_owners", {})
    monkeypatch.setattr(reference, "_claimed", weakref.WeakSet())

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    class Wrapped:  # a wrapped chunk as model_buffers finds it (and weakly referable, as modules are)
        def __init__(self) -> None:
            self.param_and_grad_buffer = cpu_fsdp_buffer(Net(), [torch.nn.Linear])

    def model() -> Wrapped:
        return Wrapped()

    trained, other = model(), model()
    reference._claim_scope(trained)
    reference._claim_scope(trained)  # every later forward: nothing new
    assert list(reference._claimed) == [trained]
    with pytest.raises(ValueError, match="pool scope '' already belongs to another Megatron-FSDP model"):
        model_pools.check_scopes(other)
