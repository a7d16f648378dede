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

It then measures throughput against memory speed: for each of ``--threads-list``
(default 1 and 2 torch threads), one float32 bucket of ``--throughput-size``
elements (default 16M) goes through each method's encode and decode with error
feedback, and the rate (bucket bytes / time) is set beside the machine's copy
bandwidth (``dst.copy_(src)`` of the same bucket, same run, same threads).
The target is at least 25% of the single-core copy rate for every method.

With ``--inputs`` it times every method on gradients unlike ``torch.randn``
(one ``--inputs-size`` bucket, ``--inputs-threads`` threads), xcomm beside the
same codec in torch ops and beside a copy, all taking turns in one run:
``zeros`` (99.7% exact zeros), ``ties`` (every element equal), ``rows`` (an
embedding gradient: 0.5% of its 64-wide rows nonzero), and each of those
with ``+res``, a small dense residual added (what error feedback leaves
behind once any step was dense). ``all`` names every input.
``--inputs-dtype float16`` (or ``bfloat16``, ``float64``) casts those inputs
to that dtype and times top-k (xcomm and torch ops) beside the copy only; the
other codecs take float32 buckets.

Example::

    python -m xcomm_bench codecs --sizes 1M,4M,16M --out bench-results/codecs
    python -m xcomm_bench codecs --sizes "" --throughput-size "" --inputs all
    python -m xcomm_bench codecs --sizes "" --throughput-size "" --inputs all \\
        --inputs-dtype bfloat16 --inputs-size 8M
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

__all__ = ["INPUTS", "main", "make_input", "measure", "measure_inputs"]

CHUNK = 1024
DENSITY = 0.01


# -- inputs ------------------------------------------------------------------

ROW = 64  # the embedding dimension of the "rows" input
NONZERO = 0.003  # "zeros": the fraction of elements that are not exactly zero
ROWS_TOUCHED = 0.005  # "rows": the fraction of rows a batch touched
RESIDUAL = 1e-3  # "+res": the residual's scale against the gradient's unit scale
INPUTS = ("randn", "zeros", "ties", "rows", "zeros+res", "ties+res", "rows+res")


def make_input(name: str, numel: int, gen: torch.Generator) -> torch.Tensor:
    """One float32 bucket of ``numel`` elements shaped like a kind of gradient.

    >>> x = make_input("zeros", 100_000, torch.Generator().manual_seed(0))
    >>> int((x != 0).sum())
    300
    """
    base, _, extra = name.partition("+")
    if base == "randn":
        flat = torch.randn(numel, generator=gen)
    elif base == "zeros":
        flat = torch.zeros(numel)
        hit = torch.randperm(numel, generator=gen)[: max(1, round(NONZERO * numel))]
        flat[hit] = torch.randn(hit.numel(), generator=gen)
    elif base == "ties":
        flat = torch.full((numel,), 0.25)
    elif base == "rows":
        if numel % ROW:
            raise ValueError(f"'rows' needs a bucket of whole {ROW}-wide rows, got {numel}")
        table = torch.zeros(numel // ROW, ROW)
        rows = torch.randperm(table.size(0), generator=gen)
        rows = rows[: max(1, round(ROWS_TOUCHED * table.size(0)))]
        table[rows] = torch.randn(rows.numel(), ROW, generator=gen)
        flat = table.view(-1)
    else:
        raise ValueError(f"unknown input {name!r}; choose from {', '.join(INPUTS)}")
    if extra == "res":
        flat += RESIDUAL * torch.randn(numel, generator=gen)
    elif extra:
        raise ValueError(f"unknown input {name!r}; choose from {', '.join(INPUTS)}")
    return flat


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
    """What one rank computes in the int8 hook; the network's part (alltoall,
    allgather) is left out: this rank's packed rows stand in for the rows it
    receives, and again for the gathered means it decodes (the same shape and
    work; a network delivers them contiguous, so no copy is timed for them)."""
    shard = codec.shard_elems(flat.numel(), world)
    packed = codec.pack_shards_with_feedback(flat, world, fb, 0)
    codec.reduce_and_pack(packed, shard, float(world))
    codec.unpack_all(packed, shard, out)


def xcomm_topk(
    codec: _C.TopKCodec, flat: torch.Tensor, k: int, world: int, out: torch.Tensor
) -> None:
    packed = codec.encode(0, flat, k)
    codec.decode(packed.expand(world, -1), k, out, float(world))


def xcomm_randomk(
    codec: _C.RandomKCodec, flat: torch.Tensor, step: int, world: int, out: torch.Tensor
) -> None:
    positions = codec.positions(0, step, flat.numel(), DENSITY, flat.device)
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


def measure_throughput(numel: int, threads: int, world: int, reps: int) -> list[dict]:
    """GB/s of each method's encode + decode (with error feedback where the
    method has it) beside the copy bandwidth, for one thread count.

    Rates are bucket bytes (float32) / time, the copy's too, so the ratio
    reads as "this codec processes a bucket at x of the speed memory copies it".
    """
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    flat = torch.randn(numel, generator=gen)
    out = torch.empty_like(flat)
    k = max(1, math.ceil(DENSITY * numel))
    int8, feedback = _C.Int8Codec(CHUNK), _C.ErrorFeedback()
    topk_exact = _C.TopKCodec(False, True, 4096, 0)
    randk = _C.RandomKCodec(0, True)
    steps = iter(range(10**9))
    half = torch.empty(numel, dtype=torch.float16)
    bf16 = torch.empty(numel, dtype=torch.bfloat16)
    methods: dict[str, Callable[[], object]] = {
        "copy (reference)": lambda: out.copy_(flat),
        "int8 + EF": lambda: xcomm_int8(int8, feedback, flat, world, out),
        f"top-k {DENSITY:.0%} + EF": lambda: xcomm_topk(topk_exact, flat, k, world, out),
        f"random-k {DENSITY:.0%} + EF": lambda: xcomm_randomk(randk, flat, next(steps), world, out),
        "fp16 cast": lambda: (half.copy_(flat), out.copy_(half)),
        "bf16 cast": lambda: (bf16.copy_(flat), out.copy_(bf16)),
    }
    seconds = {name: [] for name in methods}
    for fn in methods.values():
        fn()
    for _ in range(reps):  # round-robin, so a busy moment slows every method alike
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
    nbytes = 4 * numel
    copy_gbs = nbytes / statistics.median(seconds["copy (reference)"]) / 1e9
    rows = []
    for name, ts in seconds.items():
        gbs = nbytes / statistics.median(ts) / 1e9
        rows.append(
            {
                "threads": threads,
                "numel": numel,
                "method": name,
                "ms": 1000 * statistics.median(ts),
                "gb_s": gbs,
                "copy_gb_s": copy_gbs,
                "ratio": gbs / copy_gbs,
                "isa": _C.codec_kernels_isa(),
            }
        )
    return rows


DTYPES = {"float32": torch.float32, "float16": torch.float16}
DTYPES.update({"bfloat16": torch.bfloat16, "float64": torch.float64})


def measure_inputs(
    numel: int,
    inputs: list[str],
    threads: int,
    world: int,
    reps: int,
    dtype: torch.dtype = torch.float32,
) -> list[dict]:
    """Rows (input, method, impl, ms) of every method on each input.

    Per input, fresh codecs (so no residual carries over from another input);
    the copy, xcomm's codecs and their torch-ops versions take turns
    repetition by repetition, so a busy moment slows them alike. With a
    ``dtype`` other than float32, the inputs are cast to it and only the copy
    and top-k are timed.

    >>> rows = measure_inputs(4096, ["zeros"], 1, 2, 1, torch.float16)
    >>> sorted({r["method"] for r in rows}), rows[0]["dtype"]
    (['copy', 'top-k 1% + EF'], 'float16')
    """
    torch.set_num_threads(threads)
    rows = []
    for name in inputs:
        for (method, impl), ts in _time_input(name, numel, world, reps, dtype).items():
            rows.append(
                {
                    "input": name,
                    "numel": numel,
                    "dtype": str(dtype).removeprefix("torch."),
                    "threads": threads,
                    "method": method,
                    "impl": impl,
                    "ms": 1000 * statistics.median(ts),
                    "isa": _C.codec_kernels_isa(),
                }
            )
    return rows


def _time_input(
    name: str, numel: int, world: int, reps: int, dtype: torch.dtype = torch.float32
) -> dict[tuple[str, str], list]:
    gen = torch.Generator().manual_seed(2)
    flat = make_input(name, numel, gen).to(dtype)
    out = torch.empty_like(flat)
    k = max(1, math.ceil(DENSITY * numel))
    residuals = [torch.zeros_like(flat) for _ in range(3)]
    int8, feedback = _C.Int8Codec(CHUNK), _C.ErrorFeedback()
    topk = _C.TopKCodec(False, True, 4096, 0)
    randk = _C.RandomKCodec(0, True)
    steps = iter(range(10**9))
    half = torch.empty(numel, dtype=torch.float16)
    bf16 = torch.empty(numel, dtype=torch.bfloat16)
    impls: dict[tuple[str, str], Callable[[], object]] = {
        ("copy", "torch"): lambda: out.copy_(flat),
        ("int8 + EF", "xcomm"): lambda: xcomm_int8(int8, feedback, flat, world, out),
        ("int8 + EF", "torch ops"): lambda: torch_int8(flat, residuals[0], world, out),
        ("top-k 1% + EF", "xcomm"): lambda: xcomm_topk(topk, flat, k, world, out),
        ("top-k 1% + EF", "torch ops"): lambda: torch_topk(flat, residuals[1], k, world, out),
        ("random-k 1% + EF", "xcomm"): lambda: xcomm_randomk(randk, flat, next(steps), world, out),
        ("random-k 1% + EF", "torch ops"): lambda: torch_randomk(
            flat, residuals[2], k, world, out, gen
        ),
        ("fp16 cast", "torch"): lambda: (half.copy_(flat), out.copy_(half)),
        ("bf16 cast", "torch"): lambda: (bf16.copy_(flat), out.copy_(bf16)),
    }
    if dtype != torch.float32:  # the other codecs take float32 buckets
        impls = {key: fn for key, fn in impls.items() if key[0] in ("copy", "top-k 1% + EF")}
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in impls}
    for fn in impls.values():
        fn()  # warm-up: allocations, first touch
    for _ in range(reps):
        for key, fn in impls.items():
            t0 = time.perf_counter()
            fn()
            seconds[key].append(time.perf_counter() - t0)
    return seconds


def format_inputs(rows: list[dict]) -> str:
    """Markdown: ms per method (rows) and input (columns), the worst input
    against randn, and the ratio to torch ops and to the copy on that input."""
    inputs = list(dict.fromkeys(r["input"] for r in rows))
    ms = {(r["method"], r["impl"], r["input"]): r["ms"] for r in rows}
    keys = list(dict.fromkeys((r["method"], r["impl"]) for r in rows))
    head = " | ".join(f"{name} ms" for name in inputs)
    lines = [
        f"| method | impl | {head} | worst / randn | worst input / copy | torch ops / xcomm (worst) |",
        "|---|---|" + "---:|" * (len(inputs) + 3),
    ]
    for method, impl in keys:
        times = [ms[(method, impl, name)] for name in inputs]
        worst = max(range(len(inputs)), key=lambda i: times[i])
        base = ms.get((method, impl, "randn"), float("nan"))
        copy = ms[("copy", "torch", inputs[worst])]
        torch_ms = ms.get((method, "torch ops", inputs[worst]))
        vs_torch = f"{torch_ms / times[worst]:.1f}x" if torch_ms and impl == "xcomm" else ""
        cells = " | ".join(f"{t:.2f}" for t in times)
        lines.append(
            f"| {method} | {impl} | {cells} | {times[worst] / base:.2f} ({inputs[worst]}) | "
            f"{times[worst] / copy:.1f} | {vs_torch} |"
        )
    return "\n".join(lines)


TARGET_RATIO = 0.25


def format_throughput(rows: list[dict]) -> str:
    """Markdown: per method and thread count, GB/s and the ratio to copy."""
    single = {r["method"]: r for r in rows if r["threads"] == 1}
    lines = [
        "| method | threads | ms | GB/s | copy GB/s | / copy | / 1-thread copy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = single.get("copy (reference)", r)
        vs_single = r["gb_s"] / base["gb_s"] if single else float("nan")
        flag = "" if r["method"].startswith("copy") or vs_single >= TARGET_RATIO else " (below 25%)"
        lines.append(
            f"| {r['method']} | {r['threads']} | {r['ms']:.2f} | {r['gb_s']:.2f} | "
            f"{r['copy_gb_s']:.2f} | {r['ratio']:.2f} | {vs_single:.2f}{flag} |"
        )
    return "\n".join(lines)


def plot_throughput(rows: list[dict], path: Path) -> None:
    """Bars of GB/s per method and thread count, with the copy rate and the target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [r["method"] for r in rows if r["threads"] == rows[0]["threads"]]
    threads = sorted({r["threads"] for r in rows})
    width = 0.8 / len(threads)
    fig, ax = plt.subplots(figsize=(8, 4))
    for j, t in enumerate(threads):
        vals = [
            next(r["gb_s"] for r in rows if r["threads"] == t and r["method"] == m) for m in methods
        ]
        ax.bar([i + j * width for i in range(len(methods))], vals, width, label=f"{t} thread(s)")
    copy1 = next(
        r["gb_s"] for r in rows if r["threads"] == threads[0] and r["method"].startswith("copy")
    )
    ax.axhline(TARGET_RATIO * copy1, color="red", linestyle="--", label="25% of 1-thread copy")
    ax.set_xticks([i + width * (len(threads) - 1) / 2 for i in range(len(methods))])
    ax.set_xticklabels(methods, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("GB/s (float32 bucket bytes / time)")
    ax.set_title(f"encode + decode, {rows[0]['numel']:,} elements, kernels: {rows[0]['isa']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    p.add_argument("--throughput-size", default="16M", help="bucket for the GB/s table ('' skips)")
    p.add_argument("--threads-list", default="1,2", help="thread counts of the GB/s table")
    p.add_argument(
        "--inputs",
        default="",
        help=f"inputs of the per-input table, comma-separated, or 'all' ({', '.join(INPUTS)}); "
        "'' skips it",
    )
    p.add_argument("--inputs-size", default="4M", help="bucket of the per-input table")
    p.add_argument("--inputs-threads", type=int, default=1, help="torch threads of that table")
    p.add_argument(
        "--inputs-dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="dtype of that table's buckets (other than float32: top-k and the copy only)",
    )
    args = p.parse_args(argv)
    default_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    sizes = [_parse_size(s) for s in args.sizes.split(",") if s.strip()]
    for size in tqdm(sizes, desc="codecs vs torch ops", unit="size"):
        rows += measure(size, args.world, args.reps)
    if rows:
        table = format_markdown(rows)
        print(f"threads: {torch.get_num_threads()}, world {args.world}, median of {args.reps}")
        print(table)
        (out / "codecs.json").write_text(json.dumps(rows, indent=1))
        (out / "codecs.md").write_text(table + "\n")
    if args.throughput_size:
        numel = _parse_size(args.throughput_size)
        tput: list[dict] = []
        thread_counts = [int(t) for t in args.threads_list.split(",")]
        for t in tqdm(thread_counts, desc="throughput", unit="thread count"):
            tput += measure_throughput(numel, t, args.world, args.reps)
        torch.set_num_threads(args.threads or default_threads)
        table = format_throughput(tput)
        print(
            f"throughput: {numel:,} float32, world {args.world}, median of {args.reps}, "
            f"kernels {_C.codec_kernels_isa()}"
        )
        print(table)
        (out / "throughput.json").write_text(json.dumps(tput, indent=1))
        (out / "throughput.md").write_text(table + "\n")
        plot_throughput(tput, out / "throughput.png")
        print(f"plot: {out / 'throughput.png'}")
    if args.inputs:
        names = list(INPUTS) if args.inputs == "all" else args.inputs.split(",")
        numel = _parse_size(args.inputs_size)
        for name in names:  # a bad name fails now, not after the other tables' minutes
            make_input(name, ROW, torch.Generator())
        dtype = DTYPES[args.inputs_dtype]
        per_input = measure_inputs(numel, names, args.inputs_threads, args.world, args.reps, dtype)
        torch.set_num_threads(args.threads or default_threads)
        table = format_inputs(per_input)
        print(
            f"inputs: {numel:,} {args.inputs_dtype}, {args.inputs_threads} thread(s), "
            f"world {args.world}, "
            f"median of {args.reps}, kernels {_C.codec_kernels_isa()}"
        )
        print(table)
        (out / "inputs.json").write_text(json.dumps(per_input, indent=1))
        (out / "inputs.md").write_text(table + "\n")
    return 0
