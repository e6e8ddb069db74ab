"""A frozen reference model next to the trained one: the trained model's loss plus a KL term.

[Note: a frozen reference model] RL with a frozen reference and on-policy distillation run two
Megatron-FSDP models in one process. ``examples/reference_kl/train.py`` is the starting point;
this module is its machinery, on top of the usual entry (entry.py):

* **Two models, two policies.** The trained model is wrapped by ``pretrain`` as any other; the
  reference by :func:`build_reference`, with its own ``DistributedDataParallelConfig``: no double
  buffer, no NCCL user buffers, pool scope :data:`SCOPE`, and every parameter frozen, so
  Megatron-FSDP gives it no gradient or main-weight buffer. Its forward runs eagerly, so stable
  addresses would buy it nothing. ``model_pools.check_scopes`` claims both scopes. The process's
  communicators are shared on purpose; ``parallel_state`` owns them (model_pools.py).
* **Where its forward runs.** In the data path: :class:`ReferenceBatches` draws each micro-batch
  once, runs the reference forward on it (eval mode, no autograd) and hands the trained model the
  batch plus ``ref_logits`` and ``kl_weight``. Megatron's full-iteration graph reads every
  micro-batch of a step before it replays, so the reference forward always runs eager, outside
  the captured step, and its logits enter the graph as static inputs. Nothing captured reads the
  reference's memory: freeing it never invalidates the graph.
* **No batch or random number of its own.** The reference shares the trained model's batches.
  It is built from the RNG state the trained model was built from (so it starts as a copy of
  the trained model's initial weights), and the process's RNG states are restored afterwards;
  every reference forward is checked to leave them unchanged (:class:`RngStates`).
* **Freeing it.** ``--reference-free-after N`` frees the reference before the first batch of the
  first step after N (``model_pools.release_model_pools``, then the model itself); the steps after
  get zero logits and a KL weight of 0, in the same static inputs (fp32 ``[b, s, vocab]``).
* **The loss.** ``lm loss`` is the token cross entropy from the trained model's logits; the
  loss trained on adds ``kl_weight * KL(reference || trained)`` per token. With weight 0 the
  gradients are the cross entropy's exactly (``g + 0 == g``), so the run is bit-identical to the
  same script with ``--no-reference``.

Limits: tensor, pipeline and context parallel size 1, no multi-token prediction, no per-layer
CUDA graphs (refused in one sentence by :func:`check_args`); the reference has the trained model's
architecture and flags.
"""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from hfsdp.training.reference_flags import ReferenceSettings, split_flags
from hfsdp.usererror import UserError

SCOPE = "reference"  # the reference model's pool scope (model_pools.py)
EXTRA_KEYS = ("ref_logits", "kl_weight", "ref_alive")


def check_args(args: Any) -> None:
    """The layouts the example supports: one sentence for any other."""
    sizes = {"--tensor-model-parallel-size": args.tensor_model_parallel_size,
             "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
             "--context-parallel-size": args.context_parallel_size}
    bad = {k: v for k, v in sizes.items() if v != 1}
    if bad:
        raise UserError(f"the reference example computes the KL term on full-vocabulary logits of whole "
                        f"sequences, and {', '.join(f'{k} {v}' for k, v in bad.items())} splits them",
                        "run it with data parallelism only (Megatron-FSDP shards the models)")
    if getattr(args, "mtp_num_layers", None):
        raise UserError("the reference example has no multi-token prediction loss",
                        "drop --mtp-num-layers")
    if not args.use_megatron_fsdp:
        raise UserError("the reference example wraps both models with Megatron-FSDP", "add --use-megatron-fsdp")
    graphs = getattr(args, "cuda_graph_impl", "none")
    if graphs not in ("none", "full_iteration"):
        raise UserError(f"--cuda-graph-impl {graphs} captures per-layer graphs, and the reference model, built from "
                        "the same flags, would capture its layers too", "give --cuda-graph-impl full_iteration, "
                        "which keeps the reference's forward eager, or none")


# --- RNG -------------------------------------------------------------------------------------------


def _tracker_states() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker().states_


@dataclass(frozen=True)
class RngStates:
    """The process's random states: Python, torch CPU and CUDA, and Megatron's CUDA RNG tracker
    (state tensors, or graph-safe generators, restored in place: a captured graph holds them)."""

    python: Any
    cpu: torch.Tensor
    cuda: torch.Tensor | None
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls) -> RngStates:
        tracker = {n: (s.get_state() if isinstance(s, torch.Generator) else s.clone())
                   for n, s in _tracker_states().items()}
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return cls(random.getstate(), torch.get_rng_state(), cuda, tracker)

    def restore(self) -> None:
        random.setstate(self.python)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        states = _tracker_states()
        for name, state in self.tracker.items():
            if isinstance(states.get(name), torch.Generator):
                states[name].set_state(state)
            else:
                states[name] = state.clone()

    def differs_from(self, other: RngStates) -> list[str]:
        """Which states differ (empty: none)."""
        out = [] if self.python == other.python else ["python"]
        out += [] if torch.equal(self.cpu, other.cpu) else ["torch cpu"]
        if (self.cuda is None) != (other.cuda is None) or (
                self.cuda is not None and other.cuda is not None and not torch.equal(self.cuda, other.cuda)):
            out.append("torch cuda")
        for name in sorted(set(self.tracker) | set(other.tracker)):
            a, b = self.tracker.get(name), other.tracker.get(name)
            if a is None or b is None or not torch.equal(a, b):
                out.append(f"tracker {name}")
        return out


# --- the loss --------------------------------------------------------------------------------------


def token_losses(logits: torch.Tensor, labels: torch.Tensor, ref_logits: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token cross entropy, and ``KL(reference || trained)`` per token where a reference is
    given; ``logits`` and ``ref_logits`` are ``[b, s, vocab]``, ``labels`` ``[b, s]``."""
    if ref_logits is not None and ref_logits.shape != logits.shape:
        raise ValueError(f"reference logits {tuple(ref_logits.shape)} do not match the trained model's "
                         f"{tuple(logits.shape)}")
    logp = torch.log_softmax(logits.float(), dim=-1)
    ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if ref_logits is None:
        return ce, None
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)
    return ce, kl


def loss_func(loss_mask: torch.Tensor, labels: torch.Tensor, ref_logits: torch.Tensor | None,
              kl_weight: torch.Tensor | None, ref_alive: torch.Tensor | None, logits: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's 3-tuple: the summed loss, the token count and the reports ``[sum, count]``;
    ``reference kl`` is reported as 0 once the reference is freed (``ref_alive`` 0)."""
    ce, kl = token_losses(logits, labels, ref_logits)
    mask = loss_mask.view(-1).float()
    ce_sum = torch.sum(ce.view(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    count = num_tokens.detach().float()
    report = {"lm loss": torch.stack([ce_sum.detach().clone(), count])}
    if kl is None:
        return ce_sum, num_tokens, report
    if kl_weight is None or ref_alive is None:
        raise ValueError("reference logits without a KL weight or liveness")
    kl_sum = torch.sum(kl.view(-1) * mask)
    report["reference kl"] = torch.stack([kl_sum.detach() * ref_alive.reshape(()), count])
    return ce_sum + kl_weight.reshape(()) * kl_sum, num_tokens, report


_claimed: weakref.WeakSet[Any] = weakref.WeakSet()  # the trained model, once its scope is claimed


def _claim_scope(model: Any) -> None:
    """Claim the trained model's pool scope at its first forward (model_pools.check_scopes): a
    second model in that scope is refused, as the reference's was checked when it was wrapped."""
    if model in _claimed:
        return
    from megatron.core.distributed.fsdp.src.megatron_fsdp import model_pools

    model_pools.check_scopes(model)
    _claimed.add(model)


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]] | None, model: Any,
                 return_schedule_plan: bool = False) -> tuple[torch.Tensor, Any]:
    """The trained model's forward: its logits, and :func:`loss_func` over them."""
    from hfsdp.training import forward_step as fs
    from hfsdp.training import run_report

    assert not return_schedule_plan, "combined 1F1B schedule plans are not supported here"
    run_report.note_forward_step(model)
    _claim_scope(model)
    batch = fs.get_batch(data_iterator, getattr(model, "vp_stage", None), extra_keys=EXTRA_KEYS)
    logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    if batch["loss_mask"] is None or batch["labels"] is None:
        raise RuntimeError("the reference example runs one pipeline stage, which has the labels")
    return logits, partial(loss_func, batch["loss_mask"], batch["labels"], batch["ref_logits"], batch["kl_weight"],
                           batch["ref_alive"])


# --- the reference model ---------------------------------------------------------------------------


def reference_ddp_config(ddp_config: Any) -> Any:
    """The reference's config: the trained model's, with no double buffer, no NCCL user buffers and
    its own pool scope (its policy rebuilt from these settings)."""
    import dataclasses

    from megatron.core.distributed.fsdp.src.megatron_fsdp import model_pools

    off = {f: False for f in ("fsdp_double_buffer", "megatron_fsdp_max_pool_double_buffer", "nccl_ub",
                              "fsdp_manual_registration") if hasattr(ddp_config, f)}
    return model_pools.with_pool_scope(dataclasses.replace(ddp_config, **off), SCOPE)


class Reference:
    """The frozen reference model: built once, run forward only, freed once."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks: list[Any] | None = chunks

    @property
    def alive(self) -> bool:
        return self.chunks is not None

    @torch.no_grad()
    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.chunks is None:
            raise RuntimeError("the reference model was freed")
        before = RngStates.capture()
        model = self.chunks[0]
        if model.training:
            raise RuntimeError("the reference model must run in eval mode")
        out = model(batch["tokens"], batch.get("position_ids"), batch.get("attention_mask"))
        changed = RngStates.capture().differs_from(before)
        if changed:
            raise RuntimeError(f"the reference forward drew random numbers ({', '.join(changed)}): it must run "
                               "in eval mode with no dropout of its own")
        return out

    def free(self) -> str:
        """Release the reference's pools and drop the model; returns the log line's facts."""
        from megatron.core.distributed.fsdp.src.megatron_fsdp import model_pools

        if self.chunks is None:
            raise RuntimeError("the reference model was already freed")
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if cuda else 0
        released = model_pools.release_model_pools(self.chunks, graph_live=False)  # its forward is never captured
        self.chunks = None
        gc.collect()
        freed = f", {before - torch.cuda.memory_allocated()} B of GPU memory returned" if cuda else ""
        return (f"scope {released.scope!r}, {len(released.arenas)} arenas ({released.arena_bytes} B), "
                f"{released.deregistered} NCCL registrations undone{freed}")


def build_reference(model_provider: Callable[..., Any], rng: RngStates) -> Reference:
    """Wrap a frozen copy of the model (the trained model's initial weights: built from ``rng``,
    the state the trained model was built from) in its own Megatron-FSDP config; the process's RNG
    states are as before."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp import model_pools
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.training import get_args
    from megatron.training.training import get_megatron_ddp_config, get_model, wrap_model_chunks_with_ddp

    now = RngStates.capture()
    rng.restore()
    try:
        chunks = get_model(model_provider, ModelType.encoder_or_decoder, wrap_with_ddp=False)
    finally:
        now.restore()
    for chunk in chunks:
        chunk.requires_grad_(False)  # no gradient or main-weight buffer for it
    ddp_config = reference_ddp_config(get_megatron_ddp_config(get_args()))
    wrapped = wrap_model_chunks_with_ddp(chunks, get_model_config(chunks[0]), ddp_config,
                                         DP=FullyShardedDataParallel)
    for chunk in wrapped:
        chunk.eval()
    model_pools.check_scopes(wrapped)
    return Reference(wrapped)


class ReferenceBatches:
    """Each micro-batch drawn once, with the reference's logits and the KL weight added (the note)."""

    def __init__(self, batches: Iterator[dict[str, Any]], reference: Reference, settings: ReferenceSettings,
                 micro_batches_per_step: Callable[[], int], first_step: int, vocab: int,
                 log: Callable[[str], None] = print, device: torch.device | None = None) -> None:
        self.batches = batches
        self.reference = reference
        self.settings = settings
        self.per_step = micro_batches_per_step
        self.step = first_step + 1  # the step the next batch belongs to
        self.left = 0  # batches of that step still to draw
        self.vocab = vocab  # the logits' last dimension (the padded vocabulary)
        self.log = log
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        self._zeros: torch.Tensor | None = None

    def __iter__(self) -> ReferenceBatches:
        return self

    def __next__(self) -> dict[str, Any]:
        raw = next(self.batches)
        if self.left == 0:
            self.left = self.per_step()
            self._start_step()
        self.left -= 1
        batch = dict(raw)
        device = self.device
        if self.reference.alive:
            on_gpu = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                      for k, v in raw.items()}
            logits = self.reference.logits(on_gpu).float()
            weight, alive = self.settings.kl_weight, 1.0
        else:  # the same static inputs, weighted 0
            if self._zeros is None:
                self._zeros = torch.zeros(*raw["tokens"].shape, self.vocab, device=device)
            logits, weight, alive = self._zeros, 0.0, 0.0
        batch["ref_logits"] = logits
        batch["kl_weight"] = torch.tensor([weight], dtype=torch.float32)
        batch["ref_alive"] = torch.tensor([alive], dtype=torch.float32)
        return batch

    def _start_step(self) -> None:
        step, self.step = self.step, self.step + 1
        after = self.settings.free_after
        if after is not None and step > after and self.reference.alive:
            self.log(f"> reference model freed after step {after}: {self.reference.free()}")


# --- the entry -------------------------------------------------------------------------------------

EXTERNAL = "external"  # Megatron's --dataloader-type that takes the provider's iterators as they are


def _loader_type(argv: list[str]) -> tuple[str, list[str]]:
    """The user's ``--dataloader-type`` (default single), and argv with ``external`` in its place:
    the example builds the loaders of that type itself and hands Megatron iterators."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--dataloader-type", default="single")
    ns, rest = parser.parse_known_args(argv)
    if ns.dataloader_type not in ("single", "cyclic"):
        raise UserError(f"--dataloader-type {ns.dataloader_type}: the reference example builds the data loaders "
                        "itself", "give single or cyclic, or leave the flag out")
    return ns.dataloader_type, [*rest, "--dataloader-type", EXTERNAL]


def _iterators(loaders: tuple[Any, Any, Any], kind: str) -> list[Iterator[Any] | None]:
    from megatron.training.training import cyclic_iter

    return [None if d is None else iter(d) if kind == "single" else iter(cyclic_iter(d)) for d in loaders]


def entry_hooks(settings: ReferenceSettings, loader_type: str) -> Any:
    """The usual entry's hooks for the example: RNG captured before the trained model is built, the
    reference built and wrapped round the training batches once the trained model exists."""
    from hfsdp.training.entry import Hooks

    built: dict[str, Any] = {}

    def model_provider(base: Callable[..., Any]) -> Callable[..., Any]:
        def provider(*args: Any, **kwargs: Any) -> Any:
            if "rng" not in built:  # the state the trained model is built from
                built["rng"], built["provider"] = RngStates.capture(), base
            return base(*args, **kwargs)
        return provider

    def datasets_provider(base: Callable[..., Any]) -> Callable[..., Any]:
        def provider(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            from megatron.training import get_args, print_rank_0
            from megatron.training.datasets.data_samplers import build_pretraining_data_loader

            train, valid, test = base(*args, **kwargs)
            megatron_args = get_args()
            megatron_args.dataloader_type = loader_type  # the loaders as the user asked for them
            try:
                loaders = (build_pretraining_data_loader(train, megatron_args.consumed_train_samples),
                           build_pretraining_data_loader(valid, megatron_args.consumed_valid_samples),
                           build_pretraining_data_loader(test, 0))
            finally:
                megatron_args.dataloader_type = EXTERNAL
            train_it, valid_it, test_it = _iterators(loaders, loader_type)
            if not settings.enabled or train_it is None:
                print_rank_0("> reference: none (--no-reference): the loss is the cross entropy alone")
                return train_it, valid_it, test_it
            reference = build_reference(built["provider"], built["rng"])
            print_rank_0(f"> reference: frozen copy of the initial model, pool scope {SCOPE!r}, eval mode, "
                         f"KL weight {settings.kl_weight}"
                         + (f", freed after step {settings.free_after}" if settings.free_after else ""))
            batches = ReferenceBatches(train_it, reference, settings, get_num_microbatches,
                                       megatron_args.iteration, megatron_args.padded_vocab_size, print_rank_0)
            return batches, valid_it, test_it
        return provider

    return Hooks(check_args=check_args, model_provider=model_provider, datasets_provider=datasets_provider,
                 forward_step=forward_step)


def run(argv: Sequence[str]) -> None:
    """The example's run: its flags split off, the rest through the usual entry with its hooks."""
    from hfsdp.training import entry

    settings, rest = split_flags(argv)
    loader_type, rest = _loader_type(rest)
    entry.run(rest, None, entry_hooks(settings, loader_type))


def main(argv: Sequence[str] | None = None) -> None:
    """``examples/reference_kl/train.py``: exits 2 on bad input, as the usual entry does."""
    import os
    import sys

    from hfsdp.usererror import run_cli

    rc = run_cli(os.path.basename(sys.argv[0]) or "train.py", lambda: run(sys.argv[1:] if argv is None else argv))
    if rc:
        sys.exit(rc)
