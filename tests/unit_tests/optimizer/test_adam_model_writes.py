"""The optimizer step writes Megatron-FSDP's model weights ([Note: Adam writes the model weights]): the 5-list
kernel call for the parameters that have a model weight, the main-to-model copy for the rest, same bits."""

from __future__ import annotations

import pytest
import torch

from megatron.core.distributed.fsdp.src.megatron_fsdp.foreach_copy import copy_all
from megatron.core.optimizer import adam_model_writes as amw

ARGS = (1e-2, 0.9, 0.95, 1e-8, 3, 1, 1, 0.1)  # lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay


def reference_kernel(calls: list[tuple[int, tuple[torch.dtype, ...]]]):
    """TE's multi_tensor_adam on the CPU: 4 lists update p; 5 lists update the fifth (fp32) and write it,
    cast, into p. Records (number of lists, dtypes of p) per call."""

    def kernel(chunk_size, noop, lists, lr, beta1, beta2, eps, step, mode, bias_correction, decay):
        calls.append((len(lists), tuple(t.dtype for t in lists[1])))
        g, p, m, v = lists[:4]
        master = lists[4] if len(lists) == 5 else p
        if len(lists) == 5 and any(t.dtype != torch.float32 for t in master):
            raise RuntimeError("Master param tensor has dtype != Float32")  # as TE checks
        for gi, pi, mi, vi, wi in zip(g, p, m, v, master, strict=True):
            gf = gi.float()
            mi.mul_(beta1).add_(gf, alpha=1 - beta1)
            vi.mul_(beta2).addcmul_(gf, gf, value=1 - beta2)
            update = (mi / (1 - beta1**step)) / ((vi / (1 - beta2**step)).sqrt() + eps) + decay * wi
            wi.sub_(lr * update)
            if len(lists) == 5:
                pi.copy_(wi)

    return kernel


def make_state(seed: int):
    gen = torch.Generator().manual_seed(seed)
    sizes = (7, 130, 33, 5)
    mains = [torch.randn(n, generator=gen) for n in sizes]
    models = [w.to(torch.bfloat16) for w in mains[:3]]
    models[2] = mains[2].clone()  # an fp32 model weight: its own 5-list call
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in sizes]
    moments = [(torch.zeros(n), torch.zeros(n)) for n in sizes]
    return mains, models, grads, moments


def step(kernel, mains, grads, moments):
    kernel(2048, torch.zeros(1, dtype=torch.int), [list(grads), list(mains), [m for m, _ in moments],
                                                     [v for _, v in moments]], *ARGS)


def test_fused_step_and_copy_give_the_bits_of_step_then_copy(pair_buffer):
    calls_fused: list = []
    calls_plain: list = []
    mains_a, models_a, grads, moments_a = make_state(0)
    mains_b, models_b, _, moments_b = make_state(0)
    # The fourth main weight has no model weight (an FP8 parameter, say): the 4-list call steps it.
    pairs_a = [(model, main) for model, main in zip(models_a, mains_a[:3], strict=True)]
    buffer = pair_buffer(pairs_a)
    writes = amw.ModelWeightWrites([buffer])
    fused = amw.with_model_writes(reference_kernel(calls_fused), writes)
    plain = reference_kernel(calls_plain)
    for _ in range(3):
        step(fused, mains_a, grads, moments_a)
        copy_all(writes.unwritten(pairs_a))
        step(plain, mains_b, grads, moments_b)
        copy_all(list(zip(models_b, mains_b[:3], strict=True)))
    for a, b in zip([*mains_a, *models_a], [*mains_b, *models_b], strict=True):
        assert torch.equal(a, b)
    for (ma, va), (mb, vb) in zip(moments_a, moments_b, strict=True):
        assert torch.equal(ma, mb) and torch.equal(va, vb)
    assert calls_fused[:3] == [(4, (torch.float32,)), (5, (torch.bfloat16, torch.bfloat16)), (5, (torch.float32,))]
    assert calls_plain[0] == (4, (torch.float32,) * 4)


def test_the_copy_skips_what_the_step_wrote_and_only_once(pair_buffer):
    mains, models, grads, moments = make_state(1)
    pairs = list(zip(models, mains[:3], strict=True))
    writes = amw.ModelWeightWrites([pair_buffer(pairs)])
    step(amw.with_model_writes(reference_kernel([]), writes), mains, grads, moments)
    assert writes.unwritten(pairs) == []
    # No step since: a copy (a checkpoint load, say) copies every pair.
    assert [m.data_ptr() for m, _ in writes.unwritten(pairs)] == [m.data_ptr() for m in models]


def test_the_master_weights_form_passes_through(pair_buffer):
    calls: list = []
    mains, models, grads, moments = make_state(2)
    writes = amw.ModelWeightWrites([pair_buffer(list(zip(models, mains[:3], strict=True)))])
    lists = [grads[:1], models[:1], [moments[0][0]], [moments[0][1]], mains[:1]]
    amw.with_model_writes(reference_kernel(calls), writes)(2048, torch.zeros(1), lists, *ARGS)
    assert calls == [(5, (torch.bfloat16,))]
    assert writes.unwritten([(models[0], mains[0])]) == [(models[0], mains[0])]


def test_the_record_rereads_pairs_when_a_buffer_hands_new_ones(pair_buffer):
    mains, models, _, _ = make_state(3)
    buffer = pair_buffer([(models[0], mains[0])])
    writes = amw.ModelWeightWrites([buffer])
    assert writes.models_of(mains[:2])[1] is None
    buffer.pairs = [(models[0], mains[0]), (models[1], mains[1])]
    assert writes.models_of(mains[:2])[1].data_ptr() == models[1].data_ptr()


def te_adam_class(**attrs):
    cls = type("FusedAdam", (torch.optim.SGD,), {"__module__": "transformer_engine.pytorch.optimizers.fused_adam"})
    opt = cls([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    opt.multi_tensor_adam = reference_kernel([])
    opt.capturable = attrs.get("capturable", False)
    opt.master_weights = attrs.get("master_weights", False)
    return opt


@pytest.mark.parametrize(("attrs", "why"), [
    ({"capturable": True}, "capturable"),
    ({"master_weights": True}, "its own master weights"),
])
def test_install_refuses_what_calls_another_kernel(attrs, why, pair_buffer):
    opt = te_adam_class(**attrs)
    kernel = opt.multi_tensor_adam
    buffer = pair_buffer([])
    assert why in amw.refusal(opt, {})
    assert amw.install(opt, [buffer], {}) is None
    assert opt.multi_tensor_adam is kernel and buffer.model_weight_writes is None
    assert not amw.defer_clip(opt, 1.0, torch.tensor([4.0]))


def test_separate_model_copies_keep_the_triton_kernel_and_the_clip(pair_buffer):
    mains, models, grads, moments = make_state(10)
    pairs = list(zip(models, mains[:3], strict=True))
    opt = te_adam_class()
    calls: list = []
    opt.multi_tensor_adam = reference_kernel(calls)
    buffer = pair_buffer(pairs)
    env = {amw.SEPARATE_COPIES_ENV: "1"}
    assert "HFSDP_SEPARATE_MODEL_COPIES=1" in amw.refusal(opt, env)
    assert amw.install(opt, [buffer], env, reference_scale([])) is None
    assert buffer.model_weight_writes is None  # the copy copies every pair
    assert amw.defer_clip(opt, 1.0, torch.tensor([4.0]))  # the clip is taken
    step(opt.multi_tensor_adam, mains, grads, moments)
    assert calls == [(4, (torch.float32,) * 4)]  # one 4-list call: no model weight written
    assert amw.install(opt, [buffer], env, reference_scale([])) is None  # installed once only


def test_install_refuses_other_optimizers(pair_buffer):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert amw.refusal(opt, {}) == "SGD is not Transformer Engine's FusedAdam"
    assert amw.install(opt, [pair_buffer([])], {}) is None


def test_install_hands_the_record_to_every_buffer_and_the_newest_optimizer_wins(pair_buffer):
    mains, models, grads, moments = make_state(4)
    pairs = list(zip(models, mains[:3], strict=True))
    opt, newer = te_adam_class(), te_adam_class()
    buffers = [pair_buffer(pairs), pair_buffer([])]
    old = amw.install(opt, buffers, {})
    assert old is not None and all(b.model_weight_writes is old for b in buffers)
    new = amw.install(newer, buffers, {})
    assert new is not None and all(b.model_weight_writes is new for b in buffers)
    step(opt.multi_tensor_adam, mains, grads, moments)  # the older optimizer still steps: copied again
    assert buffers[0].model_weight_writes.unwritten(pairs) == pairs


def test_main_weights_that_are_not_fp32_keep_the_copy(pair_buffer):
    calls: list = []
    mains, models, grads, moments = make_state(5)
    mains = [w.to(torch.bfloat16) for w in mains]  # --megatron-fsdp-main-params-dtype bf16
    pairs = list(zip(models, mains[:3], strict=True))
    writes = amw.ModelWeightWrites([pair_buffer(pairs)])
    step(amw.with_model_writes(reference_kernel(calls), writes), mains, grads, moments)
    assert calls == [(4, (torch.bfloat16,) * 4)]
    assert writes.unwritten(pairs) == pairs


def test_a_refused_optimizer_removes_an_earlier_record(pair_buffer):
    mains, models, grads, moments = make_state(6)
    pairs = list(zip(models, mains[:3], strict=True))
    buffer = pair_buffer(pairs)
    opt = te_adam_class()
    assert amw.install(opt, [buffer], {}) is not None
    step(opt.multi_tensor_adam, mains, grads, moments)  # marks pending in the old record
    assert amw.install(te_adam_class(capturable=True), [buffer], {}) is None
    assert buffer.model_weight_writes is None  # the copy now copies every pair


def test_marks_are_dropped_when_a_buffer_storage_moves(pair_buffer):
    mains, models, grads, moments = make_state(7)
    pairs = list(zip(models, mains[:3], strict=True))
    buffer = pair_buffer(pairs)
    writes = amw.ModelWeightWrites([buffer])
    step(amw.with_model_writes(reference_kernel([]), writes), mains, grads, moments)
    moved = [(model.clone(), main) for model, main in pairs]  # new model-weight storage
    buffer.pairs = moved
    writes.models_of(mains[:3])  # the record sees the move
    assert [m.data_ptr() for m, _ in writes.unwritten(moved)] == [m.data_ptr() for m, _ in moved]
    # The old marks are gone too: a new view at a freed view's address is never skipped for them.
    assert writes.unwritten(pairs) == pairs


def test_the_first_copy_after_a_step_logs_and_warns_when_nothing_was_written(pair_buffer, caplog):
    mains, models, grads, moments = make_state(8)
    pairs = list(zip(models, mains[:3], strict=True))
    writes = amw.ModelWeightWrites([pair_buffer(pairs)])
    with caplog.at_level("INFO", logger=amw.logger.name):
        writes.unwritten(pairs)  # a load before any step: no line
        step(amw.with_model_writes(reference_kernel([]), writes), mains, grads, moments)
        writes.unwritten(pairs)
        step(amw.with_model_writes(reference_kernel([]), writes), mains, grads, moments)
        writes.unwritten(pairs)  # once only
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "The optimizer step wrote 3 model weights of a buffer; its main-to-model copy writes 0.")]
    stray = amw.ModelWeightWrites([pair_buffer([])])  # a step whose mains find no model weight
    with caplog.at_level("INFO", logger=amw.logger.name):
        step(amw.with_model_writes(reference_kernel([]), stray), mains, grads, moments)
        stray.unwritten(pairs)
    assert caplog.records[-1].levelname == "WARNING"


def reference_scale(calls: list[int]):
    """TE's multi_tensor_scale_tensor on the CPU: out = in * scale, in the output's dtype."""

    def scale_kernel(chunk_size, noop, lists, scale):
        calls.append(len(lists[0]))
        for src, dst in zip(*lists, strict=True):
            dst.copy_(src.float() * scale)

    return scale_kernel


def test_a_deferred_clip_scales_every_gradient_once_in_the_step(pair_buffer):
    """The clip coefficient handed to the step reaches every kernel call (4-list and 5-list), once a
    tensor, and gives the bits of Megatron's separate scale followed by the step."""
    mains_a, models_a, grads_a, moments_a = make_state(9)
    mains_b, models_b, grads_b, moments_b = make_state(9)
    scale = torch.tensor([0.25])
    writes = amw.ModelWeightWrites([pair_buffer(list(zip(models_a, mains_a[:3], strict=True)))])
    scaled: list[int] = []
    fused = amw.with_model_writes(reference_kernel([]), writes, {}, reference_scale(scaled))
    writes.grad_scale = scale
    step(fused, mains_a, grads_a, moments_a)
    assert sorted(scaled) == [1, 1, 2]  # the 4-list call, the fp32 model's call, the bf16 models' call
    reference_scale([])(2048, None, [grads_b, grads_b], scale)  # Megatron's clip, then the plain step
    step(reference_kernel([]), mains_b, grads_b, moments_b)
    for a, b in zip([*mains_a, *moments_a[0]], [*mains_b, *moments_b[0]], strict=True):
        assert torch.equal(a, b)


def test_defer_clip_hands_the_coefficient_to_an_installed_step_and_the_step_drops_it(pair_buffer):
    opt = te_adam_class()
    assert amw.install(te_adam_class(), [pair_buffer([])], {}) is not None
    assert not amw.defer_clip(opt, 1.0, torch.tensor([4.0]))  # not installed
    writes = amw.install(opt, [pair_buffer([])], {}, reference_scale([]))
    assert writes is not None
    assert amw.defer_clip(opt, 1.0, torch.tensor([4.0]))
    assert torch.equal(writes.grad_scale, 1.0 / (torch.tensor([4.0]) + 1.0e-6))
    assert amw.defer_clip(opt, 1.0, torch.tensor([0.5])) and writes.grad_scale.item() == 1.0  # at most 1
    opt.step()
    assert writes.grad_scale is None
    amw.defer_clip(opt, 1.0, torch.tensor([4.0]))
    opt.param_groups[0]["params"][0].grad = torch.zeros(1)
    opt.param_groups[0]["lr"] = "not a number"  # a step that raises still drops it
    with pytest.raises(TypeError):
        opt.step()
    assert writes.grad_scale is None


@pytest.mark.parametrize("case", ["other optimizer", "float norm", "separate clip", "no scale kernel"])
def test_defer_clip_leaves_the_scale_to_megatron(case, pair_buffer, monkeypatch):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1) if case == "other optimizer" \
        else te_adam_class()
    env = {amw.SEPARATE_CLIP_ENV: "1"} if case == "separate clip" else {}
    monkeypatch.setattr(amw, "megatron_scale_kernel", lambda: None)  # as on a CPU without TE
    amw.install(opt, [pair_buffer([])], env, None if case == "no scale kernel" else reference_scale([]))
    norm = 4.0 if case == "float norm" else torch.tensor([4.0])
    assert not amw.defer_clip(opt, 1.0, norm)
