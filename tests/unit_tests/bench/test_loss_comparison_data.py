"""The loss comparison's pieces: the Markov-chain dataset, --data-path, and loss_compare."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from hfsdp.atomic import write_json_atomic
from hfsdp.bench import configs as cfgs
from hfsdp.bench import loss_compare, markov_data
from hfsdp.bench.results import RunResult
from hfsdp.usererror import UserError


def test_chain_is_seeded_follows_its_table_and_states_its_entropy() -> None:
    chain = markov_data.Chain(active=64, branching=4, seed=7)
    docs = markov_data.documents(chain, 16, 200)
    assert np.array_equal(docs, markov_data.documents(chain, 16, 200))
    assert not np.array_equal(docs, markov_data.documents(markov_data.Chain(64, 4, 8), 16, 200))
    succ = chain.successors()
    assert all(len(set(row)) == 4 for row in succ.tolist())
    # every step goes to one of its token's successors, and every successor slot is used
    picks = [list(succ[a]).index(b) for a, b in zip(docs[:, :-1].ravel(), docs[:, 1:].ravel(), strict=True)]
    counts = np.bincount(picks, minlength=4) / len(picks)
    assert np.allclose(counts, chain.probabilities, atol=0.03)
    p = chain.probabilities
    assert chain.entropy_rate == pytest.approx(float(-(p * np.log(p)).sum()))
    assert 0 < chain.entropy_rate < math.log(4)


@pytest.mark.parametrize("active,branching", [(1, 1), (8, 0), (8, 9)])
def test_chain_refuses_impossible_parameters(active: int, branching: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        markov_data.Chain(active=active, branching=branching)


def test_written_dataset_reads_back_and_nothing_is_replaced(tmp_path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = tmp_path / "sub" / "chain"
    rc = markov_data.main(["--out", str(prefix), "--tokens", "1000", "--doc-length", "100", "--active", "50"])
    assert rc == 0
    data = IndexedDataset(str(prefix))
    assert len(data) == 10 and data[0].dtype == np.uint16 and int(max(d.max() for d in data)) < 50
    meta = json.loads((tmp_path / "sub" / "chain.json").read_text())
    assert meta["tokens"] == 1000 and meta["active_tokens"] == 50
    before = {p.name: p.read_bytes() for p in prefix.parent.iterdir()}
    with pytest.raises(UserError, match="already exist"):
        markov_data.main(["--out", str(prefix), "--tokens", "10"])
    assert {p.name: p.read_bytes() for p in prefix.parent.iterdir()} == before  # nothing left behind either


def test_data_path_replaces_mock_data_and_is_checked(tmp_path) -> None:
    flags = cfgs.model_flags("default")
    assert "--mock-data" in flags
    with pytest.raises(UserError, match="are not files"):
        cfgs.with_data(flags, str(tmp_path / "none"))
    (tmp_path / "d.bin").write_bytes(b"")
    (tmp_path / "d.idx").write_bytes(b"")
    out = cfgs.with_data(flags, str(tmp_path / "d"))
    assert "--mock-data" not in out and out[-2:] == ["--data-path", str(tmp_path / "d")]


def _run(config: str, losses: list[float], repeat: int = 0) -> dict:
    r = RunResult(config=config, repeat=repeat, step_times_s=(0.1,), tokens_per_step=1, peak_allocated_bytes=1,
                  peak_reserved_bytes=1, pool_bytes_measured=None, lm_loss=tuple(losses))
    return {**r.__dict__, "median_step_s": 0.1}


@pytest.mark.parametrize("bump,rc", [(0.009, 0), (0.011, 1)])
def test_loss_compare_holds_the_largest_difference_from_the_given_step(tmp_path, capsys, bump: float, rc: int
                                                                       ) -> None:
    base = [10.0 - 0.01 * i for i in range(100)]
    other = list(base)
    other[3] = base[3] * 1.5  # before --from-step: does not count
    other[60] = base[60] * (1 + bump)
    path = tmp_path / "r.json"
    write_json_atomic(path, {"runs": [_run("a", base), _run("a", [1.0] * 100, repeat=1), _run("b", other)]})
    assert loss_compare.main([str(path), "--config", "b", "--baseline", "a", "--from-step", "10"]) == rc
    out = capsys.readouterr().out
    assert f"at step 61; limit 1.0000%: {'holds' if rc == 0 else 'FAILS'}" in out
    assert f"{bump:.4%}" in out


def test_loss_compare_refuses_what_it_cannot_compare(tmp_path) -> None:
    path = tmp_path / "r.json"
    write_json_atomic(path, {"runs": [_run("a", [2.0, 1.0]), _run("b", [2.0, 1.0])]})
    with pytest.raises(UserError, match="no run of c"):
        loss_compare.main([str(path), "--config", "c", "--baseline", "a"])
    with pytest.raises(UserError, match="past the runs' 2 steps"):
        loss_compare.main([str(path), "--config", "b", "--baseline", "a", "--from-step", "3"])
    write_json_atomic(path, {"runs": [_run("a", [2.0, 0.0]), _run("b", [2.0, 1.0])]})
    with pytest.raises(UserError, match="lm loss is 0 at step 2"):
        loss_compare.main([str(path), "--config", "b", "--baseline", "a", "--from-step", "1"])
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(UserError, match="not a regular file"):
        loss_compare.main([str(tmp_path / "pipe"), "--config", "b", "--baseline", "a"])
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(UserError, match="not a benchmark results JSON"):
        loss_compare.main([str(tmp_path / "bad.json"), "--config", "b", "--baseline", "a"])
