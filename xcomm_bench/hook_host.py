"""DDP step time of an xcomm hook where a bucket's host work dominates.

Run: ``python -m xcomm_bench.hook_host [--hook powersgd|int8|topk|randomk] [--world 2]
[--compare-ref REV]``.

A model of 12 ``Linear(64, 64)`` layers in DDP buckets of ``--bucket-mb``
(0.02 MiB: about a layer per bucket), so a bucket's arithmetic is a few
microseconds and its cost is the hook's host work: Python, dispatch, futures,
callbacks, the GIL. Each rank runs DDP without a hook, with xcomm's hook
(``powersgd_hook`` at rank 4, ``int8_compress_hook``, ``topk_hook`` or
``randomk_hook`` at density 1%) and, with
``--compare-ref REV``, with the hook as it was at git revision REV (same
``xcomm._C``, see :func:`xcomm_bench.powersgd_compute.hook_at`). The variants take turns round by
round, each round ``--steps`` forward/backward steps after a barrier; reported
are rank 0's medians over ``--rounds`` rounds of wall and CPU time (every
thread of the process) per step, the hook's cost (step minus the no-hook
step) and xcomm / ref. The two hooks' gradients after the same steps are
compared bit for bit.

torch's ``powerSGD_hook`` is not in the table: with several buckets in flight
on a CPU group its callbacks wait inside callbacks and issue collectives in
completion order (Gloo hangs; xcomm reports the ranks' mismatch).
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
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


def _rank(args: argparse.Namespace, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from xcomm.hooks import int8, powersgd, sparse

    from .powersgd_compute import hook_at

    torch.set_num_threads(1)
    dist.init_process_group("xcomm", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    modules = {"powersgd": powersgd, "int8": int8, "topk": sparse, "randomk": sparse}
    hooks: dict[str, Any] = {"none": None, "xcomm": modules[args.hook]}
    if args.compare_ref:
        hooks["ref"] = hook_at(args.compare_ref, modules[args.hook].__name__.rsplit(".", 1)[1])

    def make(name: str, module: Any) -> tuple[torch.nn.Module, Callable[[], None]]:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(64, 64) for _ in range(12)]
        model = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=args.bucket_mb)
        if module is not None and args.hook == "powersgd":
            state = module.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
            model.register_comm_hook(state, module.powersgd_hook)
        elif module is not None and args.hook == "int8":
            model.register_comm_hook(module.Int8State(None), module.int8_compress_hook)
        elif module is not None and args.hook == "topk":
            model.register_comm_hook(module.TopKState(None, 0.01), module.topk_hook)
        elif module is not None:
            model.register_comm_hook(module.RandomKState(None, 0.01), module.randomk_hook)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))

        def step() -> None:
            model(x).square().mean().backward()

        for _ in range(10):  # past start_powerSGD_iter and DDP's bucket rebuild
            step()
        return model, step

    runs = {name: make(name, module) for name, module in hooks.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (_, step) in runs.items():
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step()
            times[name].append(
                (
                    (time.perf_counter() - wall) / args.steps,
                    (time.process_time() - cpu) / args.steps,
                )
            )
    result: dict[str, Any] = {
        "world": dist.get_world_size(),
        "buckets": len(runs["xcomm"][0]._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")),
    }
    for name, samples in times.items():
        result[name] = statistics.median(s[0] for s in samples) * 1e6
        result[name + "_cpu"] = statistics.median(s[1] for s in samples) * 1e6
    if "ref" in runs:
        grads = [[p.grad for p in runs[n][0].parameters()] for n in ("xcomm", "ref")]
        result["same_grads"] = all(torch.equal(a, b) for a, b in zip(*grads))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m xcomm_bench.hook_host", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--hook", choices=("powersgd", "int8", "topk", "randomk"), default="powersgd"
    )
    parser.add_argument("--world", type=int, default=2, help="ranks, on loopback")
    parser.add_argument("--steps", type=int, default=100, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (medians over them)")
    parser.add_argument("--bucket-mb", type=float, default=0.02)
    parser.add_argument(
        "--compare-ref",
        default=None,
        metavar="REV",
        help="also time xcomm's hook as it was at git revision REV",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # rank 0's result file
    args = parser.parse_args(argv)  # fmt: skip
    if args.worker is not None:
        _rank(args, args.worker)
        return 0

    from .launch import module_command, run_ranks

    passed = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        rc = run_ranks(
            module_command("xcomm_bench.hook_host", *passed, "--worker", out),
            args.world,
            timeout=600,
        )
        if rc != 0:
            print(f"ranks failed (exit {rc})", file=sys.stderr)
            return rc
        with open(out) as f:
            r = json.load(f)
    hook = {"powersgd": "PowerSGD (rank 4)", "topk": "top-k 1%", "randomk": "random-k 1%"}.get(
        args.hook, args.hook
    )
    print(
        f"DDP step with {hook}, 12 x Linear(64), {r['buckets']} buckets, world size "
        f"{r['world']} (xcomm, loopback), 1 torch thread, median of {args.rounds} rounds of "
        f"{args.steps} steps, rank 0"
    )
    names = [n for n in ("none", "xcomm", "ref") if n in r]
    print(f"{'hook':8} {'step us':>8} {'cpu us':>8} {'hook us':>8} {'hook cpu us':>11}")
    for n in names:
        print(
            f"{n:8} {r[n]:8.0f} {r[n + '_cpu']:8.0f} {r[n] - r['none']:8.0f} "
            f"{r[n + '_cpu'] - r['none_cpu']:11.0f}"
        )
    if "ref" in r:
        cost = (r["xcomm"] - r["none"]) / (r["ref"] - r["none"])
        cpu = (r["xcomm_cpu"] - r["none_cpu"]) / (r["ref_cpu"] - r["none_cpu"])
        print(f"hook cost xcomm / ref ({args.compare_ref}): wall {cost:.2f}, cpu {cpu:.2f}")
        print(f"same gradients bit for bit: {r['same_grads']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
