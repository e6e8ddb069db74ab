"""The Triton gradient norm ([Note: Triton l2norm]) on the CPU: TE's launch plan, what goes to TE's op, and the
kernels' order of additions and flushes under Triton's interpreter against a NumPy transcription of TE's l2norm.cu,
both with a correctly rounded fused multiply-add. The interpreter's square root is correctly rounded, TE's and the
GPU kernel's approximate: only the GPU test (test_triton_l2norm_gpu.py) holds that, and the bits against TE's kernel."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron.core.optimizer import triton_l2norm as tn

pytest.importorskip("triton")


def test_launch_blocks_follow_multi_tensor_apply():
    # 2 tensors of 200 chunks: blocks full at 320, the second tensor carries over.
    assert tn.launch_blocks([200 * 8, 200 * 8], 8) == [list(range(320)), list(range(320, 400))]
    # 111 one-chunk tensors: the 110th tensor's last chunk ends a launch.
    assert tn.launch_blocks([8] * 111, 8) == [list(range(110)), [110]]
    # The 110th tensor has 5 chunks: the launch ends after its last one.
    assert tn.launch_blocks([8] * 109 + [40], 8) == [list(range(114))]
    # A tensor cut by a full launch counts as the next launch's first tensor.
    got = tn.launch_blocks([8] * 109 + [300 * 8] + [8] * 110, 8)
    assert [len(b) for b in got] == [320, 89 + 109, 1]
    assert got[1][0] == 320 and got[2] == [518]
    # A partial last chunk is a chunk.
    assert tn.launch_blocks([9, 1], 8) == [[0, 1, 2]]


def multi_tensor_apply(numels: list[int], chunk_size: int) -> list[list[int]]:
    """TE's multi_tensor_apply<1> host loop transcribed line by line: the chunk numbers each launch's blocks take."""
    launches, blocks, loc_block_info, loc_tensor_info, chunk_id = [], [], 0, 0, 0
    for t, numel in enumerate(numels):
        loc_tensor_info += 1
        chunks_this_tensor = (numel + chunk_size - 1) // chunk_size
        for chunk in range(chunks_this_tensor):
            blocks.append(chunk_id)
            chunk_id += 1
            loc_block_info += 1
            tensors_full = loc_tensor_info == 110 and chunk == chunks_this_tensor - 1
            blocks_full = loc_block_info == 320
            last_chunk = t == len(numels) - 1 and chunk == chunks_this_tensor - 1
            if tensors_full or blocks_full or last_chunk:
                launches.append(blocks)
                blocks, loc_block_info = [], 0
                loc_tensor_info = 0 if chunk == chunks_this_tensor - 1 else 1
    return launches


def test_launch_blocks_match_te_loop_on_random_lists():
    rng = random.Random(1)
    for _ in range(2000):
        chunk_size = rng.choice([1, 2, 3, 8])
        count = rng.choice([1, 2, 5, 50, 109, 110, 111, 200, 400])
        numels = [rng.choice([1, 2, 3, chunk_size, chunk_size + 1, rng.randint(1, 700 * chunk_size)])
                  for _ in range(count)]
        assert tn.launch_blocks(numels, chunk_size) == multi_tensor_apply(numels, chunk_size), (numels, chunk_size)


def test_an_empty_tensor_is_refused_as_te_refuses_it():
    with pytest.raises(ValueError, match="tensor 1 has 0 elements"):
        tn.launch_blocks([8, 0], 8)


def test_plan_sorts_chunks_by_te_order_and_alignment():
    # element size 2 (bf16), chunk 2048: a 16-byte start, an 8-byte start, a 2-byte start, a size not a multiple of 4
    work = tn.plan(((4096, 4096), (100008, 2048), (200002, 2048), (300000, 2050)), 2, 2048, torch.device("cpu"))
    kinds = {(g.te_aligned, g.align): g.ids.tolist() for g in work.groups}
    # The last tensor's chunks have 2050 and 2 elements left, not multiples of 4: TE's unaligned order.
    assert kinds == {(True, 16): [0, 1], (True, 8): [2], (False, 2): [3], (False, 16): [4, 5]}
    assert work.chunks == 6
    assert work.slots.shape == (1, tn.THREADS) and work.slots[0, :7].tolist() == [0, 1, 2, 3, 4, 5, -1]


def test_plan_te_order_follows_the_remaining_count():
    # 2050 elements: the first chunk has 2050 left (not a multiple of 4): TE's unaligned order; the second has 2.
    work = tn.plan(((4096, 2050),), 2, 2048, torch.device("cpu"))
    assert {(g.te_aligned, g.align): g.ids.tolist() for g in work.groups} == {(False, 16): [0, 1]}
    assert [g.sizes.tolist() for g in work.groups] == [[2048, 2]]


def test_calls_triton_cannot_take_go_to_te_op():
    calls = []

    def te_op(chunk_size, noop, lists, *args):
        calls.append((chunk_size, len(lists[0]), args))
        return "te"

    cpu = [torch.ones(4096, dtype=torch.bfloat16)]
    assert tn.l2norm(te_op, 65536, torch.zeros(1), [cpu], False, environ={tn.ENV: "1"}) == "te"
    assert tn.l2norm(te_op, 65536, torch.zeros(1), [cpu], False, environ={}) == "te"
    assert calls == [(65536, 1, (False,)), (65536, 1, (False,))]


def test_refusal_names_the_reason():
    t, flag = torch.ones(8), torch.zeros(1, dtype=torch.int32)
    assert tn.refusal(65536, flag, [[t]], (True,)) == "per-tensor norms"
    assert tn.refusal(65536, flag, [[t], [t]], (False,)).startswith("2 lists")
    assert tn.refusal(65536, flag, [[]], (False,)).startswith("1 lists, the first of 0")
    assert tn.refusal(1000, flag, [[t]], (False,)) == "chunk size 1000, not a multiple of 2048"
    assert tn.refusal(65536, flag, [[t.double()]], (False,)) == "dtype torch.float64"
    assert tn.refusal(65536, flag, [[t, t.half()]], (False,)) == "dtypes torch.float32 and torch.float16 in one list"
    assert tn.refusal(65536, flag, [[t]], (False,)) == "a tensor on cpu, not on a CUDA device"
    assert tn.refusal(65536, flag.float(), [[t]], (False,)) == "a noop flag of torch.float32, not int32"


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_the_switch_takes_0_or_1(value):
    with pytest.raises(ValueError, match=f"{tn.ENV}="):
        tn.enabled({tn.ENV: value})
    assert not tn.enabled({tn.ENV: "0"})
    assert tn.enabled({}) == tn.enabled({tn.ENV: "1"}) == (tn.triton is not None)  # on by default where Triton is


# --- TE's l2norm.cu, transcribed in NumPy -----------------------------------------------------------------

TINY = np.float32(2.0**-126)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """A correctly rounded fp32 fused multiply-add: the product is exact in fp64, the sum is rounded to odd in fp64
    (TwoSum's error decides), so rounding that to fp32 rounds once."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def ftz(a: np.ndarray) -> np.ndarray:
    return np.where(np.abs(a) < TINY, a * np.float32(0), a).astype(np.float32)


def block_tree(x: np.ndarray) -> np.float32:
    """reduce_block_into_lanes: x[tid] = x[tid] + x[tid + i] for i = 256 .. 64, then the warp's shuffles."""
    while x.size > 1:
        half = x.size // 2
        x = ftz(x[:half] + x[half:])
    return x[0]


def te_block(x: np.ndarray, n: int, chunk_size: int, aligned: bool) -> np.float32:
    """L2NormFunctor for one chunk: x holds the chunk's elements (n counted from the chunk's start)."""
    vals = np.zeros((tn.THREADS, tn.ILP), np.float32)
    t = np.arange(tn.THREADS)
    limit = min(n, chunk_size)
    if aligned:
        for i_start in range(0, limit // tn.ILP, tn.THREADS):  # i_start * ILP < n && < chunk_size
            rows = i_start + t
            live = rows * tn.ILP < limit
            for ii in range(tn.ILP):
                nxt = ftz(np.where(live, x[np.minimum(rows * tn.ILP + ii, limit - 1)], 0).astype(np.float32))
                vals[:, ii] = np.where(live, ftz(fma32(nxt, nxt, vals[:, ii])), vals[:, ii])
    else:
        for i_start in range(0, limit, tn.THREADS * tn.ILP):
            for ii in range(tn.ILP):
                i = i_start + t + ii * tn.THREADS
                live = i < limit
                nxt = ftz(np.where(live, x[np.minimum(i, limit - 1)], 0).astype(np.float32))
                vals[:, ii] = np.where(live, ftz(fma32(nxt, nxt, vals[:, ii])), vals[:, ii])
    val = np.zeros(tn.THREADS, np.float32)
    for ii in range(tn.ILP):
        val = ftz(val + vals[:, ii])
    return block_tree(val)


def te_norm(tensors: list[torch.Tensor], chunk_size: int) -> tuple[list[np.float32], float]:
    """multi_tensor_l2norm_cuda: each block's sum, added into output[blockIdx.x] launch after launch, then
    cleanup's tree and square root."""
    sums = []
    for t in tensors:
        x = t.float().numpy()
        size = t.element_size()
        for start in range(0, t.numel(), chunk_size):
            n = t.numel() - start
            aligned = n % tn.ILP == 0 and (t.data_ptr() + start * size) % (tn.ILP * size) == 0
            sums.append(te_block(x[start:start + min(n, chunk_size)], n, chunk_size, aligned))
    output = np.zeros(tn.THREADS, np.float32)
    for blocks in multi_tensor_apply([t.numel() for t in tensors], chunk_size):
        for b, chunk in enumerate(blocks):
            output[b] = ftz(np.float32(output[b] + sums[chunk]))
    return sums, float(np.sqrt(block_tree(output)))


def case_tensors(case: str) -> tuple[list[torch.Tensor], int]:
    """Views into one buffer, so that their starts fall on 16, 8 or 2 bytes; the chunk size."""
    g = torch.Generator().manual_seed(7)

    def buffer(n: int, dtype: torch.dtype) -> torch.Tensor:
        # magnitudes over a few binades: sums that another order of additions would round differently
        scale = torch.exp(torch.randn(n, generator=g) * 0.5)
        return (torch.randn(n, generator=g) * scale).to(dtype)

    if case in ("bf16", "fp16", "fp32"):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[case]
        flat = buffer(40_000, dtype)
        # 16-byte start with a partial last chunk; size not a multiple of 4; 8-byte start; 2-byte start
        spans = [(0, 2048 * 3 + 100), (8192, 4098), (16388, 4096 + 512), (30001, 6000)]
        return [flat[a:a + n] for a, n in spans], 2048
    if case == "many":
        # Launches of 210 blocks (the 110th tensor's last chunk), 320 (blocks full, a tensor cut and carried over)
        # and 120: 50 tensors of 3 chunks, 100 of 1, one of 400.
        numels = [5000] * 50 + [1000] * 100 + [400 * 2048]
        assert [len(b) for b in tn.launch_blocks(numels, 2048)] == [210, 320, 120]
        flat = buffer(sum(numels) + 8 * len(numels), torch.bfloat16)
        starts = [sum(numels[:t]) + 8 * t for t in range(len(numels))]
        return [flat[a:a + n] for a, n in zip(starts, numels, strict=True)], 2048
    if case in ("megatron_chunk", "megatron_chunk_fp32"):  # Megatron's chunk size: 32 iterations a block
        flat = buffer(210_000, torch.float32 if case.endswith("fp32") else torch.bfloat16)
        return [flat[:70_000], flat[70_004:70_004 + 131_072]], 65536
    if case == "one_lane_fp32":
        # Only thread 0's elements are non-zero: a chunk's sum is that thread's four sums, so a rounding of the
        # thread's multiply-adds (fused or not) shows in it; in a full chunk the other threads' sums drown it.
        flat = buffer(64 * 65536, torch.float32)
        flat[torch.arange(flat.numel()) % 2048 >= 4] = 0.0
        return [flat], 65536
    if case == "subnormal":
        # bf16 subnormals (flushed on load); squares below fp32's normal range alone (flushed after the fused
        # multiply-add) and two of them (normal); ordinary values
        flat = torch.cat([torch.full((3000,), 1e-39), torch.full((3000,), 3e-20), torch.full((3000,), 1e-19),
                          buffer(3000, torch.float32)])
        return [flat.to(torch.bfloat16)], 2048
    if case in ("inf", "nan"):
        flat = buffer(9000, torch.bfloat16)
        flat[4321] = float(case)
        return [flat[:5000], flat[5000:]], 2048
    raise ValueError(case)


def bits(x: float) -> str:
    return np.float32(x).tobytes().hex()


def main(case: str) -> None:
    """Under TRITON_INTERPRET=1: the reference and the kernels on one set of views, as JSON. The interpreter's fused
    multiply-add (a product, then a sum: two roundings) is replaced by :func:`fma32`, as the GPU computes it."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if not hasattr(builder, "create_fma"):
        raise RuntimeError("Triton's interpreter has no create_fma to replace: the test needs updating")
    builder.create_fma = lambda self, x, y, z: interpreter.TensorHandle(fma32(x.data, y.data, z.data), z.dtype.scalar)
    tensors, chunk_size = case_tensors(case)
    noop = torch.zeros(1, dtype=torch.int32)
    _, sums = tn.chunk_sums(tensors, chunk_size, noop)
    got = tn.norm(tensors, chunk_size, torch.zeros(1, dtype=torch.int32))
    want_sums, want = te_norm(tensors, chunk_size)
    print(json.dumps({"sums": [bits(x) for x in sums.tolist()], "want_sums": [bits(x) for x in want_sums],
                      "got": bits(got.item()), "want": bits(want), "got_noop": bool(noop.item()),
                      "want_noop": not all(np.isfinite(want_sums)), "value": want}))


@pytest.mark.parametrize("case", ["bf16", "fp16", "fp32", "many", "megatron_chunk", "megatron_chunk_fp32",
                                  "one_lane_fp32", "subnormal", "inf", "nan"])
def test_kernels_add_in_te_order(case):
    out = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    differ = [i for i, (a, b) in enumerate(zip(result["sums"], result["want_sums"], strict=True)) if a != b]
    assert not differ, f"chunks {differ[:10]} of {len(result['sums'])} differ from TE's sums"
    assert result["got"] == result["want"], {k: result[k] for k in ("got", "want", "value")}
    assert result["got_noop"] == result["want_noop"] == (case in ("inf", "nan")), result


if __name__ == "__main__":
    main(sys.argv[1])
