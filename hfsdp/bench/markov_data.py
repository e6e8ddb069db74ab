"""Synthetic text a model learns slowly: a seeded bigram Markov chain as Megatron's indexed dataset.

[Note: data for loss comparisons] ``--mock-data`` feeds Megatron's mock documents, runs of
consecutive token ids, which a model learns within a few steps: the loss falls near zero, and two
runs whose numerics differ (FP8 against bf16) then agree or differ by noise around nothing. A
comparison over hundreds of steps needs text whose loss keeps falling towards a floor well above
zero. This chain has ``active`` tokens (ids ``0 .. active-1``); token ``t`` is followed by one of
``branching`` successors drawn from a seeded table, the k-th with probability proportional to
``1 / (k + 1)``. Its entropy rate, the lm loss (nats) of a model that knows the table, is printed
and written beside the data; a model first learns the unigram (about ``ln(active)``) and then the
bigrams, so the loss falls over many steps. Every document starts at a seeded token and runs
``doc_length`` tokens; all documents are drawn together, one position at a time.

The files are written with Megatron's ``IndexedDatasetBuilder`` (``<prefix>.bin`` and
``<prefix>.idx``, what ``--data-path <prefix>`` reads with ``--tokenizer-type NullTokenizer
--vocab-size V``, V >= ``active``). Nothing a user made is replaced: existing files are refused,
and the pair is built in a temporary folder beside the prefix and moved in only when complete.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hfsdp.atomic import write_json_atomic
from hfsdp.usererror import UserError, output_file, positive, run_cli

SUFFIXES = (".bin", ".idx", ".json")


@dataclass(frozen=True)
class Chain:
    """The chain's parameters; validated once."""

    active: int = 4096
    branching: int = 8
    seed: int = 1234

    def __post_init__(self) -> None:
        if not 2 <= self.active <= np.iinfo(np.int32).max:
            raise ValueError(f"active tokens must be 2 .. 2**31-1, got {self.active}")
        if not 1 <= self.branching <= self.active:
            raise ValueError(f"branching must be 1 .. active ({self.active}), got {self.branching}")

    @property
    def probabilities(self) -> np.ndarray:
        weights = 1.0 / np.arange(1, self.branching + 1)
        return weights / weights.sum()

    @property
    def entropy_rate(self) -> float:
        """Nats per token: every state has the same successor distribution."""
        p = self.probabilities
        return float(-(p * np.log(p)).sum())

    def successors(self) -> np.ndarray:
        """``[active, branching]`` successor ids, distinct within a row."""
        rng = np.random.default_rng([self.seed, 0])
        keys = rng.random((self.active, self.active), dtype=np.float32) if self.active <= 8192 else None
        if keys is not None:
            return np.argpartition(keys, self.branching - 1, axis=1)[:, :self.branching].astype(np.int64)
        rows = [rng.choice(self.active, size=self.branching, replace=False) for _ in range(self.active)]
        return np.stack(rows).astype(np.int64)


def documents(chain: Chain, num_documents: int, doc_length: int) -> np.ndarray:
    """``[num_documents, doc_length]`` token ids drawn from ``chain`` (deterministic in its seed)."""
    if num_documents < 1 or doc_length < 2:
        raise ValueError(f"need >= 1 document of >= 2 tokens, got {num_documents} x {doc_length}")
    succ = chain.successors()
    cdf = np.cumsum(chain.probabilities)
    rng = np.random.default_rng([chain.seed, 1])
    out = np.empty((num_documents, doc_length), dtype=np.int64)
    out[:, 0] = rng.integers(0, chain.active, size=num_documents)
    for pos in range(1, doc_length):
        pick = np.minimum(np.searchsorted(cdf, rng.random(num_documents), side="right"), chain.branching - 1)
        out[:, pos] = succ[out[:, pos - 1], pick]
    return out


def write(prefix: str | Path, chain: Chain, num_documents: int, doc_length: int) -> dict[str, object]:
    """Write ``<prefix>.bin``/``.idx`` (and ``.json``: the chain and its entropy rate); see the note."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = Path(prefix)
    if taken := [str(prefix) + s for s in SUFFIXES if os.path.lexists(str(prefix) + s)]:
        raise UserError(f"{', '.join(taken)} already exist{'s' if len(taken) == 1 else ''}",
                        "give --out a prefix of no existing files (nothing is replaced)")
    output_file("--out", str(prefix) + ".bin")
    tokens = documents(chain, num_documents, doc_length)
    dtype = np.uint16 if chain.active <= np.iinfo(np.uint16).max + 1 else np.int32
    meta = {"kind": "bigram Markov chain", "active_tokens": chain.active, "branching": chain.branching,
            "seed": chain.seed, "documents": num_documents, "doc_length": doc_length,
            "tokens": int(tokens.size), "entropy_rate_nats": round(chain.entropy_rate, 6),
            "unigram_loss_nats": round(math.log(chain.active), 6), "dtype": np.dtype(dtype).name}
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".markov-", dir=prefix.parent))
    try:
        builder = IndexedDatasetBuilder(str(tmp / "data.bin"), dtype=dtype)
        for row in tokens:
            builder.add_document(row, [row.size])
        builder.finalize(str(tmp / "data.idx"))
        write_json_atomic(tmp / "data.json", meta)
        for suffix in SUFFIXES:  # .json last: its presence says the pair is complete
            os.replace(tmp / f"data{suffix}", str(prefix) + suffix)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfsdp.bench.markov_data", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, metavar="PREFIX", help="Writes PREFIX.bin, PREFIX.idx, PREFIX.json.")
    p.add_argument("--tokens", type=positive(int), default=4_194_304, help="About this many tokens in all.")
    p.add_argument("--doc-length", type=positive(int), default=8192, help="Tokens per document (>= 2).")
    p.add_argument("--active", type=positive(int), default=Chain.active, help="Token ids used: 0 .. N-1.")
    p.add_argument("--branching", type=positive(int), default=Chain.branching, help="Successors per token.")
    p.add_argument("--seed", type=int, default=Chain.seed)
    opts = p.parse_args(argv)
    try:
        chain = Chain(opts.active, opts.branching, opts.seed)
    except ValueError as exc:
        raise UserError(str(exc), "fix --active / --branching") from exc
    if opts.doc_length < 2:
        raise UserError(f"--doc-length {opts.doc_length} is under 2", "give --doc-length 2 or more")
    meta = write(opts.out, chain, max(1, -(-opts.tokens // opts.doc_length)), opts.doc_length)
    print(f"markov_data: {opts.out}.bin/.idx: {meta['tokens']:,} tokens in {meta['documents']} documents; "
          f"entropy rate {meta['entropy_rate_nats']:.4f} nats (a model that knows the chain), unigram "
          f"{meta['unigram_loss_nats']:.4f}; train with --data-path {opts.out} --tokenizer-type NullTokenizer "
          f"--vocab-size >= {opts.active}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli("markov_data", main))
