"""Fusion benchmark: many small async allreduces, fused vs not, side by side.

``python -m xcomm_bench fusion`` spawns 2 ranks on loopback. Each builds three
xcomm groups over the same ranks: ``unfused``; ``fused``, with
``Options(fusion_threshold_bytes=...)`` (held ops leave when the threshold
fills or a result is asked for); and ``fused_cycle``, which adds
``fusion_cycle_ms`` (a background thread sends held ops every cycle after
agreeing with the other rank). Round-robin, it times two patterns of ``--ops``
async allreduces of ``--elems`` float32 each, then waiting for all of them:

``burst``
    issued back to back (per-parameter averaging after backward);
``spread``
    ``--compute-us`` of busy work before each (per-parameter averaging
    issued as gradients become ready during backward). Besides the total,
    it reports the *tail*: from the last issue until every result is in,
    the part of the communication that compute did not hide.

It reports medians of the slower rank, ratios to ``unfused``, and checks
that every group's results are identical. ``--rate 100mbit`` runs the two
ranks on 2 emulated nodes (:mod:`xcomm_bench.cluster`, root) joined by a link of
that rate instead of loopback.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

PATTERNS = ("burst", "spread")


def _rank(rank: int, world: int, init_method: str, args: argparse.Namespace, out: Any) -> None:
    """One rank; rank 0 puts the result dict on ``out`` (anything with ``put``)."""
    import torch
    import torch.distributed as dist

    import xcomm

    torch.set_num_threads(1)
    dist.init_process_group(
        "xcomm",
        init_method=init_method,
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
        "fused_cycle": dist.new_group(
            backend="xcomm",
            pg_options=xcomm.Options(
                fusion_threshold_bytes=args.threshold, fusion_cycle_ms=args.cycle_ms
            ),
        ),
    }
    g = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(args.elems, generator=g) for _ in range(args.ops)]
    spin_s = args.compute_us * 1e-6

    def compute() -> None:
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end:
            pass

    keys = [(p, name) for p in PATTERNS for name in groups]
    times: dict[tuple[str, str], list[tuple[float, float]]] = {k: [] for k in keys}
    # The cycle's own view, per measured spread sample on this rank: how many
    # agreement rounds ran, their mean time (ms), and the share of ops already
    # reduced at the last issue (is_completed() does not hurry a cycle).
    cycle_view: list[tuple[float, float, float]] = []
    results: dict[tuple[str, str], list[torch.Tensor]] = {}
    for i in range(args.warmup + args.rounds):
        for pattern, name in keys:
            ts = [t.clone() for t in inputs]
            watch = pattern == "spread" and name == "fused_cycle" and i >= args.warmup
            if watch:
                xcomm.enable_timeline()
            dist.barrier()
            t0 = time.perf_counter()
            works = []
            for t in ts:
                if pattern == "spread":
                    compute()
                works.append(dist.all_reduce(t, group=groups[name], async_op=True))
            t_last = time.perf_counter()
            done_early = sum(w.is_completed() for w in works) / len(works) if watch else 0.0
            for w in works:
                w.wait()
            t_end = time.perf_counter()
            if watch:
                rounds = [
                    e["dur"] / 1e3
                    for e in xcomm.timeline_json(rank)["traceEvents"]
                    if e.get("name") == "FUSION_ROUND"
                ]
                xcomm.disable_timeline()
                mean_ms = statistics.mean(rounds) if rounds else 0.0
                cycle_view.append((float(len(rounds)), mean_ms, done_early))
            if i >= args.warmup:
                times[pattern, name].append((t_end - t0, t_end - t_last))
            results[pattern, name] = ts
    same = all(
        torch.equal(a, b) for k in keys for a, b in zip(results[k], results["burst", "unfused"])
    )
    # Slowest rank per round, from every rank.
    t = torch.tensor([times[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put(
            {
                "times": {f"{p}/{n}": t[j].tolist() for j, (p, n) in enumerate(keys)},
                "identical": same,
                "cycle_view": cycle_view,
            }
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m xcomm_bench fusion", description=__doc__.split("\n")[0]
    )
    p.add_argument("--ops", type=int, default=200, help="allreduces per burst (default 200)")
    p.add_argument("--elems", type=int, default=256, help="float32 elements each (default 256)")
    p.add_argument(
        "--threshold",
        type=int,
        default=64 << 10,
        help="fusion threshold, bytes (default 64K)",
    )
    p.add_argument(
        "--cycle-ms", type=float, default=1.0, help="fused_cycle's cycle time (default 1 ms)"
    )
    p.add_argument(
        "--compute-us",
        type=float,
        default=100.0,
        help="busy work before each op of the spread pattern, us (default 100)",
    )
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--rate",
        default=None,
        help="run on 2 emulated nodes joined by a link of this rate (e.g. 100mbit; needs root) "
        "instead of loopback",
    )
    p.add_argument("--mtu", type=int, default=65000, help="the emulated link's MTU (with --rate)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # result file of rank 0
    args = p.parse_args(argv)
    if args.worker is not None:
        rank = int(os.environ["RANK"])
        _rank(rank, int(os.environ["WORLD_SIZE"]), "env://", args, _JsonFile(args.worker))
        return 0
    if min(args.ops, args.elems, args.threshold, args.rounds) < 1:
        print(
            "error: --ops, --elems, --threshold and --rounds must be >= 1",
            file=sys.stderr,
        )
        return 2
    if args.cycle_ms <= 0 or args.compute_us < 0:
        print("error: --cycle-ms must be > 0 and --compute-us >= 0", file=sys.stderr)
        return 2
    res = _launch(args, list(sys.argv[1:] if argv is None else argv))
    if res is None:
        return 1
    where = (
        f"2 emulated nodes at {args.rate} (MTU {args.mtu})" if args.rate else "2 ranks on loopback"
    )
    print(
        f"{where}, {args.ops} async allreduces of {args.elems} float32 "
        f"({args.elems * 4} B), threshold {args.threshold} B, cycle {args.cycle_ms:g} ms, "
        f"spread: {args.compute_us:g} us of compute before each op; {args.rounds} rounds, "
        "median of the slower rank"
    )
    print(
        f"{'pattern':8} {'group':12} {'total ms':>9} {'/unfused':>9} {'tail ms':>9} {'/unfused':>9}"
    )
    for pattern in PATTERNS:
        base = [statistics.median(x) for x in zip(*res["times"][f"{pattern}/unfused"])]
        for name in ("unfused", "fused", "fused_cycle"):
            total, tail = (statistics.median(x) for x in zip(*res["times"][f"{pattern}/{name}"]))
            print(
                f"{pattern:8} {name:12} {total * 1e3:9.2f} {total / base[0]:9.3f} "
                f"{tail * 1e3:9.2f} {tail / base[1]:9.3f}"
            )
    view = res.get("cycle_view") or []
    if view:
        rounds, mean_ms, early = (statistics.median(x) for x in zip(*view))
        print(
            f"spread/fused_cycle on rank 0 (medians): {rounds:.0f} agreement rounds per sample, "
            f"{mean_ms:.2f} ms each; {early * 100:.0f}% of ops reduced before the final wait"
        )
    print(f"results identical: {res['identical']}")
    return 0 if res["identical"] else 1


class _JsonFile:
    """Where rank 0 puts its result."""

    def __init__(self, path: str) -> None:
        self.path = path

    def put(self, value: dict[str, Any]) -> None:
        with open(self.path, "w") as f:
            json.dump(value, f)


def _launch(args: argparse.Namespace, argv: list[str]) -> dict[str, Any] | None:
    """2 ranks on loopback, or on 2 emulated nodes with ``--rate``; rank 0's result."""
    from .launch import module_command, run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        rc = run_ranks(
            module_command("xcomm_bench.fusion", *argv, "--worker", result),
            2,
            nodes=2 if args.rate else 0,
            rate=args.rate,
            timeout=900,
            cluster_options={"mtu": args.mtu} if args.rate else None,
        )
        if rc != 0:
            print(f"error: ranks failed (exit status {rc})", file=sys.stderr)
            return None
        with open(result) as f:
            return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
