"""Differential fuzzing: seeded random programs run on xcomm and on gloo side by side.

Every rank builds the same random program from ``--seed``: a sequence of
batches of collectives (all_reduce, broadcast, all_gather, all_gather_into_tensor,
reduce_scatter_tensor, reduce, gather, scatter, all_to_all_single, barrier)
with random dtypes, reduce ops, roots and sizes from 0 B to about 1 MiB. Each
batch is issued asynchronously on an xcomm group, then waited for in an
order that differs between ranks (a legal program: it is what on-demand
fusion once got wrong), and the same ops run synchronously on a gloo group
over the same ranks. Results must match: bitwise for integers and wherever
the reduction order is fixed, ``torch.testing.assert_close`` otherwise, and
a loose bound for the lossy compressed all_reduce. An op that raises on one
backend must raise on the other. A hang is the run's timeout.

Each ``Options`` combination (shm on/off x fusion off / on demand / cycle x
compression none / fp16) is one run of fresh ranks, so a crash or hang is
pinned to its configuration.

Example::

    python -m xcomm_bench.fuzz --seed 1 --ops 2000            # every combination
    python -m xcomm_bench.fuzz --seed 7 --ops 500 --configs shm-ondemand-none
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from xcomm_bench.launch import module_command, run_ranks

DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8"]
OPS = [
    "all_reduce",
    "all_reduce",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "all_to_all_single",
    "barrier",
]


@dataclasses.dataclass(frozen=True)
class Config:
    shm: bool
    fusion: str  # "off" | "ondemand" | "cycle"
    compression: str  # "none" | "fp16"

    @property
    def name(self) -> str:
        return f"{'shm' if self.shm else 'noshm'}-{self.fusion}-{self.compression}"

    def options_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"shm": self.shm}
        if self.fusion != "off":
            kw["fusion_threshold_bytes"] = 4096
        if self.fusion == "cycle":
            kw["fusion_cycle_ms"] = 2.0
        if self.compression != "none":
            kw["compression"] = self.compression
        return kw


CONFIGS = [
    Config(shm, fusion, comp)
    for shm, fusion, comp in itertools.product(
        (True, False), ("off", "ondemand", "cycle"), ("none", "fp16")
    )
]


def _numel(rng: random.Random) -> int:
    kind = rng.random()
    if kind < 0.05:
        return 0
    if kind < 0.45:
        return rng.randint(1, 64)
    if kind < 0.85:
        return rng.randint(65, 4096)
    if kind < 0.97:
        return rng.randint(4097, 40000)
    return rng.randint(40001, 200000)


def make_program(seed: int, ops: int, world: int) -> list[list[dict[str, Any]]]:
    """The program, as batches of op descriptions; identical on every rank."""
    rng = random.Random(seed)
    batches: list[list[dict[str, Any]]] = []
    count = 0
    while count < ops:
        batch = []
        if rng.random() < 0.2:
            # A burst of small allreduces of one kind: what fusion holds.
            dtype = rng.choice(DTYPES)
            red = rng.choice(["SUM", "MAX"])
            for _ in range(rng.randint(3, 8)):
                batch.append(
                    {
                        "op": "all_reduce",
                        "dtype": dtype,
                        "red": red,
                        "n": rng.randint(1, 200),
                        "root": 0,
                    }
                )
            batches.append(batch)
            count += len(batch)
            continue
        for _ in range(rng.choice([1, 1, 2, 3, 4])):
            op = rng.choice(OPS)
            dtype = rng.choice(DTYPES)
            integral = dtype.startswith(("int", "uint"))
            red = rng.choice(
                ["SUM", "MAX", "MIN", "PRODUCT"] + (["BAND", "BOR", "BXOR"] if integral else [])
            )
            n = _numel(rng)
            if op in ("reduce_scatter_tensor", "all_to_all_single"):
                n -= n % world
            batch.append(
                {"op": op, "dtype": dtype, "red": red, "n": n, "root": rng.randrange(world)}
            )
        batches.append(batch)
        count += len(batch)
    return batches


# ---------------------------------------------------------------- one rank


def _input(torch: Any, spec: dict[str, Any], index: int, rank: int, numel: int) -> Any:
    g = torch.Generator().manual_seed(hash((index, rank)) & 0x7FFFFFFF)
    dtype = getattr(torch, spec["dtype"])
    if dtype.is_floating_point:
        # PRODUCT of many ranks stays finite; exact sums for the float16 range.
        return (torch.rand(numel, generator=g) + 0.5).to(dtype)
    return torch.randint(0, 4, (numel,), generator=g).to(dtype)


def _issue(
    dist: Any,
    torch: Any,
    spec: dict[str, Any],
    index: int,
    rank: int,
    world: int,
    group: Any,
    async_op: bool,
) -> tuple[Any, list[Any]]:
    """Issues one op; returns (work or None, the tensors holding its result)."""
    op, n, root = spec["op"], spec["n"], spec["root"]
    red = getattr(dist.ReduceOp, spec["red"])
    x = _input(torch, spec, index, rank, n)
    kw = {"group": group, "async_op": async_op}
    if op == "all_reduce":
        return dist.all_reduce(x, op=red, **kw), [x]
    if op == "broadcast":
        return dist.broadcast(x, src=root, **kw), [x]
    if op == "all_gather":
        outs = [torch.empty_like(x) for _ in range(world)]
        return dist.all_gather(outs, x, **kw), outs
    if op == "all_gather_into_tensor":
        out = torch.empty(n * world, dtype=x.dtype)
        return dist.all_gather_into_tensor(out, x, **kw), [out]
    if op == "reduce_scatter_tensor":
        out = torch.empty(n // world, dtype=x.dtype)
        return dist.reduce_scatter_tensor(out, x, op=red, **kw), [out]
    if op == "reduce":
        w = dist.reduce(x, dst=root, op=red, **kw)
        return w, [x] if rank == root else []  # non-roots' buffers are unspecified
    if op == "gather":
        outs = [torch.empty_like(x) for _ in range(world)] if rank == root else None
        return dist.gather(x, gather_list=outs, dst=root, **kw), outs or []
    if op == "scatter":
        ins = [_input(torch, spec, index, rank * 100 + r, n) for r in range(world)]
        out = torch.empty_like(x)
        return dist.scatter(out, ins if rank == root else None, src=root, **kw), [out]
    if op == "all_to_all_single":
        out = torch.empty_like(x)
        return dist.all_to_all_single(out, x, **kw), [out]
    if op == "barrier":
        return dist.barrier(**kw), []
    raise ValueError(op)


def _close(torch: Any, got: Any, ref: Any, lossy: bool) -> str | None:
    if got.dtype != ref.dtype or got.shape != ref.shape:
        return f"dtype/shape {got.dtype}{tuple(got.shape)} vs {ref.dtype}{tuple(ref.shape)}"
    if torch.equal(got, ref) or got.numel() == 0:
        return None
    if not got.dtype.is_floating_point:
        return f"integers differ at {int((got != ref).nonzero()[0])}"
    if lossy:
        scale = ref.double().abs().max().item() or 1.0
        err = (got.double() - ref.double()).abs().max().item()
        return None if err <= 0.02 * scale else f"lossy error {err:.3g} of {scale:.3g}"
    try:
        torch.testing.assert_close(got, ref, equal_nan=True)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return None


def _worker(args: argparse.Namespace) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    import xcomm

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13's renamed ops

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    config = next(c for c in CONFIGS if c.name == args.config)
    group = dist.new_group(
        backend="xcomm", pg_options=xcomm.Options(timeout=timeout, **config.options_kwargs())
    )
    ref = dist.new_group(backend="gloo")
    wait_rng = random.Random(args.seed * 1000 + rank)  # differs between ranks, legally
    mismatches: list[str] = []
    ops = 0
    both_raised = 0  # ops gloo refuses too (e.g. a dtype it lacks): agreement, not a pass
    index = 0
    for batch in make_program(args.seed, args.ops, world):
        issued = []
        for spec in batch:
            try:
                work, outs = _issue(dist, torch, spec, index, rank, world, group, True)
                issued.append((spec, index, work, outs, None))
                # Sometimes wait for an earlier op before issuing the next, at
                # points that differ between ranks (legal; fusion must not care).
                if len(issued) > 1 and wait_rng.random() < 0.3:
                    earlier = issued[wait_rng.randrange(len(issued) - 1)][2]
                    if earlier is not None:
                        earlier.wait()
            except Exception as e:  # noqa: BLE001 - compared with gloo's outcome
                issued.append((spec, index, None, [], f"{type(e).__name__}: {e}"))
            index += 1
        order = list(range(len(issued)))
        wait_rng.shuffle(order)
        errors = {}
        for i in order:
            spec, idx, work, outs, err = issued[i]
            if work is not None:
                try:
                    work.wait()
                except Exception as e:  # noqa: BLE001
                    errors[i] = f"{type(e).__name__}: {e}"
        for i, (spec, idx, _work, outs, err) in enumerate(issued):
            err = err or errors.get(i)
            try:
                _, ref_outs = _issue(dist, torch, spec, idx, rank, world, ref, False)
                ref_err = None
            except Exception as e:  # noqa: BLE001
                ref_outs, ref_err = [], f"{type(e).__name__}: {e}"
            ops += 1
            where = f"op {idx} {spec}"
            if (err is None) != (ref_err is None):
                mismatches.append(f"{where}: xcomm {err or 'ok'} / gloo {ref_err or 'ok'}")
                if err is not None:
                    break  # the xcomm group may be out of step now
                continue
            both_raised += err is not None
            lossy = (
                config.compression != "none"
                and spec["op"] == "all_reduce"
                and spec["dtype"] in ("float32", "float64")
            )
            for k, (got, want) in enumerate(zip(outs, ref_outs)):
                problem = _close(torch, got, want, lossy)
                if problem:
                    mismatches.append(f"{where} output {k}: {problem}")
        else:
            continue
        break
    Path(args.out).write_text(
        json.dumps({"rank": rank, "ops": ops, "both_raised": both_raised, "mismatches": mismatches})
    )
    dist.destroy_process_group()


# ---------------------------------------------------------------- controller


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ops", type=int, default=1000, help="ops per configuration")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--configs", default="all", help="comma-separated names, or all")
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="worker: its JSON; controller: the summary JSON")
    args = parser.parse_args(argv)
    if args.worker:
        args.out = args.out.replace("{rank}", os.environ["RANK"])
        _worker(args)
        return 0

    from tqdm import tqdm

    chosen = (
        CONFIGS
        if args.configs == "all"
        else [c for c in CONFIGS if c.name in args.configs.split(",")]
    )
    summary: dict[str, Any] = {"seed": args.seed, "world_size": args.world_size, "runs": {}}
    total_ops = total_bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for config in tqdm(chosen, desc="fuzz configs", unit="config"):
            out = os.path.join(tmp, config.name + "-{rank}.json")
            command = module_command(
                "xcomm_bench.fuzz",
                "--worker",
                "--config",
                config.name,
                "--seed",
                str(args.seed),
                "--ops",
                str(args.ops),
                "--pg-timeout",
                str(args.pg_timeout),
                "--out",
                out,
            )
            start = time.monotonic()
            status = run_ranks(command, args.world_size, timeout=120 + 0.2 * args.ops)
            ranks = []
            for r in range(args.world_size):
                path = Path(out.replace("{rank}", str(r)))
                ranks.append(json.loads(path.read_text()) if path.exists() else None)
            ops = min((r["ops"] for r in ranks if r), default=0)
            both_raised = max((r["both_raised"] for r in ranks if r), default=0)
            bad = sorted({m for r in ranks if r for m in r["mismatches"]})
            outcome = "ok" if status == 0 and not bad else ("hang" if status == 124 else "fail")
            if status not in (0, 124):
                outcome = "crash" if not all(ranks) else "fail"
            summary["runs"][config.name] = {
                "status": status,
                "outcome": outcome,
                "ops": ops,
                "both_raised": both_raised,
                "mismatches": bad[:50],
                "seconds": round(time.monotonic() - start, 1),
            }
            total_ops += ops
            total_bad += len(bad) + (outcome != "ok" and not bad)
    summary["total_ops"] = total_ops
    summary["failures"] = total_bad
    text = json.dumps(summary, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0 if total_bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
