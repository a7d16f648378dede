"""Collectives on groups whose CPU ops run on Gloo check rank agreement.

Ranks on different hosts, or ``Options(shm=False)``: every collective first
exchanges a descriptor (op, dtype, reduce op, root, bytes; an all-to-all's
per-pair sizes) over a Gloo group of its own (``CheckedRoute``). The
reference is what plain gloo does with the same calls, seen with a 2-rank
script: different sizes or dtypes abort the receiving process
(``gloo::EnforceNotMet``), different reduce ops return a wrong sum on both
ranks (SUM on one, MAX on the other: ``[5, 5, 3, 3]``), different ops or
roots wait for the timeout. Here each is the same ``ValueError`` on every
rank, at once, and the group stays usable.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import RankContext, error_of, run_ranks

pytestmark = pytest.mark.xcomm_specific


def _group(
    ctx: RankContext, hosts: int, check: bool = True, carry: bool = True
) -> dist.ProcessGroup:
    import xcomm

    if hosts > 1:  # logical hosts: ranks {0, 1} on one, {2, 3} on the other
        os.environ["XCOMM_SHM_HOST_TAG"] = f"host{ctx.rank * hosts // ctx.world_size}"
        options = xcomm.Options(check_collectives=check, carry_small_ops=carry)
    else:
        options = xcomm.Options(shm=False, check_collectives=check, carry_small_ops=carry)
    return dist.new_group(backend="xcomm", pg_options=options)


def _rank_mismatch(ctx: RankContext, hosts: int) -> dict[str, Any]:
    import xcomm

    group = _group(ctx, hosts)
    plan = xcomm.group_plan(group)
    rank, ws = ctx.rank, ctx.world_size
    odd = rank % 2  # in a 4-rank group, ranks 1 and 3 disagree with 0 and 2
    x = torch.full((6,), float(rank))
    cases: dict[str, Callable[[], object]] = {
        "broadcast_root": lambda: dist.broadcast(x, src=odd, group=group),
        "all_gather_sizes": lambda: dist.all_gather_into_tensor(
            torch.zeros(ws * (4 + odd)), torch.ones(4 + odd), group=group
        ),
        # Rank 0 sends rank 1 three rows; rank 1 expects two.
        "all_to_all_splits": lambda: dist.all_to_all_single(
            torch.zeros(3 * ws - odd),
            torch.ones(3 * ws),
            [3 - odd] + [3] * (ws - 1),
            None,
            group=group,
        ),
        "barrier_vs_broadcast": lambda: (
            dist.barrier(group=group) if odd else dist.broadcast(x, src=0, group=group)
        ),
        # Rows of the same sizes either way: it ran as an all_to_all before the leaders were checked.
        "reduce_scatter_vs_all_to_all": lambda: (
            dist.all_to_all_single(torch.zeros(4 * ws), torch.ones(4 * ws), group=group)
            if odd
            else dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4 * ws), group=group)
        ),
        "gather_root": lambda: dist.gather(
            x, [torch.zeros(6) for _ in range(ws)] if rank == odd else None, dst=odd, group=group
        ),
    }
    if hosts == 1:  # all_reduce of a hierarchical group runs over shared memory and the leaders
        cases.update(
            {
                "sizes": lambda: dist.all_reduce(torch.ones(4 + 4 * odd), group=group),
                "reduce_op": lambda: dist.all_reduce(
                    torch.ones(4), op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM, group=group
                ),
                "dtype": lambda: dist.all_reduce(
                    torch.ones(4, dtype=torch.float64 if odd else torch.float32), group=group
                ),
                "all_reduce_vs_broadcast": lambda: (
                    dist.broadcast(x, src=0, group=group)
                    if odd
                    else dist.all_reduce(x, group=group)
                ),
            }
        )
    out: dict[str, Any] = {"errors": {}, "seconds": {}, "plan": plan}
    for name, call in cases.items():
        start = time.monotonic()
        out["errors"][name] = error_of(call)
        out["seconds"][name] = time.monotonic() - start
        t = torch.ones(7)
        dist.broadcast(t, src=ws - 1, group=group)  # a Gloo op: the group is still in step
        s = torch.ones(5)
        dist.all_reduce(s, group=group)
        assert t.tolist() == [1.0] * 7 and s.tolist() == [float(ws)] * 5, (name, t, s)
    return out


@pytest.mark.parametrize(
    ("world_size", "hosts"),
    [pytest.param(2, 1, id="plain-ws2"), pytest.param(4, 2, id="hierarchical-ws4")],
)
def test_ranks_that_disagree_raise_on_every_rank_and_group_recovers(
    world_size: int, hosts: int
) -> None:
    res = run_ranks(_rank_mismatch, world_size, hosts, timeout=180)
    for r in res:
        assert r["plan"]["checks_collectives"], r["plan"]
        assert "xcomm/gloo-check" in [g["name"] for g in r["plan"]["groups"]]
        for name, error in r["errors"].items():
            assert error and error.startswith("ValueError"), (name, error)
            # At once, not at the group's timeout (40 s in the tests).
            assert r["seconds"][name] < 10, (name, r["seconds"])
    # Every rank gives the same account of the disagreement.
    for name in res[0]["errors"]:
        tails = [r["errors"][name].split(": ", 2)[-1] for r in res]
        assert all(t == tails[0] for t in tails), (name, tails)
    errors = res[0]["errors"]
    assert (
        "rank 0: broadcast(root=0, Float, 24 bytes); rank 1: broadcast(root=1"
        in (errors["broadcast_root"])
    )
    assert (
        "all_gather_into_tensor(Float, 16 bytes); rank 1: all_gather_into_tensor(Float, 20"
        in (errors["all_gather_sizes"])
    )
    assert (
        "rank 0: broadcast(root=0, Float, 24 bytes); rank 1: barrier()"
        in (errors["barrier_vs_broadcast"])
    )
    assert "gather(root=0" in errors["gather_root"] and "gather(root=1" in errors["gather_root"]
    assert (
        "rank 0: reduce_scatter_tensor(SUM, Float, 16 bytes, as an all_to_all); "
        "rank 1: all_to_all_single(Float)" in errors["reduce_scatter_vs_all_to_all"]
    ), errors["reduce_scatter_vs_all_to_all"]
    assert (
        "rank 0 sends 12 bytes to rank 1, but rank 1 expects 8 bytes from rank 0"
        in errors["all_to_all_splits"]
    ), errors["all_to_all_splits"]
    if hosts == 1:
        assert (
            "all_reduce(SUM, Float, 16 bytes); rank 1: all_reduce(SUM, Float, 32"
            in (errors["sizes"])
        )
        assert (
            "all_reduce(SUM, Float, 16 bytes); rank 1: all_reduce(MAX, Float, 16"
            in (errors["reduce_op"])
        )
        assert "rank 1: all_reduce(SUM, Double, 32 bytes)" in errors["dtype"]
        assert (
            "rank 0: all_reduce(SUM, Float, 24 bytes); rank 1: broadcast(root=0"
            in (errors["all_reduce_vs_broadcast"])
        )


def _rank_async_order(ctx: RankContext, check: bool) -> dict[str, Any]:
    """Many async ops of mixed kinds in flight at once, a few synchronous
    ones among them: each result equals the reference group's."""
    import xcomm

    group = _group(ctx, 1, check=check)
    ws = ctx.world_size
    torch.manual_seed(ctx.rank)
    tensors, refs, works = [], [], []
    for i in range(24):
        # Up to 200 KB: carried in the check's exchange (up to 128 KiB) and not.
        n = 1 + 12499 * (i % 5)
        x = torch.randn(n)
        ref = x.clone()
        if i % 3 == 0:
            dist.all_reduce(ref, group=ctx.ref)
            # Every fourth synchronous, behind the async ops still queued.
            work = dist.all_reduce(x, group=group, async_op=i % 4 != 0)
            works.append(work) if work is not None else None
            tensors.append(x)
        elif i % 3 == 1:
            dist.broadcast(ref, src=i % ws, group=ctx.ref)
            works.append(dist.broadcast(x, src=i % ws, group=group, async_op=True))
            tensors.append(x)
        else:
            ref_out = torch.zeros(n * ws)
            dist.all_gather_into_tensor(ref_out, x, group=ctx.ref)
            out = torch.zeros(n * ws)
            works.append(dist.all_gather_into_tensor(out, x, group=group, async_op=True))
            tensors.append(out)
            ref = ref_out
        refs.append(ref)
    for w in works:
        w.wait()
    dist.monitored_barrier(group=group)
    return {
        "same": [torch.equal(t, r) for t, r in zip(tensors, refs, strict=True)],
        "plan": xcomm.group_plan(group),
    }


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_async_ops_in_flight_match_gloo(check: bool) -> None:
    res = run_ranks(_rank_async_order, 2, check)
    for r in res:
        assert all(r["same"]), r["same"]
        assert r["plan"]["checks_collectives"] == check
        names = [g["name"] for g in r["plan"]["groups"]]
        assert ("xcomm/gloo-check" in names) == check, names


def _rank_missing_peer(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 skips a collective: rank 0's fails within the timeout, naming it."""
    import datetime

    import xcomm

    group = dist.new_group(
        backend="xcomm",
        pg_options=xcomm.Options(shm=False, timeout=datetime.timedelta(seconds=3)),
    )
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        start = time.monotonic()
        out["error"] = error_of(lambda: dist.all_reduce(torch.ones(4), group=group))
        out["seconds"] = time.monotonic() - start
    dist.barrier(group=ctx.ref)  # rank 1 waits here until rank 0 has given up
    return out


def test_a_peer_that_skips_a_collective_is_an_error_within_the_timeout() -> None:
    res = run_ranks(_rank_missing_peer, 2, destroy=False)
    error, seconds = res[0]["error"], res[0]["seconds"]
    assert error and error.startswith("DistBackendError"), error
    assert "xcomm.all_reduce: rank 1 did not take part within 3000 ms" in error, error
    assert 2.5 < seconds < 10, seconds


def _rank_carried_ops(ctx: RankContext, hosts: int) -> dict[str, Any]:
    """Small ops on a checked Gloo route ride in the check's own exchange:
    each result equals Gloo's (bit for bit at 2 ranks), and the group counts
    which ops were carried."""
    import xcomm

    group = _group(ctx, hosts)
    plain = _group(ctx, hosts, carry=False)
    backend = group._get_backend(torch.device("cpu"))
    rank, ws = ctx.rank, ctx.world_size
    gen = ctx.generator()
    cap = xcomm.group_plan(group)["carry_bytes"]
    R = dist.ReduceOp

    def values(n: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        x = torch.randn(n, generator=gen) * 20
        if ws > 2:  # whole numbers: sums of 4 ranks are exact in any order
            x = x.round()
        if dtype == torch.bool:
            return x > 0
        return x.to(dtype)

    def reduce_case(
        x: torch.Tensor, op: Any = R.SUM
    ) -> Callable[[dist.ProcessGroup], list[torch.Tensor]]:
        def run(g: dist.ProcessGroup) -> list[torch.Tensor]:
            y = x.clone() if x.is_contiguous() else x.clone().t().contiguous().t()
            dist.all_reduce(y, op=op, group=g)
            return [y]

        return run

    cases: dict[str, tuple[Callable[[dist.ProcessGroup], list[torch.Tensor]], bool]] = {}
    for dtype, ops in {
        torch.float32: [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX],
        torch.float64: [R.SUM, R.AVG],
        torch.float16: [R.SUM, R.AVG, R.MAX],
        torch.bfloat16: [R.SUM, R.AVG, R.PRODUCT],
        torch.int32: [R.SUM, R.MAX, R.BAND, R.BOR, R.BXOR],
        torch.int64: [R.SUM, R.PRODUCT],
        torch.int8: [R.SUM, R.MIN],
        torch.uint8: [R.SUM, R.BXOR],
        torch.bool: [R.SUM, R.PRODUCT, R.MAX, R.BAND],
    }.items():
        for op in ops:
            cases[f"all_reduce_{dtype}_{op}"] = (reduce_case(values(37, dtype), op), True)
    cases["all_reduce_complex"] = (
        reduce_case(torch.complex(values(9, torch.float32), values(9, torch.float32))),
        True,
    )
    cases["all_reduce_scalar"] = (reduce_case(values((), torch.float32)), True)
    cases["all_reduce_transposed"] = (reduce_case(values((3, 5), torch.float32).t(), R.MAX), True)
    cases["all_reduce_at_limit"] = (reduce_case(values(cap // 4, torch.float32)), True)
    cases["all_reduce_past_limit"] = (reduce_case(values(cap // 4 + 1, torch.float32)), False)

    def broadcast_case(
        src: int, x: torch.Tensor
    ) -> Callable[[dist.ProcessGroup], list[torch.Tensor]]:
        def run(g: dist.ProcessGroup) -> list[torch.Tensor]:
            y = x.clone()
            dist.broadcast(y, src=src, group=g)
            return [y]

        return run

    for src in range(ws):
        cases[f"broadcast_from_{src}"] = (broadcast_case(src, values((4, 6), torch.float64)), True)
    cases["broadcast_past_limit"] = (broadcast_case(0, values(cap + 1, torch.uint8)), False)
    x = values(11, torch.int64)
    big = values(cap // 2 + 1, torch.float16)

    def all_gather(g: dist.ProcessGroup) -> list[torch.Tensor]:
        outs = [torch.zeros(11, dtype=torch.int64) for _ in range(ws)]
        dist.all_gather(outs, x, group=g)
        return outs

    def all_gather_into(g: dist.ProcessGroup) -> list[torch.Tensor]:
        out = torch.zeros(ws * 11, dtype=torch.int64)
        dist.all_gather_into_tensor(out, x, group=g)
        return [out]

    def all_gather_into_2d(g: dist.ProcessGroup) -> list[torch.Tensor]:
        # Gloo refuses an output whose chunks are shaped (1, 11) for an input
        # of (11): so must the carried path.
        out = torch.zeros(ws, 11, dtype=torch.int64)
        dist.all_gather_into_tensor(out, x, group=g)
        return [out]

    def all_gather_past_limit(g: dist.ProcessGroup) -> list[torch.Tensor]:
        out = torch.zeros(ws * big.numel(), dtype=big.dtype)
        dist.all_gather_into_tensor(out, big, group=g)
        return [out]

    def gather_object(g: dist.ProcessGroup) -> list[torch.Tensor]:
        objs: list[Any] = [None] * ws
        dist.all_gather_object(objs, {"rank": rank, "pad": "x" * (100 * rank)}, group=g)
        return [torch.tensor([len(o["pad"]) + o["rank"] for o in objs])]

    def rooted(
        kind: str, root: int, n: int = 13
    ) -> Callable[[dist.ProcessGroup], list[torch.Tensor]]:
        x = values(n, torch.float32)
        pieces = [values(n, torch.float32) for _ in range(ws)]

        def run(g: dist.ProcessGroup) -> list[torch.Tensor]:
            mine = rank == root
            if kind == "reduce":
                y = x.clone()
                dist.reduce(y, dst=root, op=R.MAX, group=g)
                return [y]  # off the root, untouched, as with Gloo
            if kind == "gather":
                outs = [torch.zeros(n) for _ in range(ws)] if mine else None
                dist.gather(x, outs, dst=root, group=g)
                return outs or [x]
            y = torch.zeros(n)
            dist.scatter(y, pieces if mine else None, src=root, group=g)
            return [y]

        return run

    for kind in ("reduce", "gather", "scatter"):
        for root in range(ws):
            # Not reduce: Gloo leaves its result on some non-roots, by its algorithm.
            cases[f"{kind}_to_{root}"] = (rooted(kind, root), kind != "reduce")
    cases["gather_past_limit"] = (rooted("gather", 0, cap // 4 + 1), False)

    def to_all(
        rows_to: list[int], rows_from: list[int], per_row: int = 3
    ) -> Callable[[dist.ProcessGroup], list[torch.Tensor]]:
        x = values((sum(rows_to), per_row), torch.float32)

        def run(g: dist.ProcessGroup) -> list[torch.Tensor]:
            out = torch.zeros(sum(rows_from), per_row)
            dist.all_to_all_single(out, x, rows_from, rows_to, group=g)
            return [out]

        return run

    # Rank r sends r + 1 + d rows to rank d (so receives d + 1 + r from rank d).
    cases["all_to_all_single_even"] = (to_all([2] * ws, [2] * ws), True)
    cases["all_to_all_single_uneven"] = (
        to_all([rank + 1 + d for d in range(ws)], [d + 1 + rank for d in range(ws)]),
        True,
    )
    cases["all_to_all_single_past_limit"] = (to_all([cap // 4] * ws, [cap // 4] * ws, 2), False)

    def all_to_all_lists(uneven: int) -> Callable[[dist.ProcessGroup], list[torch.Tensor]]:
        ins = [values(2 + uneven * (d + 2 * rank), torch.int32) for d in range(ws)]

        def run(g: dist.ProcessGroup) -> list[torch.Tensor]:
            outs = [torch.zeros(2 + uneven * (rank + 2 * d), dtype=torch.int32) for d in range(ws)]
            dist.all_to_all(outs, ins, group=g)
            return outs

        return run

    cases["all_to_all"] = (all_to_all_lists(0), True)
    # Gloo wants every tensor of both lists of one shape: refused on every route.
    cases["all_to_all_uneven"] = (all_to_all_lists(1), False)
    rs_in = values(ws * 5, torch.float64)

    def reduce_scatter_tensor(g: dist.ProcessGroup) -> list[torch.Tensor]:
        out = torch.zeros(5, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, rs_in, group=g)
        return [out]

    def reduce_scatter(g: dist.ProcessGroup) -> list[torch.Tensor]:
        out = torch.zeros(5, dtype=torch.float64)
        dist.reduce_scatter(out, list(rs_in.chunk(ws)), group=g)
        return [out]

    # A plain group runs reduce_scatter_tensor as an all_to_all_single and a
    # local sum; reduce_scatter's list form is carried as itself.
    cases["reduce_scatter_tensor"] = (reduce_scatter_tensor, True)
    cases["reduce_scatter"] = (reduce_scatter, True)
    cases["all_gather"] = (all_gather, True)
    cases["all_gather_into_tensor"] = (all_gather_into, True)
    cases["all_gather_past_limit"] = (all_gather_past_limit, False)
    cases["all_gather_into_2d"] = (all_gather_into_2d, False)
    cases["all_gather_object"] = (gather_object, True)
    cases["barrier"] = (lambda g: [torch.tensor(dist.barrier(group=g) is None)], True)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        # Bit for bit at 2 ranks; beyond, Gloo's ring folds the ranks in
        # another order than ours, so low-precision products and averages
        # may round differently.
        if ws == 2 or not a.is_floating_point():
            return torch.equal(a, b)
        return torch.allclose(a.double(), b.double(), rtol=1e-2, atol=1e-2)

    out: dict[str, Any] = {"same": {}, "carried": {}, "cap": cap}
    out["uncarried_cap"] = xcomm.group_plan(plain)["carry_bytes"]
    for name, (run, _) in cases.items():
        ref_error = error_of(lambda: run(ctx.ref))  # noqa: B023
        before = backend.carried_ops
        if ref_error is not None:  # every route refuses it too
            errors = [error_of(lambda: run(g)) for g in (group, plain)]  # noqa: B023
            out["carried"][name] = backend.carried_ops - before
            out["same"][name] = all(e is not None for e in errors)
            continue
        ref = run(ctx.ref)
        got = run(group)
        out["carried"][name] = backend.carried_ops - before
        out["same"][name] = all(same(a, b) for a, b in zip(got, ref, strict=True))
        unc = run(plain)
        out["same"][name] &= all(same(a, b) for a, b in zip(unc, ref, strict=True))
    # A hierarchical group's all_reduce runs over shared memory and its leaders.
    out["expected"] = {
        name: carried and not (hosts > 1 and name.startswith("all_reduce"))
        for name, (_, carried) in cases.items()
    }
    out["plain_carried"] = plain._get_backend(torch.device("cpu")).carried_ops
    out["description"] = xcomm.group_plan(group)["description"]
    return out


@pytest.mark.parametrize(
    ("world_size", "hosts"),
    [
        pytest.param(2, 1, id="plain-ws2"),
        pytest.param(4, 1, id="plain-ws4"),
        pytest.param(4, 2, id="hierarchical-ws4"),
    ],
)
def test_small_ops_ride_in_the_check_and_equal_gloo(world_size: int, hosts: int) -> None:
    res = run_ranks(_rank_carried_ops, world_size, hosts)
    for r in res:
        # 128 KiB per pair; at 4 ranks, 256 KiB over the 3 others.
        assert r["cap"] == (131072 if world_size == 2 else 87376), r["cap"]
        assert r["uncarried_cap"] == 0, r
        assert f"ops of up to {r['cap']} bytes per rank, and barriers, carried" in r["description"]
        assert all(r["same"].values()), {k: v for k, v in r["same"].items() if not v}
        # all_gather_object is two all_gathers (sizes, then bytes).
        carried = {k: v > 0 for k, v in r["carried"].items()}
        assert carried == r["expected"], {
            k: (carried[k], r["expected"][k]) for k in carried if carried[k] != r["expected"][k]
        }
        assert r["carried"]["all_gather_object"] == 2, r["carried"]
        assert r["plain_carried"] == 0


def _rank_barrier_waits(ctx: RankContext) -> dict[str, Any]:
    """A carried barrier still completes after this rank's earlier ops, as
    Gloo's barrier does; and it fails with an earlier op's error."""
    group = _group(ctx, 1)
    out: dict[str, Any] = {"done": []}
    for _ in range(3):
        x = torch.ones(4 << 20)  # 16 MB: on Gloo, not carried
        work = dist.all_reduce(x, group=group, async_op=True)
        dist.barrier(group=group)
        out["done"].append(work.is_completed() and x[0].item() == ctx.world_size)
    return out


def test_a_carried_barrier_waits_for_the_ops_before_it() -> None:
    res = run_ranks(_rank_barrier_waits, 2)
    for r in res:
        assert all(r["done"]), r["done"]


def _hierarchical(ctx: RankContext, **options: Any) -> dist.ProcessGroup:
    """Logical hosts {0, 1} and {2, 3}: shared memory inside, leaders between."""
    import xcomm

    os.environ["XCOMM_SHM_HOST_TAG"] = f"host{ctx.rank // 2}"
    return dist.new_group(backend="xcomm", pg_options=xcomm.Options(**options))


def _rank_hosts_disagree(ctx: RankContext, compression: str | None) -> dict[str, Any]:
    """Host 1's ranks call another all_reduce than host 0's. Inside each host
    the ranks agree, so only the leaders' step can see it: unchecked, the
    leaders' Gloo aborted the process on sizes and dtypes (``gloo::EnforceNotMet``)
    and summed SUM against MAX into a wrong result."""
    import xcomm

    group = _hierarchical(ctx, compression=compression, compression_min_bytes=64)
    backend = group._get_backend(torch.device("cpu"))
    other = ctx.rank // 2  # 1 on host 1
    n = 1000  # 4000 bytes: compressed when asked, else carried by the leaders' check
    cases: dict[str, Callable[[], object]] = {
        "sizes": lambda: dist.all_reduce(torch.ones(n + 8 * other), group=group),
        "reduce_op": lambda: dist.all_reduce(
            torch.ones(n), op=dist.ReduceOp.MAX if other else dist.ReduceOp.SUM, group=group
        ),
        "dtype": lambda: dist.all_reduce(
            torch.ones(n, dtype=torch.float64 if other else torch.float32), group=group
        ),
    }
    out: dict[str, Any] = {"errors": {}, "seconds": {}, "plan": xcomm.group_plan(group)}
    for name, call in cases.items():
        start = time.monotonic()
        out["errors"][name] = error_of(call)
        out["seconds"][name] = time.monotonic() - start
        # Still in step: a sum the leaders carry, and one they send over Gloo.
        small, large = torch.ones(5), torch.ones(100_000)
        dist.all_reduce(small, group=group)
        dist.all_reduce(large, group=group, op=dist.ReduceOp.MAX)
        assert small.tolist() == [4.0] * 5 and bool((large == 1).all()), (name, small)
    before = backend.leader_carried_ops
    x = torch.arange(6, dtype=torch.float32) * (ctx.rank + 1)
    ref = x.clone()
    dist.all_reduce(x, group=group)
    dist.all_reduce(ref, group=ctx.ref)
    out["same_as_gloo"] = torch.equal(x, ref)
    out["carried"] = (before, backend.leader_carried_ops)
    return out


@pytest.mark.parametrize("compression", [None, "int8"], ids=["uncompressed", "int8"])
def test_hosts_that_disagree_raise_on_every_rank_and_group_recovers(
    compression: str | None,
) -> None:
    res = run_ranks(_rank_hosts_disagree, 4, compression, timeout=180)
    for rank, r in enumerate(res):
        plan = r["plan"]
        assert plan["shape"] == "hierarchical" and plan["checks_leaders"], plan
        groups = {g["name"]: g for g in plan["groups"]}
        assert groups["xcomm/leaders-check"]["member"] == (rank % 2 == 0), groups
        assert plan["leader_carry_bytes"] == 131072, plan
        for name, error in r["errors"].items():
            assert error and error.startswith("ValueError"), (rank, name, error)
            assert "step between hosts failed on this host's leader" in error, error
            assert r["seconds"][name] < 10, (name, r["seconds"])  # not the 40 s timeout
        assert r["same_as_gloo"]
        before, after = r["carried"]
        # The leaders carry a 24-byte sum in their check; other ranks have none.
        assert (after - before == 1) if rank % 2 == 0 else (before, after) == (-1, -1), r
    # Every rank of a host gives its leader's account; both hosts name both calls.
    for name in res[0]["errors"]:
        tails = [r["errors"][name].split("): ", 1)[-1] for r in res]
        assert all(t == tails[0] for t in tails), (name, tails)
    errors = res[0]["errors"]
    assert (
        "host 0: all_reduce(SUM, Float, 4000 bytes); host 1: all_reduce(SUM, Float, 4032"
        in (errors["sizes"])
    )
    assert (
        "host 0: all_reduce(SUM, Float, 4000 bytes); host 1: all_reduce(MAX, Float"
        in (errors["reduce_op"])
    )
    assert "host 1: all_reduce(SUM, Double, 8000 bytes)" in errors["dtype"]


def _rank_missing_host(ctx: RankContext) -> dict[str, Any]:
    """Host 1 skips an all_reduce: both ranks of host 0 fail within the timeout."""
    import datetime

    group = _hierarchical(ctx, timeout=datetime.timedelta(seconds=3))
    out: dict[str, Any] = {}
    if ctx.rank < 2:
        start = time.monotonic()
        out["error"] = error_of(lambda: dist.all_reduce(torch.ones(4), group=group))
        out["seconds"] = time.monotonic() - start
    dist.barrier(group=ctx.ref)  # host 1 waits here until host 0 has given up
    return out


def test_a_host_that_skips_an_all_reduce_is_an_error_on_the_other_hosts_ranks() -> None:
    res = run_ranks(_rank_missing_host, 4, destroy=False)
    for r in res[:2]:
        error, seconds = r["error"], r["seconds"]
        assert error and error.startswith("DistBackendError"), error
        assert "xcomm.all_reduce: host 1 did not take part within" in error, error
        assert 2.5 < seconds < 10, seconds


def _rank_compressed_vs_other(ctx: RankContext, shm: bool) -> dict[str, Any]:
    """Rank 0's all_reduce is compressed by the backend (its collectives run
    on a group of their own); rank 1 calls a broadcast. Unchecked, both
    waited for the timeout."""
    import xcomm

    group = dist.new_group(
        backend="xcomm",
        pg_options=xcomm.Options(compression="int8", compression_min_bytes=64, shm=shm),
    )
    x = torch.ones(1000)
    start = time.monotonic()
    error = error_of(
        lambda: (
            dist.all_reduce(x, group=group)
            if ctx.rank == 0
            else dist.broadcast(x, src=0, group=group)
        )
    )
    seconds = time.monotonic() - start
    y = torch.ones(1000)
    dist.all_reduce(y, group=group)  # both compressed: the group is still in step
    return {"error": error, "seconds": seconds, "sum": y.tolist()}


@pytest.mark.parametrize("shm", [False, True], ids=["plain", "single-host-shm"])
def test_a_compressed_all_reduce_against_another_op_is_an_error_at_once(shm: bool) -> None:
    res = run_ranks(_rank_compressed_vs_other, 2, shm, timeout=120)
    for r in res:
        assert r["error"] and r["error"].startswith("ValueError"), r["error"]
        assert "all_reduce(" in r["error"] and "all_reduce(root" not in r["error"], r["error"]
        assert "broadcast(root=0, Float, 4000 bytes)" in r["error"], r["error"]
        assert r["seconds"] < 10, r["seconds"]
        assert max(abs(v - 2.0) for v in r["sum"]) < 0.05, r["sum"][:4]  # int8's rounding


def _rank_direct_ops(ctx: RankContext) -> dict[str, Any]:
    """All-to-alls and all-gathers past the carry limit move as point-to-point
    messages (``DirectExchange``); gloo's collectives are the reference."""
    group = _group(ctx, 1)
    backend = group._get_backend(torch.device("cpu"))
    ws, me = ctx.world_size, ctx.rank
    m = 140_001  # elements per piece: past the 128 KiB carry limit for every dtype below

    def values(n: int | tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * me + salt)
        x = torch.randn(n, generator=g) * 50
        if dtype == torch.bool:
            return x > 0
        if dtype == torch.complex64:
            return torch.complex(x, -x)
        return x.to(dtype)

    def split(src: int, dst: int) -> int:
        # Uneven pieces, some empty: what `src` sends to `dst`.
        return 0 if (src + dst) % 3 == 1 else m // 3 + 997 * src + 131 * dst

    cases: dict[str, Callable[[dist.ProcessGroup, bool], list[torch.Tensor]]] = {}
    for dtype in (
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.complex64,
    ):

        def a2a_even(g: dist.ProcessGroup, asyn: bool, dtype: torch.dtype = dtype) -> Any:
            x, out = values(ws * m, dtype), torch.empty(ws * m, dtype=dtype)
            return dist.all_to_all_single(out, x, group=g, async_op=asyn), [out]

        def a2a_uneven(g: dist.ProcessGroup, asyn: bool, dtype: torch.dtype = dtype) -> Any:
            ins = [split(me, p) for p in range(ws)]
            outs = [split(p, me) for p in range(ws)]
            x, out = values((sum(ins), 3), dtype), torch.empty((sum(outs), 3), dtype=dtype)
            work = dist.all_to_all_single(out, x, outs, ins, group=g, async_op=asyn)
            return work, [out]

        def ag_tensor(g: dist.ProcessGroup, asyn: bool, dtype: torch.dtype = dtype) -> Any:
            x, out = values((m, 2), dtype), torch.empty((ws * m, 2), dtype=dtype)
            return dist.all_gather_into_tensor(out, x, group=g, async_op=asyn), [out]

        def ag_list(g: dist.ProcessGroup, asyn: bool, dtype: torch.dtype = dtype) -> Any:
            x, outs = values(m, dtype), [torch.empty(m, dtype=dtype) for _ in range(ws)]
            return dist.all_gather(outs, x, group=g, async_op=asyn), outs

        def a2a_list(g: dist.ProcessGroup, asyn: bool, dtype: torch.dtype = dtype) -> Any:
            ins = [values(m, dtype, salt=p) for p in range(ws)]
            outs = [torch.empty(m, dtype=dtype) for _ in range(ws)]
            return dist.all_to_all(outs, ins, group=g, async_op=asyn), outs

        name = str(dtype).removeprefix("torch.")
        cases[f"all_to_all_single_{name}"] = a2a_even
        cases[f"all_to_all_single_uneven_{name}"] = a2a_uneven
        cases[f"all_gather_into_tensor_{name}"] = ag_tensor
        cases[f"all_gather_{name}"] = ag_list
        cases[f"all_to_all_{name}"] = a2a_list

    def reduce_scatter(g: dist.ProcessGroup, asyn: bool) -> Any:
        x, out = values(ws * m, torch.float32), torch.empty(m)
        return dist.reduce_scatter_tensor(out, x, group=g, async_op=asyn), [out]

    cases["reduce_scatter_tensor_float32"] = reduce_scatter

    def result(name: str, asyn: bool, work: Any, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        if not asyn:
            return outs
        if name.startswith("reduce_scatter"):
            work.wait()  # Gloo's reduce-scatters have no future; nor do xcomm's
            return outs
        # The future's value, as gloo gives it (a complex tensor as its real view).
        value = work.get_future().wait()
        return value if isinstance(value, list) else [value]

    out: dict[str, Any] = {"same": {}, "direct": {}}
    for name, case in cases.items():
        for asyn in (False, True):
            ref = result(name, asyn, *case(ctx.ref, asyn))
            before = backend.direct_ops
            got = result(name, asyn, *case(group, asyn))
            key = f"{name}{'_async' if asyn else ''}"
            out["direct"][key] = backend.direct_ops - before

            # Beyond 2 ranks Gloo's ring adds the rows in another order than
            # the all-to-all route's rank order.
            def equal(a: torch.Tensor, b: torch.Tensor, name: str = name) -> bool:
                if ws == 2 or "reduce" not in name:
                    return torch.equal(a, b)
                return torch.allclose(a, b, rtol=1e-5, atol=1e-4)

            out["same"][key] = all(equal(a, b) for a, b in zip(got, ref, strict=True))
    # The group stays in step with gloo afterwards.
    x = torch.full((5,), float(me))
    dist.all_reduce(x, group=group)
    out["after"] = x.tolist()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_large_all_to_alls_and_all_gathers_go_as_messages_and_equal_gloo(world_size: int) -> None:
    res = run_ranks(_rank_direct_ops, world_size)
    total = float(sum(range(world_size)))
    for r in res:
        assert all(r["same"].values()), [k for k, v in r["same"].items() if not v]
        wrong = {k: v for k, v in r["direct"].items() if v != 1}
        assert not wrong, " ".join(f"{k}={v}" for k, v in sorted(wrong.items()))
        assert r["after"] == [total] * 5


def _rank_direct_switch(ctx: RankContext) -> dict[str, Any]:
    # Rank 0 turns the direct route off, rank 1 leaves it on: the group's
    # settings agreement refuses the group on both (before, each op's check
    # rows made both take Gloo's collective; the setting is now one the
    # group agrees on once, like every XCOMM_* variable that changes its ops).
    if ctx.rank == 0:
        os.environ["XCOMM_DIRECT_EXCHANGE"] = "0"
    t0 = time.monotonic()
    error = error_of(lambda: _group(ctx, 1))
    elapsed = time.monotonic() - t0
    os.environ["XCOMM_DIRECT_EXCHANGE"] = "0"  # now alike on every rank
    group = _group(ctx, 1)
    backend = group._get_backend(torch.device("cpu"))
    m = 140_001
    x = torch.arange(2 * m, dtype=torch.float32) + 1000 * ctx.rank
    out, ref = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    dist.all_to_all_single(ref, x, group=ctx.ref)
    return {
        "error": error,
        "elapsed": elapsed,
        "direct": backend.direct_ops,
        "same": torch.equal(out, ref),
    }


def test_ranks_that_differ_on_the_direct_route_are_refused_then_agree() -> None:
    for r in run_ranks(_rank_direct_switch, 2):
        assert r["error"] is not None and "ValueError" in r["error"], r
        assert "XCOMM_DIRECT_EXCHANGE (rank 0 'off'; rank 1 'on')" in r["error"], r
        assert r["elapsed"] < 10, r
        # Off on every rank: Gloo's collective, gloo's result.
        assert r["same"] and r["direct"] == 0, r


def _rank_after_a_rejected_op(ctx: RankContext, async_op: bool) -> dict[str, Any]:
    """An op Gloo rejects (int16 all_reduce), then a barrier and an
    all_reduce on xcomm's plain route; gloo's sum of the same all_reduce,
    issued first, is the reference. (Plain gloo is not put through the same
    sequence: after an async int16 all_reduce at 3 ranks its own barrier
    sometimes times out, "caused pair closure".)"""
    group = _group(ctx, 1)
    x = torch.arange(6, dtype=torch.float32) * (ctx.rank + 1)
    reference = x.clone()
    dist.all_reduce(reference, group=ctx.ref)
    bad = torch.ones(4, dtype=torch.int16)

    def rejected() -> None:
        work = dist.all_reduce(bad, group=group, async_op=async_op)
        if work is not None:
            work.wait()

    backend = group._get_backend(torch.device("cpu"))
    carried = backend.carried_ops
    out: dict[str, Any] = {"op": error_of(rejected)}
    out["barrier"] = error_of(lambda: dist.barrier(group=group))
    out["next"] = error_of(lambda: dist.all_reduce(x, group=group))
    out["same"] = torch.equal(x, reference)
    out["carried"] = backend.carried_ops - carried
    return out


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_an_error_belongs_to_its_op_not_the_next(world_size: int, async_op: bool) -> None:
    """The rejected op raises Gloo's error on every rank; the barrier and the
    all_reduce after it succeed (the barrier used to raise the old error
    once) and the all_reduce equals gloo's."""
    for r in run_ranks(_rank_after_a_rejected_op, world_size, async_op):
        assert r["op"] is not None and "Invalid scalar type" in r["op"], r
        assert r["barrier"] is None, r
        assert r["next"] is None and r["same"], r
        # The barrier and the small all_reduce ran on the checked route.
        assert r["carried"] == 2, r


def _rank_peer_leaves(ctx: RankContext) -> dict[str, Any] | None:
    group = _group(ctx, 1)
    dist.all_reduce(torch.ones(4), group=group)  # the group works first
    if ctx.rank == 1:
        time.sleep(0.5)  # rank 0 waits in the check's exchange by now
        os._exit(17)
    t0 = time.monotonic()
    error = error_of(lambda: dist.all_reduce(torch.ones(4), group=group))
    return {"error": error, "elapsed": time.monotonic() - t0}


def test_a_peer_that_dies_is_named_as_a_lost_connection_at_once() -> None:
    """A peer whose process ended closes its connections: the survivor's
    error comes well before the timeout and says the connection was lost,
    and after how long, instead of "did not take part within <timeout>"."""
    results = run_ranks(_rank_peer_leaves, 2, launcher="subprocess", may_die=[1], timeout=90)
    r = results[0]
    assert r is not None and r["error"] is not None, r
    assert "xcomm.all_reduce: the connection to rank 1 was lost after" in r["error"], r
    assert "did not take part" not in r["error"], r
    assert r["elapsed"] < 5, r


def _rank_departs(ctx: RankContext, leaver: int, compression: str | None) -> dict[str, Any]:
    import xcomm

    options = xcomm.Options(shm=False, compression=compression, compression_min_bytes=0)
    group = dist.new_group(backend="xcomm", pg_options=options)
    dist.all_reduce(torch.ones(1 << 16), group=group)  # the group works first
    if ctx.rank == leaver:
        time.sleep(0.5)  # the others wait in the all_reduce below by now
        left_at = time.time()
        dist.destroy_process_group(group)
        time.sleep(3)  # alive: its connections stay open, so only its word tells them
        return {"left_at": left_at}
    error = error_of(lambda: dist.all_reduce(torch.ones(1 << 16), group=group))
    return {"error": error, "failed_at": time.time()}


@pytest.mark.parametrize(
    ("world_size", "leaver", "compression"),
    [(2, 1, None), (3, 0, None), (4, 2, "int8")],
    ids=["ws2-plain", "ws3-rank0-leaves", "ws4-int8"],
)
def test_a_peer_that_destroys_its_group_is_named_within_100_ms(
    world_size: int, leaver: int, compression: str | None
) -> None:
    """On the Gloo routes a rank that destroys its group sends every peer its
    departure as its next descriptor row: a peer waiting in a check raises at
    once, naming it. It used to learn only when the leaver's connections
    closed, late in its teardown (60-120 ms; on a busy host more)."""
    res = run_ranks(_rank_departs, world_size, leaver, compression, timeout=60)
    left_at = res[leaver]["left_at"]
    for rank, r in enumerate(res):
        if rank == leaver:
            continue
        assert r["error"] is not None and f"rank {leaver} left the group" in r["error"], r
        assert r["failed_at"] - left_at < 0.1, (rank, r["failed_at"] - left_at, r["error"])
