"""Command line of the emulated cluster (needs root).

Examples::

    # 2 nodes x 2 ranks, 1 Gbit/s per node, run a torch.distributed script in each rank
    python -m xcomm_bench.cluster run --nodes 2 --ranks-per-node 2 --rate 1gbit -- python train.py

    # goodput of one TCP stream against the set rate
    python -m xcomm_bench.cluster goodput --rates 0.1gbit,0.5gbit,1gbit,2.5gbit --seconds 3 --repeats 3

    # remove namespaces left behind by runs killed with SIGKILL
    python -m xcomm_bench.cluster cleanup

Exit status of ``run``: 0 when every rank exited 0; otherwise the first failing
rank's status (128+N for signal N); 128+N too when the tool itself was stopped
by SIGINT/SIGTERM/SIGHUP; 77 when privileges are missing; 124 on ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from collections.abc import Sequence

from ..launch import python_env
from .emulated import (
    ClusterInterrupted,
    ClusterTimeoutError,
    EmulatedCluster,
    RankResult,
    cleanup_stale,
)
from .goodput import GoodputResult, measure_goodput
from .netns import ClusterError, ClusterPermissionError, format_rate, parse_rate

EXIT_NOPERM = 77
EXIT_TIMEOUT = 124


def _rate_arg(text: str) -> int:
    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _add_topology_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--burst",
        type=int,
        default=None,
        metavar="BYTES",
        help="tbf bucket size (default: 1 ms of traffic up to 1 Gbit/s, "
        "rising to 4 ms at 4+ Gbit/s, at least 32 KiB)",
    )
    p.add_argument(
        "--latency-ms", type=float, default=None, help="tbf queue limit as a delay (default 10)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m xcomm_bench.cluster`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m xcomm_bench.cluster",
        description="Emulated cluster: network namespaces as nodes, veth + bridge, tbf rate limits.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser(
        "run",
        help="run a command as every rank of an emulated cluster",
        description="Runs COMMAND once per rank with MASTER_ADDR, MASTER_PORT, "
        "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK and "
        "GLOO_SOCKET_IFNAME set.",
    )
    run.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
    run.add_argument("--ranks-per-node", type=int, default=1, help="ranks per node (default 1)")
    run.add_argument(
        "--rate",
        type=_rate_arg,
        default=None,
        help="per-node rate in each direction, 0.1-10 Gbit/s, e.g. 1gbit (default: unshaped)",
    )
    _add_topology_args(run)
    run.add_argument("--master-port", type=int, default=29500)
    run.add_argument(
        "--timeout", type=float, default=None, help="kill all ranks after this many seconds"
    )
    run.add_argument(
        "--capture",
        action="store_true",
        help="collect each rank's output and print it, rank by rank, at the end",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")

    gp = sub.add_parser(
        "goodput", help="measure TCP goodput between two nodes against the set rate"
    )
    gp.add_argument(
        "--rates",
        default="0.1gbit,0.5gbit,1gbit,2.5gbit",
        help="comma-separated rates (default 0.1gbit,0.5gbit,1gbit,2.5gbit)",
    )
    gp.add_argument(
        "--seconds", type=float, default=3.0, help="length of each transfer (default 3)"
    )
    gp.add_argument("--repeats", type=int, default=3, help="transfers per rate (default 3)")
    _add_topology_args(gp)
    gp.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")

    cl = sub.add_parser("cleanup", help="delete namespaces left by killed runs (xc<pid>-*)")
    cl.add_argument("--all", action="store_true", help="also those of runs that are still alive")
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(
            "error: no command given; usage: ... run [options] -- COMMAND [ARGS...]",
            file=sys.stderr,
        )
        return 2
    with EmulatedCluster(
        args.nodes,
        args.ranks_per_node,
        args.rate,
        burst_bytes=args.burst,
        latency_ms=args.latency_ms,
        master_port=args.master_port,
    ) as cluster:
        shaping = format_rate(cluster.rate_bps) if cluster.rate_bps else "unshaped"
        print(
            f"xcomm_bench.cluster: {cluster.num_nodes} nodes x {cluster.ranks_per_node} ranks, "
            f"{shaping}, namespaces {cluster.prefix}-*",
            file=sys.stderr,
            flush=True,
        )
        try:
            # python_env: a rank's `python -m xcomm_bench...` works from any directory.
            results = cluster.run(
                command, env=python_env(), timeout=args.timeout, capture=args.capture
            )
        except ClusterTimeoutError as e:
            _report(e.results, args.capture)
            print(f"xcomm_bench.cluster: {e}", file=sys.stderr)
            return EXIT_TIMEOUT
    _report(results, args.capture)
    for r in results:
        if r.returncode != 0:
            return r.returncode if r.returncode > 0 else 128 - r.returncode
    return 0


def _report(results: Sequence[RankResult], captured: bool) -> None:
    for r in results:
        if captured:
            print(f"===== rank {r.rank} (node {r.node}) exit {r.returncode} =====", flush=True)
            sys.stdout.write(r.stdout)
            sys.stderr.write(r.stderr)
            sys.stderr.flush()
        print(
            f"xcomm_bench.cluster: rank {r.rank} (node {r.node}, local {r.local_rank}): "
            f"exit {r.returncode} after {r.duration_s:.1f}s",
            file=sys.stderr,
        )


def _cmd_goodput(args: argparse.Namespace) -> int:
    rates = [parse_rate(r) for r in args.rates.split(",") if r.strip()]
    rows: list[tuple[int, list[GoodputResult]]] = []
    for rate in rates:
        with EmulatedCluster(2, 1, rate, burst_bytes=args.burst, latency_ms=args.latency_ms) as c:
            runs = [measure_goodput(c, seconds=args.seconds) for _ in range(args.repeats)]
            rows.append((rate, runs))
            tbf = c.tbf
            for r in runs:
                print(
                    f"  {r}  [tbf burst {tbf.burst_bytes if tbf else 0} B]",
                    file=sys.stderr,
                    flush=True,
                )
    print("| set rate | goodput (median) | min-max | % of set rate (median) |")
    print("|---|---|---|---|")
    for rate, runs in rows:
        good = sorted(r.goodput_bps for r in runs)
        med = statistics.median(good)
        print(
            f"| {format_rate(rate)} | {med / 1e6:.1f} Mbit/s | {good[0] / 1e6:.1f}-{good[-1] / 1e6:.1f} | "
            f"{100 * med / rate:.1f}% |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                [
                    {
                        "rate_bps": rate,
                        "runs": [
                            {"bytes": r.bytes, "seconds": r.seconds, "goodput_bps": r.goodput_bps}
                            for r in runs
                        ],
                    }
                    for rate, runs in rows
                ],
                f,
                indent=1,
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "run":
            return _cmd_run(args)
        if args.cmd == "goodput":
            return _cmd_goodput(args)
        removed = cleanup_stale(include_live=args.all)
        print("\n".join(removed) if removed else "nothing to clean up")
        return 0
    except ClusterPermissionError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NOPERM
    except (ClusterError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ClusterInterrupted as e:
        print(f"xcomm_bench.cluster: {e}; torn down", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("xcomm_bench.cluster: interrupted by SIGINT; torn down", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
