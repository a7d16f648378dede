"""Fusion benchmark: many small async allreduces, fused vs not, side by side.

``python -m xcomm.bench fusion`` spawns 2 ranks on loopback. Each builds two
xcomm groups over the same ranks, one with
``Options(fusion_threshold_bytes=...)`` and one without, and times, round-robin,
a burst of ``--ops`` async allreduces of ``--elems`` float32 each followed by
waiting for all of them (the pattern of per-parameter gradient averaging in a
hand-written loop). It reports the median burst time of each and their ratio,
and checks the fused results against the unfused ones.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Any


def _rank(
    rank: int, world: int, store_path: str, args: argparse.Namespace, out: Any
) -> None:
    import torch
    import torch.distributed as dist

    import xcomm

    torch.set_num_threads(1)
    dist.init_process_group(
        "xcomm",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    groups = {
        "unfused": dist.new_group(backend="xcomm"),
        "fused": dist.new_group(
            backend="xcomm",
            pg_options=xcomm.Options(fusion_threshold_bytes=args.threshold),
        ),
    }
    g = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(args.elems, generator=g) for _ in range(args.ops)]
    times: dict[str, list[float]] = {k: [] for k in groups}
    results: dict[str, list[torch.Tensor]] = {}
    for i in range(args.warmup + args.rounds):
        for name, group in groups.items():
            ts = [t.clone() for t in inputs]
            dist.barrier()
            t0 = time.perf_counter()
            works = [dist.all_reduce(t, group=group, async_op=True) for t in ts]
            for w in works:
                w.wait()
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times[name].append(dt)
            results[name] = ts
    same = all(torch.equal(a, b) for a, b in zip(results["fused"], results["unfused"]))
    # Slowest rank per round, from every rank.
    t = torch.tensor([times["unfused"], times["fused"]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put({"unfused": t[0].tolist(), "fused": t[1].tolist(), "identical": same})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m xcomm.bench fusion", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--ops", type=int, default=200, help="allreduces per burst (default 200)"
    )
    p.add_argument(
        "--elems", type=int, default=256, help="float32 elements each (default 256)"
    )
    p.add_argument(
        "--threshold",
        type=int,
        default=64 << 10,
        help="fusion threshold, bytes (default 64K)",
    )
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    if min(args.ops, args.elems, args.threshold, args.rounds) < 1:
        print(
            "error: --ops, --elems, --threshold and --rounds must be >= 1",
            file=sys.stderr,
        )
        return 2
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, 2, store, args, out)) for r in range(2)
        ]
        for proc in procs:
            proc.start()
        res = out.get(timeout=600)
        for proc in procs:
            proc.join()
    un, fu = statistics.median(res["unfused"]), statistics.median(res["fused"])
    print(
        f"2 ranks on loopback, {args.ops} async allreduces of {args.elems} float32 "
        f"({args.elems * 4} B), threshold {args.threshold} B, {args.rounds} rounds"
    )
    print(
        f"unfused: {un * 1e3:.2f} ms   fused: {fu * 1e3:.2f} ms   fused/unfused = {fu / un:.3f}"
    )
    print(f"results identical: {res['identical']}")
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
