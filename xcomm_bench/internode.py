"""Inter-node bytes and time of allreduce, xcomm (hierarchical) vs flat gloo.

Run as every rank of an emulated cluster, e.g. 2 nodes x 2 ranks at 1 Gbit/s::

    python -m xcomm_bench.cluster run --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        python -m xcomm_bench.internode --sizes 1M,16M --iters 3

Each node's inter-node traffic is the transmit byte counter of its NIC
(``GLOO_SOCKET_IFNAME``, read from ``/proc/net/dev`` inside the node's
namespace) around the timed iterations; intra-node traffic (loopback, shared
memory) does not appear there. For a flat ring over p ranks on n nodes every
rank sends 2(p-1)/p N bytes; the hierarchical allreduce sends only the
leaders' 2(n-1)/n N per node. ``xcomm+fp16`` / ``xcomm+bf16`` /
``xcomm+int8`` in ``--backends`` is xcomm with ``Options(compression=...)``,
which compresses only the leaders' step. Rank 0 prints a table: per size and
backend, the p50 time, the bytes per allreduce summed over all nodes' NICs,
and both as ratios to the last backend listed (gloo by default).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

from .collectives import parse_list, parse_size


def _tx_bytes(ifname: str) -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                return int(rest.split()[8])
    raise RuntimeError(f"interface {ifname} not in /proc/net/dev")


def main() -> None:
    """Entry point of one rank."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,16M", help="message sizes (bytes, K/M/G)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument(
        "--backends",
        default="xcomm,gloo",
        help="xcomm, xcomm+fp16, xcomm+bf16, xcomm+int8, gloo; ratios are to the last one",
    )
    args = parser.parse_args()
    import xcomm
    import xcomm.shm

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=600)
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    groups = {}
    for label in parse_list(args.backends):
        name, _, method = label.partition("+")
        options = xcomm.Options(compression=method) if method else None
        groups[label] = dist.new_group(backend=name, timeout=timeout, pg_options=options)
    rows = []
    for size in [parse_size(s) for s in parse_list(args.sizes)]:
        t = torch.ones(size // 4)
        for name, group in groups.items():
            t.fill_(1.0 / world)
            dist.all_reduce(t, group=group)  # warm-up: connections, first touch
            dist.barrier()
            before = _tx_bytes(ifname)
            times = []
            for _ in range(args.iters):
                t.fill_(1.0 / world)  # sums stay 1: no overflow in any precision
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t, group=group)
                times.append(time.perf_counter() - t0)
            dist.barrier()
            sent = _tx_bytes(ifname) - before if local_rank == 0 else 0
            stats = torch.tensor([float(sent), sorted(times)[len(times) // 2]], dtype=torch.float64)
            everyone = [torch.empty_like(stats) for _ in range(world)]
            dist.all_gather(everyone, stats)
            total_bytes = sum(s[0].item() for s in everyone) / args.iters
            p50 = max(s[1].item() for s in everyone)
            rows.append((size, name, p50, total_bytes))
    if rank == 0:
        mode = (
            "shared memory (hierarchical across nodes)"
            if xcomm.shm.is_active(groups.get("xcomm"))
            else "gloo"
        )
        print(f"# {world} ranks; xcomm CPU transport: {mode}")
        base = list(groups)[-1]
        print(
            f"{'size':>10} {'backend':>11} {'time(ms)':>10} {'inter-node MB/allreduce':>24} "
            f"{'time/' + base:>12} {'bytes/' + base:>12}"
        )
        ref = {size: (p50, nbytes) for size, name, p50, nbytes in rows if name == base}
        for size, name, p50, nbytes in rows:
            print(
                f"{size:>10} {name:>11} {p50 * 1e3:>10.1f} {nbytes / 1e6:>24.2f} "
                f"{p50 / ref[size][0]:>12.2f} {nbytes / max(ref[size][1], 1.0):>12.2f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
