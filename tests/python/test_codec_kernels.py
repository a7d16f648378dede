"""The fused, vectorized codec kernels against plain torch arithmetic.

Each codec's fused route (error feedback, encode and the new residual in one
pass; runtime-chosen instruction set) must give exactly what the unfused
math gives: the reference here is written with torch ops, bit for bit where
the arithmetic is the same.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from xcomm import _C


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _int8_reference(acc: torch.Tensor, world: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed shards and residual of the int8 codec, written with torch ops."""
    n = acc.numel()
    shard = math.ceil(math.ceil(n / world) / chunk) * chunk
    padded = torch.zeros(world * shard)
    padded[:n] = acc
    chunks = padded.view(-1, chunk)
    absmax = chunks.abs().amax(dim=1)
    finite = torch.isfinite(chunks).all(dim=1)
    scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    q = torch.round(chunks * (1 / scale)[:, None]).to(torch.int8)
    q[~finite] = 0
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    sent = (q.float() * scale[:, None]).view(-1)[:n]
    rows = []
    per = shard // chunk
    for j in range(world):
        rows.append(
            torch.cat(
                [
                    q.view(-1)[j * shard : (j + 1) * shard].view(torch.uint8),
                    scale[j * per : (j + 1) * per].view(torch.uint8),
                ]
            )
        )
    return torch.stack(rows), acc - sent


@pytest.mark.parametrize(
    "n,world,chunk", [(1, 2, 1024), (1000, 3, 64), (300001, 4, 256), (70000, 2, 1024)]
)
def test_int8_fused_encode_matches_torch_math(n: int, world: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(3) * 10
    if n > 100:
        g[n // 3] = float("inf")  # one non-finite chunk: NaN scale, NaN residual there
    residual = torch.randn(n, generator=gen) * 0.01
    codec, feedback = _C.Int8Codec(chunk), _C.ErrorFeedback()
    feedback.store(0, residual.clone())
    for step in range(3):  # the residual carries over in place
        acc = g * (step + 1) + residual
        want_packed, want_residual = _int8_reference(acc, world, chunk)
        packed = codec.pack_shards_with_feedback(g * (step + 1), world, feedback, 0)
        got_residual = feedback.state()[0]
        assert torch.equal(packed, want_packed), f"step {step}"
        assert torch.equal(_bits(got_residual), _bits(want_residual)), f"step {step}"
        residual = want_residual


def test_int8_first_step_seeds_the_residual_with_the_input() -> None:
    g = torch.randn(5000)
    g[7] = -0.0
    codec, feedback = _C.Int8Codec(1024), _C.ErrorFeedback()
    packed = codec.pack_shards_with_feedback(g, 2, feedback, 3)
    want_packed, want_residual = _int8_reference(g, 2, 1024)
    assert torch.equal(packed, want_packed)
    assert torch.equal(_bits(feedback.state()[3]), _bits(want_residual))


@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0])
def test_int8_reduce_and_pack_is_reduce_divide_pack(divisor: float) -> None:
    codec = _C.Int8Codec(512)
    world, n = 3, 40000
    rows = torch.stack(
        [codec.pack_shards(torch.randn(n) * (r + 1), world)[r % world] for r in range(world)]
    )
    shard = codec.shard_elems(n, world)
    reduced = codec.reduce_shards(rows, shard)
    # The reference sum: rank order, in float32, from the dequantized rows.
    ref = torch.zeros(shard)
    for r in range(world):
        q = rows[r, :shard].view(torch.int8).float()
        scales = rows[r, shard:].view(torch.float32)
        ref += (q.view(-1, 512) * scales[:, None]).view(-1)
    assert torch.equal(_bits(reduced), _bits(ref))
    want = codec.pack(ref / divisor if divisor != 1.0 else ref)
    assert torch.equal(codec.reduce_and_pack(rows, shard, divisor), want)


def _topk_reference(acc: torch.Tensor, k: int) -> list[int]:
    """Indices of the k largest |acc| (NaN largest), ties to the lower index."""
    if acc.dtype == torch.float64:
        key = acc.abs().view(torch.int64)
    else:  # 2-byte types widen exactly; sign-less float bits order magnitudes, NaN above Inf
        key = acc.abs().float().view(torch.int32).long()
    order = sorted(range(acc.numel()), key=lambda i: (-int(key[i]), i))
    return sorted(order[:k])


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


@pytest.mark.parametrize(
    "n,density,sample",
    [(1000, 0.01, 4096), (70001, 0.01, 4096), (70001, 0.2, 64), (50000, 0.05, 16)],
)
@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_topk_picks_the_exact_top_k_and_keeps_the_rest(
    n: int, density: float, sample: int, feedback: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(n + sample)
    codec = _C.TopKCodec(True, feedback, sample, 5)
    k = _C.TopKCodec.k_for(n, density)
    residual = torch.zeros(n, dtype=dtype)
    exact = 0
    for step in range(4):  # small samples overshoot now and then: the exact route
        g = torch.randn(n, generator=gen).to(dtype)
        g[::97] = 3.0  # ~1% tie at one magnitude: at 1% density the k-th falls among them
        if step == 2:
            g[11] = float("nan")
            g[12] = float("-inf")
        acc = g + residual if feedback else g
        packed = codec.encode(0, g, k)
        sel = codec.last_selection()
        assert sel["route"] == "scan", f"step {step}: {sel}"  # every CPU dtype: not at::topk
        exact += sel["exact"]
        idx = packed[: 4 * k].view(torch.int32).tolist()
        vals = packed[4 * k :].clone().view(dtype)  # float64 is 8-byte aligned only for even k
        want = _topk_reference(acc, k)
        assert idx == want, f"step {step}"
        assert torch.equal(_bits_of(vals), _bits_of(acc[want]))
        if feedback:
            expect = acc.clone()
            expect[want] = 0
            kept = codec.feedback_state()[0]
            assert kept.dtype == dtype
            assert torch.equal(_bits_of(kept), _bits_of(expect))
            residual = expect
    if n <= 4 * sample:  # too small to sample: the full selection, every step
        assert exact == 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_topk_decode_of_two_ranks_with_an_odd_k(dtype: torch.dtype) -> None:
    """An odd k puts the second row's indices (2-byte dtypes) or the values
    (float64) off their alignment in the gathered payloads; decode reads them
    anyway: index_add in rank order, then the divide."""
    n, k = 10000, 101
    codec = _C.TopKCodec(False, False)
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(2)]
    payloads = [codec.encode(0, g, k) for g in grads]
    out = torch.empty(n, dtype=dtype)
    codec.decode(torch.stack(payloads), k, out, 2.0)
    ref = torch.zeros(n, dtype=dtype)
    for g, p in zip(grads, payloads):
        idx = p[: 4 * k].clone().view(torch.int32).long()
        ref.index_add_(0, idx, g[idx])
    assert torch.equal(out, ref / 2)
    assert int((out != 0).sum()) > k


def test_topk_route_is_what_ran() -> None:
    """``last_selection()['route']`` tells the scan from at::topk: a strided
    bucket still takes at::topk, and on distinct magnitudes both pick alike."""
    codec = _C.TopKCodec(False, False, 64)
    distinct = torch.randperm(2048, generator=torch.Generator().manual_seed(3)).half()
    strided = torch.stack([distinct, distinct], 1).view(-1)[::2]
    assert not strided.is_contiguous()
    assert codec.last_selection()["route"] == "none"
    by_torch = codec.encode(0, strided, 50)
    assert codec.last_selection()["route"] == "torch"
    by_scan = codec.encode(0, strided.contiguous(), 50)
    assert codec.last_selection()["route"] == "scan"
    assert torch.equal(
        by_torch[:200].view(torch.int32).sort().values, by_scan[:200].view(torch.int32)
    )


def test_topk_decode_sums_ranks_in_order_and_divides() -> None:
    n, k, world = 50000, 500, 3
    codec = _C.TopKCodec(False, False)
    payloads = [codec.encode(0, torch.randn(n) * (r + 1), k) for r in range(world)]
    out = torch.empty(n)
    codec.decode(torch.stack(payloads), k, out, float(world))
    ref = torch.zeros(n)
    for p in payloads:
        ref.index_add_(0, p[: 4 * k].view(torch.int32).long(), p[4 * k :].view(torch.float32))
    assert torch.equal(_bits(out), _bits(ref / world))
    bad = payloads[0].clone()
    bad[:4].view(torch.int32)[0] = n + 5
    with pytest.raises(RuntimeError, match="outside the bucket"):
        codec.decode(bad.view(1, -1), k, out, 1.0)


def test_randomk_fused_route_keeps_the_invariant() -> None:
    n = 100003
    codec = _C.RandomKCodec(7, True)
    residual = torch.zeros(n)
    for step in range(3):
        g = torch.randn(n)
        pos = codec.positions(4, step, n, 0.05)
        k = math.ceil(0.05 * n)
        assert pos.numel() == k
        assert torch.all(pos[1:] > pos[:-1])  # one per stratum: ascending, distinct
        strata = torch.arange(k) * n // k
        assert torch.all(pos >= strata) and torch.all(pos < torch.arange(1, k + 1) * n // k)
        acc = g + residual
        values = codec.encode(4, g, pos)
        assert torch.equal(_bits(values), _bits(acc[pos]))
        expect = acc.clone()
        expect[pos] = 0
        assert torch.equal(_bits(codec.feedback_state()[4]), _bits(expect))
        residual = expect
        out = torch.full((n,), 9.0)
        codec.decode(values, pos, out, 2.0)
        ref = torch.zeros(n)
        ref[pos] = values / 2.0
        assert torch.equal(_bits(out), _bits(ref))
    with pytest.raises(ValueError, match="outside the bucket"):
        codec.encode(4, torch.randn(10), torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="3 reduced values for 2 positions"):
        codec.decode(torch.ones(3), torch.tensor([1, 2]), torch.empty(10), 1.0)


def test_topk_refuses_a_negative_k() -> None:
    with pytest.raises(ValueError, match="k >= 0"):
        _C.TopKCodec(False, True).encode(0, torch.randn(100), -1)


_SCRIPT = r"""
import sys, torch
from xcomm import _C
torch.set_num_threads(int(sys.argv[1]))
g = torch.randn(300001, generator=torch.Generator().manual_seed(1)) * 4
g[5000] = float('nan')
i8, fb = _C.Int8Codec(1024), _C.ErrorFeedback()
fb.store(0, torch.randn(300001, generator=torch.Generator().manual_seed(2)) * 0.1)
tk = _C.TopKCodec(True, True)
rk = _C.RandomKCodec(3, True)
parts = []
for step in range(2):
    p = i8.pack_shards_with_feedback(g, 3, fb, 0)
    parts += [p, i8.reduce_and_pack(p, i8.shard_elems(300001, 3), 3.0), fb.state()[0].view(torch.uint8)]
    parts += [tk.encode(0, g, 3001), tk.feedback_state()[0].view(torch.uint8)]
    pos = rk.positions(0, step, 300001, 0.01)
    parts += [rk.encode(0, g, pos).view(torch.uint8), rk.feedback_state()[0].view(torch.uint8)]
sys.stdout.write(_C.codec_kernels_isa() + " " + str(hash(torch.cat([t.reshape(-1) for t in parts]).numpy().tobytes())))
"""


def _run(isa: str | None, threads: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONHASHSEED="0")
    env.pop("XCOMM_CPU_CAPABILITY", None)
    if isa is not None:
        env["XCOMM_CPU_CAPABILITY"] = isa
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(threads)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_instruction_set_and_thread_count_gives_the_same_bits() -> None:
    runs = {(isa, t): _run(isa, t) for isa in (None, "default") for t in (1, 2)}
    for key, r in runs.items():
        assert r.returncode == 0, f"{key}: {r.stderr}"
    assert runs[(None, 1)].stdout.split()[0] in ("avx2", "avx512", "default")
    assert runs[("default", 1)].stdout.split()[0] == "default"
    digests = {r.stdout.split()[1] for r in runs.values()}
    assert len(digests) == 1, {k: r.stdout for k, r in runs.items()}


def test_a_bad_cpu_capability_names_the_variable() -> None:
    r = _run("sse9", 1)
    assert r.returncode != 0
    assert "XCOMM_CPU_CAPABILITY" in r.stderr
