"""The CPU codecs on gradients unlike ``torch.randn``: mostly exact zeros,
all-equal values, embedding rows, each also with a small dense residual.

Top-k's selection must stay the exact top k (ties to the lower index) and
give the same bits on every instruction set and thread count; the
benchmark's ``--inputs`` table must time every method on every input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from topk_reference import split_k_reference, topk_reference
from xcomm import _C
from xcomm_bench import codecs

N = 1 << 18


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_inputs_are_the_gradients_they_name() -> None:
    gen = torch.Generator().manual_seed(0)
    zeros = codecs.make_input("zeros", N, gen)
    assert int((zeros != 0).sum()) == round(codecs.NONZERO * N)
    ties = codecs.make_input("ties", N, gen)
    assert torch.all(ties == ties[0])
    table = codecs.make_input("rows", N, gen).view(-1, codecs.ROW)
    touched = (table != 0).any(dim=1)
    assert int(touched.sum()) == round(codecs.ROWS_TOUCHED * table.size(0))
    assert torch.all(table[touched] != 0)  # a touched row is dense
    res = codecs.make_input("rows+res", N, torch.Generator().manual_seed(3))
    base = codecs.make_input("rows", N, torch.Generator().manual_seed(3))
    assert torch.all(res != 0)
    assert 0 < float((res - base).abs().max()) < 10 * codecs.RESIDUAL
    with pytest.raises(ValueError, match="unknown input"):
        codecs.make_input("sparse", N, gen)


@pytest.mark.parametrize("name", list(codecs.INPUTS))
def test_topk_is_the_exact_top_k_on_every_input(name: str) -> None:
    g = codecs.make_input(name, N, torch.Generator().manual_seed(1))
    k = _C.TopKCodec.k_for(N, 0.01)
    codec = _C.TopKCodec(False, True)
    residual = torch.zeros(N)
    for step in range(3):
        acc = g + residual
        packed = codec.encode(0, g, k)
        idx = packed[: 4 * k].view(torch.int32).long()
        want = topk_reference(acc, k)
        assert torch.equal(idx, want), f"step {step}"
        assert torch.equal(_bits(packed[4 * k :].view(torch.float32)), _bits(acc[want]))
        residual = acc.index_fill(0, want, 0)
        assert torch.equal(_bits(codec.feedback_state()[0]), _bits(residual))


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", list(codecs.INPUTS))
def test_topk_scans_half_and_double_buckets_on_every_input(name: str, dtype: torch.dtype) -> None:
    """float16 / bfloat16 / float64 buckets take the fused scan (not at::topk):
    the exact top k of their magnitudes, ties to the lower index, the residual
    kept in the bucket's dtype. For the 2-byte types the indices are also
    those the float32 route picks on the upcast values (widening is exact)."""
    g = codecs.make_input(name, N, torch.Generator().manual_seed(1)).to(dtype)
    k = _C.TopKCodec.k_for(N, 0.01)
    codec = _C.TopKCodec(False, True)
    widened = _C.TopKCodec(False, False)
    residual = torch.zeros(N, dtype=dtype)
    size = g.element_size()
    for step in range(3):
        # In the bucket's dtype, as the codec adds them; the first step's
        # residual is the input itself (a -0 cast from a tiny float stays -0).
        acc = g + residual if step else g.clone()
        packed = codec.encode(0, g, k)
        sel = codec.last_selection()
        assert sel["route"] == "scan" and not sel["exact"], f"step {step}: {sel}"
        # the scan collected or re-read the k (at::topk records neither)
        assert sel["candidates"] <= 2 * k <= 2 * (sel["candidates"] + sel["reread"]), sel
        assert packed.numel() == (4 + size) * k
        idx = packed[: 4 * k].view(torch.int32).long()
        want = topk_reference(acc.double(), k)  # float64 holds every value exactly
        assert torch.equal(idx, want), f"step {step}"
        vals = packed[4 * k :].clone().view(dtype)  # float64 is 8-byte aligned only for even k
        assert torch.equal(_bits_of(vals), _bits_of(acc[want]))
        if dtype != torch.float64:
            ref = widened.encode(0, acc.float(), k)
            assert torch.equal(packed[: 4 * k], ref[: 4 * k]), f"step {step}"
        residual = acc.index_fill(0, want, 0)
        kept = codec.feedback_state()[0]
        assert kept.dtype == dtype
        assert torch.equal(_bits_of(kept), _bits_of(residual)), f"step {step}"


def test_top_k_splits_k_between_tensors_by_their_non_zero_entries() -> None:
    x = torch.zeros(1000)
    x[:100] = 1.0  # a dense tensor of 100
    x[100:112] = 2.0  # 12 non-zero of a 900-entry table
    assert _C.TopKCodec.split_k(x, [100, 900], 56) == [50, 6]
    assert _C.TopKCodec.split_k(x, [100, 900], 1000) == [100, 900]  # capped, rest to room
    assert _C.TopKCodec.split_k(torch.zeros(10), [4, 6], 5) == [2, 3]  # by size
    assert _C.TopKCodec.split_k(x, [100, 0, 900], 7) == [6, 0, 1]
    assert _C.TopKCodec.split_k(x, [1000], 56) == [56]  # one tensor: all of k
    assert _C.TopKCodec.split_k(x, [1000], 5000) == [1000]
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        sizes = torch.randint(0, 60, (5,), generator=gen).tolist()
        g = torch.randn(sum(sizes), generator=gen) * (torch.rand(sum(sizes), generator=gen) < 0.3)
        k = int(torch.randint(0, sum(sizes) + 3, (1,), generator=gen))
        nonzero, at = [], 0
        for size in sizes:
            nonzero.append(int((g[at : at + size] != 0).sum()))
            at += size
        assert _C.TopKCodec.split_k(g, sizes, k) == split_k_reference(nonzero, sizes, k)
    with pytest.raises(ValueError, match="segment sizes sum to 3 but the bucket has 1000"):
        _C.TopKCodec.split_k(x, [1, 2], 5)
    with pytest.raises(ValueError, match="negative"):
        _C.TopKCodec.split_k(x, [1001, -1], 5)
    with pytest.raises(ValueError, match="segment sizes sum to 999 but the bucket has 1000"):
        _C.TopKCodec.split_k(x, [999], 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_top_k_per_tensor_is_each_tensors_exact_top_k(dtype: torch.dtype) -> None:
    """Per tensor: each tensor's own top k_i (ties to the lower index), the
    indices bucket-wide and ascending, the residual what was not sent; both
    the sampled scan (a tensor of 2^17) and the exact one (small tensors) run."""
    table = codecs.make_input("rows", 1 << 17, torch.Generator().manual_seed(5))
    dense = torch.randn(3000, generator=torch.Generator().manual_seed(6)) * 50
    g = torch.cat([dense[:1000], table, dense[1000:]]).to(dtype)
    sizes = [1000, table.numel(), 2000]
    k = _C.TopKCodec.k_for(g.numel(), 0.01)
    codec, whole = _C.TopKCodec(False, True), _C.TopKCodec(False, False)
    residual = torch.zeros_like(g)
    for step in range(3):
        acc = g + residual if step else g.clone()
        parts = _C.TopKCodec.split_k(g, sizes, k)
        assert sum(parts) == k and parts[1] > 0
        packed = codec.encode(0, g, k, sizes)
        assert codec.last_selection()["route"] == "scan"
        idx = packed[: 4 * k].view(torch.int32).long()
        want, at = [], 0
        for size, part in zip(sizes, parts):
            if part:
                want.append(topk_reference(acc[at : at + size].double(), part) + at)
            at += size
        want = torch.cat(want)
        assert torch.equal(idx, want), f"step {step}"
        vals = packed[4 * k :].clone().view(dtype)
        assert torch.equal(_bits_of(vals), _bits_of(acc[want]))
        residual = acc.index_fill(0, want, 0)
        assert torch.equal(_bits_of(codec.feedback_state()[0]), _bits_of(residual))
    # Bucket-wide, the dense entries (50x larger) take the whole of k.
    top = whole.encode(0, g, k)[: 4 * k].view(torch.int32).long()
    assert not ((top >= 1000) & (top < 1000 + table.numel())).any()


def test_top_k_per_tensor_on_the_torch_route_selects_the_same_sets() -> None:
    """A non-contiguous bucket takes at::topk: per tensor, the same sets."""
    strided = torch.randn(12000, generator=torch.Generator().manual_seed(7))[::2]  # stride 2
    g = strided.contiguous()
    sizes, k = [1000, 5000], 60
    codec = _C.TopKCodec(False, False)
    packed = codec.encode(0, strided, k, sizes)
    assert codec.last_selection()["route"] == "torch"
    idx = packed[: 4 * k].view(torch.int32).long()
    assert torch.equal(idx, idx.sort().values)  # ascending: the CUDA decode relies on it
    parts = _C.TopKCodec.split_k(g, sizes, k)
    want = (
        torch.cat(
            [
                torch.topk(g[:1000].abs(), parts[0]).indices,
                torch.topk(g[1000:].abs(), parts[1]).indices + 1000,
            ]
        )
        .sort()
        .values
    )
    assert torch.equal(idx, want)


_SCRIPT = r"""
import sys, torch
from xcomm import _C
from xcomm_bench import codecs
torch.set_num_threads(int(sys.argv[1]))
n = 1 << 18
parts = []
for name in codecs.INPUTS:
    g = codecs.make_input(name, n, torch.Generator().manual_seed(4))
    tk, rk = _C.TopKCodec(False, True), _C.RandomKCodec(3, True)
    i8, fb = _C.Int8Codec(1024), _C.ErrorFeedback()
    for step in range(3):
        parts += [tk.encode(0, g, 2622), tk.feedback_state()[0].view(torch.uint8)]
        pos = rk.positions(0, step, n, 0.01)
        parts += [rk.encode(0, g, pos).view(torch.uint8), rk.feedback_state()[0].view(torch.uint8)]
        parts += [i8.pack_shards_with_feedback(g, 2, fb, 0).view(-1), fb.state()[0].view(torch.uint8)]
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        td = _C.TopKCodec(False, True)
        for step in range(2):
            parts += [td.encode(0, g.to(dtype), 2622), td.feedback_state()[0].view(torch.uint8)]
sys.stdout.write(_C.codec_kernels_isa() + " " + str(hash(torch.cat([t.reshape(-1) for t in parts]).numpy().tobytes())))
"""


def _run(isa: str | None, threads: int) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
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


@pytest.mark.slow
def test_uneven_inputs_give_the_same_bits_on_every_instruction_set() -> None:
    runs = {(isa, t): _run(isa, t) for isa in (None, "avx2", "default") for t in (1, 2)}
    for key, r in runs.items():
        assert r.returncode == 0, f"{key}: {r.stderr}"
    assert runs[("default", 1)].stdout.split()[0] == "default"
    digests = {r.stdout.split()[1] for r in runs.values()}
    assert len(digests) == 1, {k: r.stdout for k, r in runs.items()}


def test_benchmark_times_every_method_on_every_input(tmp_path: Path) -> None:
    out = tmp_path / "codecs"
    args = ["--sizes", "", "--throughput-size", "", "--inputs", "randn,zeros,ties+res"]
    args += ["--inputs-size", "64K", "--reps", "1", "--out", str(out)]
    assert codecs.main(args) == 0
    rows = json.loads((out / "inputs.json").read_text())
    keys = {(r["method"], r["impl"]) for r in rows}
    assert ("copy", "torch") in keys and ("top-k 1% + EF", "torch ops") in keys
    assert {"int8 + EF", "top-k 1% + EF", "random-k 1% + EF", "fp16 cast", "bf16 cast"} <= {
        m for m, _ in keys
    }
    for method, impl in keys:
        mine = [r for r in rows if (r["method"], r["impl"]) == (method, impl)]
        assert [r["input"] for r in mine] == ["randn", "zeros", "ties+res"]
        assert all(r["ms"] > 0 and r["numel"] == 1 << 16 for r in mine)
    table = (out / "inputs.md").read_text()
    assert "| top-k 1% + EF | xcomm |" in table and "ties+res ms" in table


def test_benchmark_times_top_k_on_half_buckets(tmp_path: Path) -> None:
    out = tmp_path / "codecs"
    args = ["--sizes", "", "--throughput-size", "", "--inputs", "zeros,ties"]
    args += ["--inputs-size", "64K", "--reps", "1", "--inputs-dtype", "bfloat16", "--out", str(out)]
    assert codecs.main(args) == 0
    rows = json.loads((out / "inputs.json").read_text())
    assert {(r["method"], r["impl"]) for r in rows} == {
        ("copy", "torch"),
        ("top-k 1% + EF", "xcomm"),
        ("top-k 1% + EF", "torch ops"),
    }
    assert all(r["dtype"] == "bfloat16" and r["ms"] > 0 for r in rows)
