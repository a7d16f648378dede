"""Encode+decode cost of xcomm's codecs against plain torch ops, in one run.

``python -m xcomm_bench codecs`` times, per bucket size, what one rank spends
compressing a gradient bucket and decompressing the world's payload, with
error feedback where the method has it:

- int8 (per-chunk scales): xcomm's ``Int8Codec`` against the same
  quantization written with torch ops (``amax``, ``round``, casts);
- top-k (exact and sampled-threshold): xcomm's ``TopKCodec`` against
  ``torch.topk`` on magnitudes plus ``index_add_`` to decode;
- random-k: xcomm's ``RandomKCodec`` against ``torch.randperm`` selection;
- fp16: the cast both torch's ``fp16_compress_hook`` and xcomm's hook do
  (the same two torch ops: listed so the table is complete).

No communication is involved: the "world" payload is this rank's payload
repeated, so decode does the work it would do with ``--world`` ranks.
PowerSGD's compute against torch's ``powerSGD_hook`` on DDP's real buckets
is measured by ``python -m xcomm_bench.powersgd_compute``.

Example::

    python -m xcomm_bench codecs --sizes 1M,4M,16M --out bench-results/codecs
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from xcomm import _C

__all__ = ["main", "measure"]

CHUNK = 1024
DENSITY = 0.01


# -- plain torch versions of the same codecs (the baseline) ------------------


def torch_int8(flat: torch.Tensor, residual: torch.Tensor, world: int, out: torch.Tensor) -> None:
    acc = flat + residual
    n = acc.numel()
    pad = (-n) % CHUNK
    chunks = torch.nn.functional.pad(acc, (0, pad)).view(-1, CHUNK)
    scale = chunks.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127
    q = torch.round(chunks / scale).to(torch.int8)
    sent = (q.float() * scale).view(-1)[:n]
    residual.copy_(acc - sent)
    # decode: the world's (identical) payloads, summed and averaged, re-quantized once
    total = sum(q.float() * scale for _ in range(world)) / world
    scale2 = total.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127
    q2 = torch.round(total / scale2).to(torch.int8)
    out.copy_((q2.float() * scale2).view(-1)[:n])


def torch_topk(
    flat: torch.Tensor, residual: torch.Tensor, k: int, world: int, out: torch.Tensor
) -> None:
    acc = flat + residual
    idx = torch.topk(acc.abs(), k, sorted=False).indices
    vals = acc[idx]
    residual.copy_(acc.index_fill_(0, idx, 0))
    out.zero_()
    for _ in range(world):
        out.index_add_(0, idx, vals)
    out.div_(world)


def torch_randomk(
    flat: torch.Tensor,
    residual: torch.Tensor,
    k: int,
    world: int,
    out: torch.Tensor,
    gen: torch.Generator,
) -> None:
    acc = flat + residual
    idx = torch.randperm(acc.numel(), generator=gen)[:k]
    vals = acc[idx] * world  # what an allreduce of identical payloads sums to
    residual.copy_(acc.index_fill_(0, idx, 0))
    out.zero_()
    out.index_copy_(0, idx, vals / world)


def torch_fp16(flat: torch.Tensor, out: torch.Tensor, world: int) -> None:
    low = flat.to(torch.float16).div_(world)
    out.copy_(low)


# -- xcomm ------------------------------------------------------------------


def xcomm_int8(
    codec: _C.Int8Codec, fb: _C.ErrorFeedback, flat: torch.Tensor, world: int, out: torch.Tensor
) -> None:
    acc = fb.compensate(0, flat)
    shard = codec.shard_elems(flat.numel(), world)
    packed = codec.pack_shards(acc, world)
    sent = torch.empty_like(acc)
    codec.unpack_all(packed, shard, sent)
    fb.store(0, acc.sub_(sent))
    mean = codec.reduce_shards(packed, shard).div_(world)  # world shards of this rank's size
    mine = codec.pack(mean)
    codec.unpack_all(mine.repeat(world), shard, out)


def xcomm_topk(
    codec: _C.TopKCodec, flat: torch.Tensor, k: int, world: int, out: torch.Tensor
) -> None:
    packed = codec.encode(0, flat, k)
    codec.decode(packed.repeat(world), k, out, float(world))


def xcomm_randomk(
    codec: _C.RandomKCodec, flat: torch.Tensor, step: int, world: int, out: torch.Tensor
) -> None:
    positions = codec.positions(0, step, flat.numel(), DENSITY)
    values = codec.encode(0, flat, positions)
    codec.decode(values.mul_(world), positions, out, float(world))


def measure(numel: int, world: int, reps: int) -> list[dict]:
    """Rows (method, implementation, ms) for one bucket size.

    The implementations of a method are timed round-robin (one call of each
    per repetition), so a busy machine slows them alike and the ratio holds.
    """
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(numel, generator=gen)
    out = torch.empty_like(flat)
    k = max(1, math.ceil(DENSITY * numel))
    residuals = [torch.zeros_like(flat) for _ in range(3)]
    int8, feedback = _C.Int8Codec(CHUNK), _C.ErrorFeedback()
    exact = _C.TopKCodec(False, True, 4096, 0)
    approx = _C.TopKCodec(True, True, 4096, 0)
    randk = _C.RandomKCodec(0, True)
    steps = iter(range(10**9))
    methods: dict[str, dict[str, Callable[[], object]]] = {
        "int8": {
            "torch ops": lambda: torch_int8(flat, residuals[0], world, out),
            "xcomm": lambda: xcomm_int8(int8, feedback, flat, world, out),
        },
        "top-k 1%": {
            "torch ops": lambda: torch_topk(flat, residuals[1], k, world, out),
            "xcomm exact": lambda: xcomm_topk(exact, flat, k, world, out),
            "xcomm approximate": lambda: xcomm_topk(approx, flat, k, world, out),
        },
        "random-k 1%": {
            "torch ops": lambda: torch_randomk(flat, residuals[2], k, world, out, gen),
            "xcomm": lambda: xcomm_randomk(randk, flat, next(steps), world, out),
        },
        "fp16": {"torch ops (= both hooks)": lambda: torch_fp16(flat, out, world)},
    }
    rows = []
    for method, impls in methods.items():
        wall: dict[str, list[float]] = {name: [] for name in impls}
        cpu: dict[str, list[float]] = {name: [] for name in impls}
        for fn in impls.values():
            fn()  # warm-up: allocations, first touch
        for _ in range(reps):
            for name, fn in impls.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        for name in impls:
            rows.append(
                {
                    "numel": numel,
                    "method": method,
                    "impl": name,
                    "ms": 1000 * statistics.median(wall[name]),
                    "cpu_ms": 1000 * statistics.median(cpu[name]),
                }
            )
    return rows


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * mult)


def format_markdown(rows: list[dict]) -> str:
    """Wall time (what a step waits) and CPU time (the work, all threads)."""
    lines = [
        (
            "| method | elements | torch ops ms | xcomm ms | torch / xcomm | "
            "torch ops CPU ms | xcomm CPU ms | torch / xcomm (CPU) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_key: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["method"], r["numel"]), {})[r["impl"]] = r
    for (method, numel), impls in by_key.items():
        base = next(v for i, v in impls.items() if i.startswith("torch"))
        others = {i: v for i, v in impls.items() if not i.startswith("torch")}
        if not others:
            lines.append(
                f"| {method} | {numel:,} | {base['ms']:.2f} | (same ops) | 1.0x | "
                f"{base['cpu_ms']:.2f} | (same ops) | 1.0x |"
            )
        for impl, r in others.items():
            name = impl.removeprefix("xcomm").strip() or "xcomm"
            lines.append(
                f"| {method} ({name}) | {numel:,} | {base['ms']:.2f} | {r['ms']:.2f} | "
                f"{base['ms'] / r['ms']:.1f}x | {base['cpu_ms']:.2f} | {r['cpu_ms']:.2f} | "
                f"{base['cpu_ms'] / max(r['cpu_ms'], 1e-9):.1f}x |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xcomm_bench codecs", description=__doc__)
    p.add_argument("--sizes", default="1M,4M,16M", help="bucket sizes in elements (K/M suffixes)")
    p.add_argument("--world", type=int, default=2, help="ranks whose payloads decode sums")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="bench-results/codecs")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm import tqdm

    rows: list[dict] = []
    for size in tqdm([_parse_size(s) for s in args.sizes.split(",")], desc="codecs", unit="size"):
        rows += measure(size, args.world, args.reps)
    table = format_markdown(rows)
    print(f"threads: {torch.get_num_threads()}, world {args.world}, median of {args.reps}")
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codecs.json").write_text(json.dumps(rows, indent=1))
    (out / "codecs.md").write_text(table + "\n")
    return 0
