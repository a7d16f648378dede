"""Differential fuzzing: seeded random programs run on xcomm and on gloo side by side.

Every rank builds the same random program from ``--seed``: a sequence of
batches of collectives (all_reduce, broadcast, all_gather, all_gather_into_tensor,
reduce_scatter_tensor, reduce, gather, scatter, all_to_all_single, barrier)
with random dtypes, reduce ops, roots and sizes from 0 B to about 1 MiB. Each
batch runs either on the whole group or on one of the subgroups every rank
creates at start-up, in the same order (:func:`subgroups`: for W >= 3 ranks
``[0..W-2]``, ``[W-2, W-1]`` and ``[0, 1]``; for W = 2 a second group over both
ranks and the single rank ``[1]``); a rank outside a batch's subgroup skips
it, and roots are group ranks (``group_src``/``group_dst``). Each batch is
issued asynchronously on an xcomm group, then waited for in an order that
differs between ranks (a legal program: it is what on-demand fusion once got
wrong), and the same ops run synchronously on a gloo group over the same
ranks. Results must match: bitwise for integers and wherever the reduction
order is fixed, ``torch.testing.assert_close`` otherwise. An op that raises on
one backend must raise on the other. A hang is the run's timeout.

Compression is lossy only where xcomm applies it: a float32/float64 SUM
all_reduce or reduce_scatter_tensor of at least ``compression_min_bytes``
(8 KiB here, above the 4 KiB fusion threshold, so fused bursts and small ops
stay exact and are checked as such). Those results are checked against a bound derived from the
codec, per element ``i``, over the ``g`` ranks of the group with inputs
``x_r`` (``A_i = sum_r |x_r,i|``, ``eps = 2**-24``):

- fp16 / bf16 (unit roundoff ``u`` = 2**-11 / 2**-8: 11 and 8 significant bits): each rank's cast loses
  at most ``u |x_r,i|`` and each of the ``g - 1`` low-precision additions at
  most ``u A_i``, so ``|got - ref| <= (g + 1) u A_i + 2 g eps A_i`` (one ``g``
  of headroom for second-order terms, the last for gloo's float32 sum).
- int8 (one scale ``max|chunk| / 127`` per chunk of ``int8_chunk_elems``,
  round to nearest): stage 1 quantises each rank's chunk ``k`` with error at
  most ``M_r,k / 127 / 2`` per element (``M_r,k = max |x_r| over the chunk``),
  so ``e1 = sum_r M_r,k / 254``; the float32 sum of the dequantised shards is
  quantised again before the allgather, with error at most
  ``(max_k |ref| + e1) / 254``. The bound is ``e1 + (max_k |ref| + e1) / 254``
  plus ``4 g eps sum_r M_r,k`` for float32 accumulation on both sides.
- reduce_scatter_tensor: the same bounds over this rank's row of every
  input (its rows are encoded alone, chunks starting at the row; there is no
  second quantisation, so the allreduce's bound holds with room to spare).
- auto: the larger of the bf16 and int8 bounds, for the all_reduces it may
  compress (none where shm is on: a single-host group's auto sends
  uncompressed; its reduce-scatters are never compressed). Its link is
  measured (probes on the group's own transport between the program's ops),
  so what it picks is whatever this machine's loopback favours.

About one batch in twenty, on the whole group, starts with an op Gloo
refuses (an int16 ``all_reduce``, waited for before the next is issued),
then a ``barrier`` and a random op: the ops after a refused one must
succeed and equal gloo's (an error belongs to the op that caused it). The
refused op itself is not run on the gloo group, whose next barrier then
sometimes raises its error on one rank only (and the other waits in it for
good): it must raise Gloo's error, or on a single-host shared-memory group,
which reduces int16 (documented), be the exact sum. That an async op's
error does not reach a barrier issued while it is in flight is tested on
the checked route in tests/python/test_checked.py. xcomm's single-host shared-memory route reduces int16, which Gloo
refuses (documented); there the refused op must instead be the exact sum
(``rejected_ran``), elsewhere it must raise as gloo's (``rejected_raised``).

Every lossy op whose result is not bitwise the reference is counted
(``lossy_inexact``), so a run also shows that compression really happened.

Each ``Options`` combination (shm on/off x fusion off / on demand / cycle x
compression none / fp16 / bf16 / int8 / auto, named ``<shm|noshm>-<fusion>-<compression>``)
is one run of fresh ranks, so a crash or hang is pinned to its configuration.
``--inject-mismatch K`` (hidden, for the tests) perturbs the first non-empty
xcomm result from op ``K`` on, to show that the fuzzer reports a difference.

Example::

    python -m xcomm_bench.fuzz --seed 1 --ops 2000            # every combination
    python -m xcomm_bench.fuzz --seed 7 --ops 500 --configs shm-ondemand-none
    python -m xcomm_bench.fuzz --seed 3 --ops 2000 --world-size 3 --configs noshm-off-int8
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


#: Options of the compressed configurations: small enough that many ops are
#: compressed, above the fusion threshold so that fused bursts never are.
COMPRESSION_MIN_BYTES = 8192
INT8_CHUNK_ELEMS = 256
FUSION_THRESHOLD_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class Config:
    shm: bool
    fusion: str  # "off" | "ondemand" | "cycle"
    compression: str  # "none" | "fp16" | "bf16" | "int8" | "auto"

    @property
    def name(self) -> str:
        return f"{'shm' if self.shm else 'noshm'}-{self.fusion}-{self.compression}"

    def options_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"shm": self.shm}
        if self.fusion != "off":
            kw["fusion_threshold_bytes"] = FUSION_THRESHOLD_BYTES
        if self.fusion == "cycle":
            kw["fusion_cycle_ms"] = 2.0
        if self.compression != "none":
            kw["compression"] = self.compression
            kw["compression_min_bytes"] = COMPRESSION_MIN_BYTES
            kw["int8_chunk_elems"] = INT8_CHUNK_ELEMS
        return kw


CONFIGS = [
    Config(shm, fusion, comp)
    for shm, fusion, comp in itertools.product(
        (True, False), ("off", "ondemand", "cycle"), ("none", "fp16", "bf16", "int8", "auto")
    )
]


def subgroups(world: int) -> list[list[int]]:
    """The global ranks of each group a batch may run on; index 0 is the whole group.

    Every rank creates them in this order at start-up (``new_group`` is collective).
    """
    groups = [list(range(world))]
    if world >= 3:
        extra = [list(range(world - 1)), [world - 2, world - 1], [0, 1]]
    elif world == 2:
        extra = [[0, 1], [1]]  # a second communicator over both ranks; a group of one
    else:
        extra = []
    for g in extra:
        if g not in groups[1:]:
            groups.append(g)
    return groups


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
    """The program, as batches of op descriptions; identical on every rank.

    Every op of a batch names the same ``group`` (an index into
    :func:`subgroups`); ``root`` is a rank of that group.
    """
    rng = random.Random(seed)
    groups = subgroups(world)
    batches: list[list[dict[str, Any]]] = []
    count = 0
    while count < ops:
        batch = []
        group = 0 if len(groups) == 1 or rng.random() < 0.6 else rng.randrange(1, len(groups))
        size = len(groups[group])
        if rng.random() < 0.05:
            # An op Gloo refuses (int16 all_reduce), then ops that must not
            # inherit its error: an error belongs to the op that caused it.
            # On the whole group: a one-rank group's ops go straight to Gloo,
            # whose own barrier may raise an op's error just after it failed.
            group, size = 0, len(groups[0])
            batch.append(
                {
                    "op": "all_reduce",
                    "dtype": "int16",
                    "red": "SUM",
                    "n": _numel(rng),
                    "root": 0,
                    "group": group,
                    "rejected": True,
                }
            )
            for op in ("barrier", rng.choice(OPS)):
                n = _numel(rng)
                if op in ("reduce_scatter_tensor", "all_to_all_single"):
                    n -= n % size
                dtype = rng.choice(DTYPES)
                batch.append(
                    {"op": op, "dtype": dtype, "red": "SUM", "n": n, "root": 0, "group": group}
                )
            batches.append(batch)
            count += len(batch)
            continue
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
                        "group": group,
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
            if op == "all_reduce" and rng.random() < 0.3:
                # A large float SUM, what compression applies to.
                dtype, red, n = rng.choice(["float32", "float64"]), "SUM", rng.randint(1024, 65536)
            if op in ("reduce_scatter_tensor", "all_to_all_single"):
                n -= n % size
            batch.append(
                {
                    "op": op,
                    "dtype": dtype,
                    "red": red,
                    "n": n,
                    "root": rng.randrange(size),
                    "group": group,
                }
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
    members: list[int],
    group: Any,
    async_op: bool,
) -> tuple[Any, list[Any]]:
    """Issues one op; returns (work or None, the tensors holding its result).

    ``rank`` is the global rank, ``members`` the group's global ranks in group order.
    """
    op, n, root = spec["op"], spec["n"], spec["root"]
    size, me = len(members), members.index(rank)
    red = getattr(dist.ReduceOp, spec["red"])
    x = _input(torch, spec, index, rank, n)
    kw = {"group": group, "async_op": async_op}
    if op == "all_reduce":
        return dist.all_reduce(x, op=red, **kw), [x]
    if op == "broadcast":
        return dist.broadcast(x, group_src=root, **kw), [x]
    if op == "all_gather":
        outs = [torch.empty_like(x) for _ in range(size)]
        return dist.all_gather(outs, x, **kw), outs
    if op == "all_gather_into_tensor":
        out = torch.empty(n * size, dtype=x.dtype)
        return dist.all_gather_into_tensor(out, x, **kw), [out]
    if op == "reduce_scatter_tensor":
        out = torch.empty(n // size, dtype=x.dtype)
        return dist.reduce_scatter_tensor(out, x, op=red, **kw), [out]
    if op == "reduce":
        w = dist.reduce(x, group_dst=root, op=red, **kw)
        return w, [x] if me == root else []  # non-roots' buffers are unspecified
    if op == "gather":
        outs = [torch.empty_like(x) for _ in range(size)] if me == root else None
        return dist.gather(x, gather_list=outs, group_dst=root, **kw), outs or []
    if op == "scatter":
        ins = [_input(torch, spec, index, rank * 100 + r, n) for r in range(size)]
        out = torch.empty_like(x)
        return dist.scatter(out, ins if me == root else None, group_src=root, **kw), [out]
    if op == "all_to_all_single":
        out = torch.empty_like(x)
        return dist.all_to_all_single(out, x, **kw), [out]
    if op == "barrier":
        return dist.barrier(**kw), []
    raise ValueError(op)


def _lossy(config: Config, spec: dict[str, Any], torch: Any) -> bool:
    """Whether xcomm compresses this op (see ``xcomm.Options.compression``)."""
    if config.compression == "none" or spec["red"] != "SUM":
        return False
    if spec["op"] not in ("all_reduce", "reduce_scatter_tensor"):
        return False
    if config.compression == "auto" and (config.shm or spec["op"] != "all_reduce"):
        return False  # auto sends none on a single host, and reduce-scatters as they are
    if spec["dtype"] not in ("float32", "float64"):
        return False
    return spec["n"] * getattr(torch, spec["dtype"]).itemsize >= COMPRESSION_MIN_BYTES


def _bound(
    torch: Any, compression: str, inputs: list[Any], ref: Any
) -> Any:  # per-element bound of |got - ref| (the module docstring derives it)
    if compression == "auto":  # whichever of none, bf16 and int8 it chose
        return torch.maximum(_bound(torch, "bf16", inputs, ref), _bound(torch, "int8", inputs, ref))
    eps = 2.0**-24
    g = len(inputs)
    xs = torch.stack([x.double().abs() for x in inputs])  # [g, n]
    if compression in ("fp16", "bf16"):
        u = 2.0**-11 if compression == "fp16" else 2.0**-8
        a = xs.sum(0)
        return (g + 1) * u * a + 2 * g * eps * a
    n = ref.numel()
    chunks = -(-n // INT8_CHUNK_ELEMS)
    pad = chunks * INT8_CHUNK_ELEMS - n
    padded = torch.nn.functional.pad(xs, (0, pad))
    msum = padded.view(g, chunks, INT8_CHUNK_ELEMS).amax(2).sum(0)  # sum_r M_r,k
    rmax = torch.nn.functional.pad(ref.double().abs(), (0, pad)).view(chunks, -1).amax(1)
    e1 = msum / 254 + 4 * g * eps * msum
    per_chunk = e1 + (rmax + e1) / 254 + 4 * g * eps * msum
    return per_chunk.repeat_interleave(INT8_CHUNK_ELEMS)[:n]


def _close(torch: Any, got: Any, ref: Any, bound: Any = None, size: int = 2) -> str | None:
    """Why ``got`` is not ``ref`` (None when it is), over a group of ``size`` ranks.

    Float reductions over 3+ ranks may add in another order than gloo (fused
    or not, another algorithm): with positive inputs each order is within
    ``(g - 1) u |ref|`` of the exact value, so two orders within twice that;
    float16/bfloat16 get that ``rtol`` where it exceeds ``assert_close``'s.
    """
    if got.dtype != ref.dtype or got.shape != ref.shape:
        return f"dtype/shape {got.dtype}{tuple(got.shape)} vs {ref.dtype}{tuple(ref.shape)}"
    if torch.equal(got, ref) or got.numel() == 0:
        return None
    if not got.dtype.is_floating_point:
        return f"integers differ at {int((got != ref).nonzero()[0])}"
    if bound is not None:
        err = (got.double() - ref.double()).abs()
        over = (err > bound) | err.isnan()
        if not over.any():
            return None
        i = int(over.nonzero()[0])
        return (
            f"lossy error {err[i].item():.3g} > bound {bound[i].item():.3g} at {i} "
            f"(got {got[i].item():.6g}, want {ref[i].item():.6g})"
        )
    try:
        kw = {}
        if got.dtype in (torch.float16, torch.bfloat16):
            u = 2.0**-11 if got.dtype == torch.float16 else 2.0**-8
            default = 1e-3 if got.dtype == torch.float16 else 1.6e-2
            kw = {"rtol": max(default, 2 * (size - 1) * u), "atol": 1e-5}
        torch.testing.assert_close(got, ref, equal_nan=True, **kw)
    except AssertionError as e:
        return " ".join(line.strip() for line in str(e).splitlines()[:4] if line.strip())
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
    options = xcomm.Options(timeout=timeout, **config.options_kwargs())
    groups = []  # (members, xcomm group, gloo group); every rank creates all, in order
    for members in subgroups(world):
        xc = dist.new_group(members, backend="xcomm", pg_options=options)
        gl = dist.new_group(members, backend="gloo")
        groups.append((members, xc, gl))
    wait_rng = random.Random(args.seed * 1000 + rank)  # differs between ranks, legally
    mismatches: list[str] = []
    ops = skipped = lossy_ops = lossy_inexact = 0
    both_raised = 0  # ops gloo refuses too (e.g. a dtype it lacks): agreement, not a pass
    rejected_raised = rejected_ran = 0  # int16 all_reduces: raised as gloo's / reduced by shm
    inject = args.inject_mismatch
    index = 0
    for batch in make_program(args.seed, args.ops, world):
        members, group, ref = groups[batch[0]["group"]]
        if rank not in members:
            skipped += len(batch)
            index += len(batch)
            continue
        issued = []
        errors = {}  # index in `issued` -> what waiting for its work raised
        for spec in batch:
            try:
                work, outs = _issue(dist, torch, spec, index, rank, members, group, True)
                issued.append((spec, index, work, outs, None))
            except Exception as e:  # noqa: BLE001 - compared with gloo's outcome
                issued.append((spec, index, None, [], f"{type(e).__name__}: {e}"))
            if spec.get("rejected") and issued[-1][2] is not None:
                # Done before the next op is issued: on a group whose ops go
                # straight to Gloo (one rank), Gloo's barrier raises the error
                # of an op still in flight, as plain gloo's does.
                try:
                    issued[-1][2].wait()
                except Exception as e:  # noqa: BLE001
                    errors[len(issued) - 1] = f"{type(e).__name__}: {e}"
            # Sometimes wait for an earlier op before issuing the next, at
            # points that differ between ranks (legal; fusion must not care).
            # What that wait raises is the earlier op's outcome.
            elif len(issued) > 1 and wait_rng.random() < 0.3:
                j = wait_rng.randrange(len(issued) - 1)
                if issued[j][2] is not None:
                    try:
                        issued[j][2].wait()
                    except Exception as e:  # noqa: BLE001
                        errors[j] = f"{type(e).__name__}: {e}"
            index += 1
        order = list(range(len(issued)))
        wait_rng.shuffle(order)
        for i in order:
            spec, idx, work, outs, err = issued[i]
            if work is not None and i not in errors:
                try:
                    work.wait()
                except Exception as e:  # noqa: BLE001
                    errors[i] = f"{type(e).__name__}: {e}"
        for i, (spec, idx, _work, outs, err) in enumerate(issued):
            err = err or errors.get(i)
            if inject is not None and idx >= inject and err is None:
                hit = next((t for t in outs if t.numel() > 0), None)
                if hit is not None:
                    hit.view(-1)[0] += 1  # the planted difference
                    inject = None
            ops += 1
            where = f"op {idx} {spec}"
            if spec.get("rejected"):
                # Not run on the gloo group: after refusing it, plain gloo's
                # next barrier sometimes raises the same error on one rank
                # only, and the other waits in it for good. The expected
                # outcome is known: Gloo's error, except that xcomm's
                # shared-memory route reduces int16 (documented) exactly.
                if config.shm:
                    want = _input(torch, spec, idx, members[0], spec["n"])
                    for m in members[1:]:
                        want = want + _input(torch, spec, idx, m, spec["n"])
                    problem = err or _close(torch, outs[0], want)
                    rejected_ran += problem is None
                else:
                    problem = None if err and "Invalid scalar type" in err else f"{err or 'ok'}"
                    rejected_raised += problem is None
                if problem:
                    mismatches.append(f"{where}: {problem}")
                continue
            try:
                _, ref_outs = _issue(dist, torch, spec, idx, rank, members, ref, False)
                ref_err = None
            except Exception as e:  # noqa: BLE001
                ref_outs, ref_err = [], f"{type(e).__name__}: {e}"
            if (err is None) != (ref_err is None):
                mismatches.append(f"{where}: xcomm {err or 'ok'} / gloo {ref_err or 'ok'}")
                if err is not None:
                    break  # the xcomm group may be out of step now
                continue
            both_raised += err is not None
            bound = None
            if err is None and _lossy(config, spec, torch):
                inputs = [_input(torch, spec, idx, m, spec["n"]) for m in members]
                if spec["op"] == "reduce_scatter_tensor":  # this rank's row of every input
                    k = spec["n"] // len(members)
                    j = members.index(rank)
                    inputs = [x[j * k : (j + 1) * k] for x in inputs]
                bound = _bound(torch, config.compression, inputs, ref_outs[0])
                lossy_ops += 1
                lossy_inexact += not torch.equal(outs[0], ref_outs[0])
            for k, (got, want) in enumerate(zip(outs, ref_outs)):
                problem = _close(torch, got, want, bound, len(members))
                if problem:
                    mismatches.append(f"{where} output {k}: {problem}")
        else:
            continue
        break
    Path(args.out).write_text(
        json.dumps(
            {
                "rank": rank,
                "ops": ops,
                "skipped": skipped,
                "both_raised": both_raised,
                "rejected_raised": rejected_raised,
                "rejected_ran": rejected_ran,
                "lossy_ops": lossy_ops,
                "lossy_inexact": lossy_inexact,
                "mismatches": mismatches,
            }
        )
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
    parser.add_argument("--inject-mismatch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help="worker: its JSON; controller: the summary JSON")
    args = parser.parse_args(argv)
    if args.worker:
        args.out = args.out.replace("{rank}", os.environ["RANK"])
        _worker(args)
        return 0

    from tqdm import tqdm

    names = {c.name for c in CONFIGS}
    wanted = args.configs.split(",")
    if args.configs != "all" and not set(wanted) <= names:
        parser.error(f"unknown configs {sorted(set(wanted) - names)}; choose from {sorted(names)}")
    chosen = CONFIGS if args.configs == "all" else [c for c in CONFIGS if c.name in wanted]
    program_ops = sum(map(len, make_program(args.seed, args.ops, args.world_size)))
    summary: dict[str, Any] = {
        "seed": args.seed,
        "world_size": args.world_size,
        "subgroups": subgroups(args.world_size),
        "program_ops": program_ops,
        "runs": {},
    }
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
            if args.inject_mismatch is not None:
                command += ["--inject-mismatch", str(args.inject_mismatch)]
            start = time.monotonic()
            status = run_ranks(
                command, args.world_size, timeout=120 + 0.1 * args.ops * args.world_size
            )
            ranks = []
            for r in range(args.world_size):
                path = Path(out.replace("{rank}", str(r)))
                ranks.append(json.loads(path.read_text()) if path.exists() else None)
            # Program ops every rank got through (ran, or skipped outside a subgroup).
            ops = min((r["ops"] + r["skipped"] if r else 0 for r in ranks), default=0)
            both_raised = max((r["both_raised"] for r in ranks if r), default=0)
            bad = sorted({m for r in ranks if r for m in r["mismatches"]})
            ok = status == 0 and not bad and ops == program_ops
            outcome = "ok" if ok else ("hang" if status == 124 else "fail")
            if status not in (0, 124):
                outcome = "crash" if not all(ranks) else "fail"
            summary["runs"][config.name] = {
                "status": status,
                "outcome": outcome,
                "ops": ops,
                "ops_run_per_rank": [r["ops"] if r else None for r in ranks],
                "both_raised": both_raised,
                "rejected_raised": max((r["rejected_raised"] for r in ranks if r), default=0),
                "rejected_ran": max((r["rejected_ran"] for r in ranks if r), default=0),
                "lossy_ops": max((r["lossy_ops"] for r in ranks if r), default=0),
                "lossy_inexact": max((r["lossy_inexact"] for r in ranks if r), default=0),
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
