"""Backend-level fusion of small allreduces (``xcomm.Options(fusion_threshold_bytes=...)``).

Reference: the same ops on the gloo reference group. The fused transfers are
counted in ``xcomm.stats()["ALLREDUCE_FUSED"]``; the test drives a sequence
whose flush points are known in advance and checks the count.
"""

from __future__ import annotations

import copy
import datetime
import os
import random
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import xcomm
from dist_harness import RankContext, run_ranks

THRESHOLD = 4096


def _fused_group() -> dist.ProcessGroup:
    return dist.new_group(
        backend="xcomm", pg_options=xcomm.Options(fusion_threshold_bytes=THRESHOLD)
    )


CYCLE_MS = 5.0


def _cycle_group(timeout: float | None = None) -> dist.ProcessGroup:
    return dist.new_group(
        backend="xcomm",
        pg_options=xcomm.Options(
            fusion_threshold_bytes=THRESHOLD,
            fusion_cycle_ms=CYCLE_MS,
            timeout=None if timeout is None else datetime.timedelta(seconds=timeout),
        ),
    )


def _timed_error(wait: Any) -> tuple[str | None, float]:
    """Runs ``wait()``; returns (its error as "Type: message", or None) and
    how long it took."""
    t0 = time.monotonic()
    try:
        wait()
        error = None
    except Exception as e:  # noqa: BLE001 - the error is the result
        error = f"{type(e).__name__}: {e}"
    return error, time.monotonic() - t0


def _rank_burst(ctx: RankContext) -> dict[str, Any]:
    group = _fused_group()
    g = ctx.generator()
    SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX
    # (tensor, op); comments: what the fusion buffer does at each op.
    plan = [
        (torch.randn(3, generator=g), SUM),  # held
        (torch.randn(100, generator=g), SUM),  # held
        (torch.randn(8, 2, generator=g).t(), SUM),  # non-contiguous (staged), held
        (torch.randint(0, 9, (5,), generator=g), SUM),  # int64: flush #1 (3 ops), held
        (torch.randint(0, 9, (5,), generator=g), MAX),  # MAX: flush #2, held
        (
            torch.randn(2000, generator=g),
            SUM,
        ),  # 8000 B: not fusable, flush #3, sent alone
        (torch.randn(1000, generator=g), SUM),  # 4000 B, held
        (torch.randn(100, generator=g), SUM),  # would pass 4096: flush #4, held
    ]
    mine = [t.clone() for t, _ in plan]
    refs = [t.clone() for t, _ in plan]
    xcomm.reset_stats()
    works = [
        dist.all_reduce(t, op=op, group=group, async_op=True) for t, (_, op) in zip(mine, plan)
    ]
    b = torch.full((4,), float(ctx.rank))
    dist.broadcast(b, src=1, group=group)  # flush #5, then the broadcast
    tail = [torch.randn(10, dtype=torch.float64, generator=g) for _ in range(2)]
    tail_ref = [t.clone() for t in tail]
    tail_works = [dist.all_reduce(t, group=group, async_op=True) for t in tail]  # held
    tail_works[1].wait()  # asking for a result: flush #6 (2 ops)
    for w in works + tail_works:
        w.wait()
    stats = xcomm.stats()
    for t, (_, op) in zip(refs, plan):
        dist.all_reduce(t, op=op, group=ctx.ref)
    for t in tail_ref:
        dist.all_reduce(t, group=ctx.ref)
    # A plain synchronous allreduce and a future chain also work with fusion on.
    s = torch.ones(7)
    dist.all_reduce(s, group=group)
    fut = (
        dist.all_reduce(torch.ones(3), group=group, async_op=True)
        .get_future()
        .then(lambda f: f.value()[0] * 2)
    )
    return {
        "equal": [torch.equal(a, b) for a, b in zip(mine + tail, refs + tail_ref)],
        "broadcast_ok": torch.equal(b, torch.full((4,), 1.0)),
        "fused_calls": stats.get("ALLREDUCE_FUSED", {}).get("calls"),
        "unfused_calls": stats.get("ALLREDUCE", {}).get("calls"),
        "sync_ok": torch.equal(s, torch.full((7,), float(ctx.world_size))),
        "chain_ok": torch.equal(fut.wait(), torch.full((3,), 2.0 * ctx.world_size)),
    }


def test_fused_allreduces_identical_to_gloo_with_known_flush_points() -> None:
    res = run_ranks(_rank_burst, 2)
    for r in res:
        assert all(r["equal"]), r["equal"]
        assert r["broadcast_ok"] and r["sync_ok"] and r["chain_ok"]
        # 13 small ops in at least the 6 transfers the kinds, the threshold and
        # the broadcast force; a round that agreed on a shorter prefix (a rank
        # that joined unasked) may cut one more.
        assert 6 <= r["fused_calls"] <= 13, r["fused_calls"]
        assert r["unfused_calls"] == 1  # the 8000-byte one
    assert res[0]["fused_calls"] == res[1]["fused_calls"], "every rank sends the same transfers"


def _rank_waits_at_different_points(ctx: RankContext) -> dict[str, Any]:
    # A legal program in which the ranks wait at different points: before,
    # each rank fused what it held when it waited, so the ranks sent
    # different sets (a size mismatch, or Gloo aborting the process).
    group = _fused_group()
    g = ctx.generator()
    tensors = [torch.randn(10 + 7 * i, generator=g) for i in range(8)]
    refs = [t.clone() for t in tensors]
    wait_after = {0: 1, 1: 5}[ctx.rank]
    works = []
    start = time.monotonic()
    for i, t in enumerate(tensors):
        works.append(dist.all_reduce(t, group=group, async_op=True))
        if i == wait_after:
            works[i - 1].wait()
    for w in works:
        w.wait()
    seconds = time.monotonic() - start
    for t in refs:
        dist.all_reduce(t, group=ctx.ref)
    return {"equal": [torch.equal(a, b) for a, b in zip(tensors, refs)], "seconds": seconds}


def test_on_demand_fusion_does_not_depend_on_where_ranks_wait() -> None:
    for r in run_ranks(_rank_waits_at_different_points, 2):
        assert all(r["equal"]), r
        assert r["seconds"] < 10, r


def _rank_two_groups_waited_in_opposite_orders(ctx: RankContext) -> dict[str, Any]:
    # Before, each rank's wait() fused and sent only its own group's held op,
    # and waited there for a peer that was waiting on the other group: a hang
    # that the timeout never ended.
    first, second = _fused_group(), _fused_group()
    a = torch.full((5,), float(ctx.rank + 1))
    b = torch.full((9,), float(10 * (ctx.rank + 1)))
    start = time.monotonic()
    wa = dist.all_reduce(a, group=first, async_op=True)
    wb = dist.all_reduce(b, group=second, async_op=True)
    for w in (wa, wb) if ctx.rank == 0 else (wb, wa):
        w.wait()
    return {
        "a": a.tolist(),
        "b": b.tolist(),
        "seconds": time.monotonic() - start,
    }


def test_on_demand_fusion_two_groups_waited_in_opposite_orders() -> None:
    for r in run_ranks(_rank_two_groups_waited_in_opposite_orders, 2):
        assert r["a"] == [3.0] * 5 and r["b"] == [30.0] * 9, r
        assert r["seconds"] < 10, r


def _rank_ddp(ctx: RankContext, cycle: bool) -> bool:
    # On demand: DDP takes each bucket's future at once, fusion must never
    # hold it back. With a cycle: DDP chains on the futures and never calls
    # wait(), so the cycle alone must bring the buckets back.
    group = _cycle_group() if cycle else _fused_group()
    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    out = []
    for pg in (group, ctx.ref):
        model = DDP(copy.deepcopy(base), process_group=pg, bucket_cap_mb=0.0001)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 6, generator=ctx.generator(salt=step))
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("cycle", [False, True], ids=["on_demand", "cycle"])
def test_ddp_over_a_fusing_group_identical_to_gloo(cycle: bool) -> None:
    assert all(run_ranks(_rank_ddp, 2, cycle))


def test_fusion_threshold_option_is_checked() -> None:
    with pytest.raises(ValueError, match="fusion_threshold_bytes must be >= 0"):
        xcomm.Options(fusion_threshold_bytes=-1)
    with pytest.raises(TypeError, match="fusion_threshold_bytes must be an int"):
        xcomm.Options(fusion_threshold_bytes=True)


# ------------------------------------------------------------ negotiated cycle


def _rank_cycle_sends_unasked(ctx: RankContext) -> dict[str, Any]:
    group = _cycle_group()
    g = ctx.generator()
    sizes = torch.randint(1, 64, (20,), generator=ctx.generator(rank=0))  # the same on every rank
    mine = [torch.randn(int(n), generator=g) for n in sizes]
    refs = [t.clone() for t in mine]
    xcomm.reset_stats()
    works = [dist.all_reduce(t, group=group, async_op=True) for t in mine]
    # Nobody waits: in cycle mode is_completed() does not hurry the held ops,
    # the background thread must send them on its own.
    deadline = time.monotonic() + 10.0
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.005)
    done_unasked = all(w.is_completed() for w in works)
    for w in works:
        w.wait()
    for t in refs:
        dist.all_reduce(t, group=ctx.ref)
    return {
        "done_unasked": done_unasked,
        "equal": all(torch.equal(a, b) for a, b in zip(mine, refs)),
        "fused_calls": xcomm.stats().get("ALLREDUCE_FUSED", {}).get("calls", 0),
        "cycle_ms": xcomm._C.fusion_cycle_ms(group._get_backend(torch.device("cpu"))),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_fusion_cycle_sends_held_ops_without_being_asked(world_size: int) -> None:
    for r in run_ranks(_rank_cycle_sends_unasked, world_size):
        assert r["done_unasked"], "held ops were not sent within 10 s by the cycle thread"
        assert r["equal"]
        assert r["cycle_ms"] == CYCLE_MS
        assert 1 <= r["fused_calls"] < 20  # the 20 ops were issued in < 1 cycle or few


def _rank_cycle_jitter(ctx: RankContext, seed: int) -> dict[str, Any]:
    """Ops of mixed dtypes, reduce ops and sizes, issued with rank-dependent
    pauses, so each rank's cycle fires at different points of the sequence;
    broadcasts and waits in between. The agreement must cut the same groups
    on every rank, and every result must equal Gloo's."""
    group = _cycle_group()
    g = torch.Generator().manual_seed(seed)  # the same plan on every rank
    jitter = random.Random(seed * 10 + ctx.rank)  # different pauses per rank
    SUM, MAX, MIN = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN
    mine: list[torch.Tensor] = []
    refs: list[tuple[torch.Tensor, Any]] = []
    works = []
    bcast_ok = True
    xcomm.reset_stats()
    xcomm.enable_timeline()
    for i in range(120):
        kind = int(torch.randint(0, 10, (1,), generator=g))
        n = int(torch.randint(1, 300, (1,), generator=g))
        if kind < 6:
            # whole numbers: exact in any order of addition (shm at 3 ranks
            # and Gloo's ring add in different orders)
            t, op = torch.randint(-999, 999, (n,), generator=g).float() + ctx.rank, SUM
        elif kind < 8:
            t, op = torch.randint(-50, 50, (n,), generator=g) * (ctx.rank + 1), MAX
        elif kind == 8:
            t, op = torch.randn(n, generator=g, dtype=torch.float64) - ctx.rank, MIN
        else:
            b = torch.full((3,), float(ctx.rank + i))
            dist.broadcast(b, src=i % ctx.world_size, group=group)
            bcast_ok &= torch.equal(b, torch.full((3,), float(i % ctx.world_size + i)))
            continue
        mine.append(t)
        refs.append((t.clone(), op))
        works.append(dist.all_reduce(t, op=op, group=group, async_op=True))
        if jitter.random() < 0.15:
            time.sleep(jitter.uniform(0, 2 * CYCLE_MS / 1000))
        if jitter.random() < 0.05:
            works[jitter.randrange(len(works))].wait()
    for w in works:
        w.wait()
    fused = xcomm.stats().get("ALLREDUCE_FUSED", {}).get("calls", 0)
    rounds = [
        e["args"]
        for e in xcomm.timeline_json(ctx.rank)["traceEvents"]
        if e.get("name") == "FUSION_ROUND"
    ]
    xcomm.disable_timeline()
    for t, op in refs:
        dist.all_reduce(t, op=op, group=ctx.ref)
    return {
        "equal": [torch.equal(a, b) for a, (b, _) in zip(mine, refs)],
        "bcast_ok": bcast_ok,
        "fused_calls": fused,
        "ops": len(mine),
        # rounds where this rank had issued more than all ranks had
        "ahead": sum(int(a["issued"]) > int(a["agreed"]) for a in rounds),
    }


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.large_world)])
def test_fusion_cycle_with_rank_dependent_timing_identical_to_gloo(world_size: int) -> None:
    for seed in (1, 2):
        results = run_ranks(_rank_cycle_jitter, world_size, seed)
        for r in results:
            assert all(r["equal"]), r["equal"]
            assert r["bcast_ok"]
            assert r["fused_calls"] < r["ops"]  # some ops did travel together
        # The same groups on every rank: as many fused transfers everywhere.
        assert len({r["fused_calls"] for r in results}) == 1, results
        # The timing did make ranks enter rounds with different counts.
        assert sum(r["ahead"] for r in results) > 0, results


def _rank_cycle_dead_peer(ctx: RankContext) -> dict[str, Any] | None:
    group = _cycle_group(timeout=5.0)
    t = torch.ones(8)
    dist.all_reduce(t, group=group)  # healthy first
    if ctx.rank == 1:
        time.sleep(0.3)
        os._exit(17)  # dies without issuing the held op's peer
    error, elapsed = _timed_error(
        lambda: dist.all_reduce(torch.ones(8), group=group, async_op=True).wait()
    )
    # Later fused ops fail at once instead of waiting for a round.
    second, second_s = _timed_error(
        lambda: dist.all_reduce(torch.ones(8), group=group, async_op=True).wait()
    )
    return {"error": error, "elapsed": elapsed, "second": second, "second_s": second_s}


@pytest.mark.slow
def test_fusion_cycle_dead_peer_raises_within_the_timeout() -> None:
    results = run_ranks(_rank_cycle_dead_peer, 2, may_die=[1], launcher="subprocess")
    r = results[0]
    assert r is not None
    assert r["error"] is not None and r["elapsed"] < 30.0, r
    assert r["second"] is not None and r["second_s"] < 30.0, r


def _rank_cycle_abort_and_shutdown(ctx: RankContext) -> dict[str, Any]:
    # A cycle far longer than the test: held ops leave only when told to.
    slow = xcomm.Options(fusion_threshold_bytes=THRESHOLD, fusion_cycle_ms=600_000.0)
    aborted = dist.new_group(backend="xcomm", pg_options=slow)
    work = dist.all_reduce(torch.ones(4), group=aborted, async_op=True)
    t0 = time.monotonic()
    c10d._abort_process_group(aborted)
    try:
        work.wait()
        abort_error = None
    except RuntimeError as e:
        abort_error = str(e)
    abort_s = time.monotonic() - t0

    # shutdown() sends what is held (every rank shuts down at the same point).
    closing = dist.new_group(backend="xcomm", pg_options=slow)
    t = torch.full((4,), float(ctx.rank + 1))
    work = dist.all_reduce(t, group=closing, async_op=True)
    backend = closing._get_backend(torch.device("cpu"))
    backend.shutdown()
    backend.shutdown()  # idempotent
    work.wait()
    return {
        "abort_error": abort_error,
        "abort_s": abort_s,
        "after_shutdown": t.tolist(),
        "expected": [float(sum(range(1, ctx.world_size + 1)))] * 4,
    }


def test_fusion_cycle_abort_fails_held_ops_and_shutdown_sends_them() -> None:
    for r in run_ranks(_rank_cycle_abort_and_shutdown, 2):
        assert r["abort_error"] is not None and "aborted" in r["abort_error"], r
        assert r["abort_s"] < 10.0, r
        assert r["after_shutdown"] == r["expected"], r


def test_fusion_cycle_option_is_checked() -> None:
    with pytest.raises(ValueError, match="fusion_cycle_ms needs fusion on"):
        xcomm.Options(fusion_cycle_ms=2.0)
    with pytest.raises(ValueError, match="fusion_cycle_ms must be >= 0"):
        xcomm.Options(fusion_threshold_bytes=1024, fusion_cycle_ms=-1.0)
    with pytest.raises(TypeError, match="fusion_cycle_ms must be a number"):
        xcomm.Options(fusion_threshold_bytes=1024, fusion_cycle_ms="5")


def _rank_fused_wait_timeout(ctx: RankContext, cycle: bool) -> dict[str, Any] | None:
    group = _cycle_group(timeout=20.0) if cycle else _fused_group()
    dist.all_reduce(torch.ones(8), group=group)  # healthy first
    if ctx.rank == 1:
        ctx.wait_signal("measured", 60)  # joins only after rank 0 gave up waiting
        dist.all_reduce(torch.ones(8), group=group, async_op=True).wait()
        return None
    work = dist.all_reduce(torch.ones(8), group=group, async_op=True)
    error, elapsed = _timed_error(lambda: work.wait(timeout=datetime.timedelta(seconds=1)))
    ctx.signal("measured")
    work.wait()  # rank 1 joins: the op itself still completes
    return {"error": error, "elapsed": elapsed}


@pytest.mark.parametrize("cycle", [False, True], ids=["on-demand", "cycle"])
def test_fused_wait_with_a_timeout_gives_up_at_that_timeout(cycle: bool) -> None:
    """work.wait(timeout) on a held op raises after that timeout (as Gloo's
    work does), not after the group's (40 s here, 20 s for the cycle)."""
    r = run_ranks(_rank_fused_wait_timeout, 2, cycle=cycle)[0]
    assert r is not None
    assert r["error"] is not None and "timed out" in r["error"].lower(), r
    assert 0.9 <= r["elapsed"] < 5.0, r


def _rank_fusion_set_timeout(ctx: RankContext) -> dict[str, Any] | None:
    group = _cycle_group(timeout=40.0)
    dist.all_reduce(torch.ones(8), group=group)
    group._get_backend(torch.device("cpu"))._set_default_timeout(datetime.timedelta(seconds=2))
    if ctx.rank == 1:
        ctx.wait_signal("measured", 60)  # never joins the next round in time
        return None
    error, elapsed = _timed_error(
        lambda: dist.all_reduce(torch.ones(8), group=group, async_op=True).wait()
    )
    ctx.signal("measured")
    return {"error": error, "elapsed": elapsed}


def test_a_timeout_set_after_creation_reaches_the_fusion_rounds() -> None:
    """The fusion cycle's agreement rounds run on their own control group;
    a timeout set on the xcomm group later must bound them too (they kept
    the creation timeout, 40 s)."""
    res = run_ranks(_rank_fusion_set_timeout, 2, timeout=60, destroy=False)
    r = res[0]
    assert r is not None
    assert r["error"] is not None, r
    assert r["elapsed"] < 10.0, r
