"""The parts of the c10d surface that torch's own callers reach beyond the
collectives: ``all_gather_coalesced``, ``monitored_barrier`` (Gloo's, through
the group), the ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wrapper, changing a group's
timeout after creation, and the names ops carry in ``torch.profiler``.

Reference: the same calls on the gloo reference group.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import RankContext, run_ranks


def _rank_all_gather_coalesced(ctx: RankContext) -> dict[str, Any]:
    def run(group: dist.ProcessGroup | None) -> list[list[list[float]]]:
        ins = [
            torch.arange(3, dtype=torch.float32) + ctx.rank,
            torch.full((2, 2), 10.0 * (ctx.rank + 1)),
        ]
        outs = [[torch.zeros_like(t) for t in ins] for _ in range(ctx.world_size)]
        dist.all_gather_coalesced(outs, ins, group=group)
        return [[t.flatten().tolist() for t in per_rank] for per_rank in outs]

    return {"mine": run(None), "ref": run(ctx.ref)}


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.large_world)])
def test_all_gather_coalesced_matches_gloo(world_size: int) -> None:
    for r in run_ranks(_rank_all_gather_coalesced, world_size):
        assert r["mine"] == r["ref"], r


def _rank_monitored_barrier(ctx: RankContext) -> dict[str, Any]:
    # dist.monitored_barrier() refuses every backend not named "gloo" before it
    # reaches the group; the group's own method reaches xcomm, which runs
    # Gloo's monitored barrier on the group's Gloo backend.
    pg = dist.distributed_c10d._get_default_group()
    out: dict[str, Any] = {}
    pg.monitored_barrier(datetime.timedelta(seconds=10), True)
    out["all_arrived"] = True
    if ctx.rank == 0:
        start = time.monotonic()
        try:
            pg.monitored_barrier(datetime.timedelta(seconds=2), True)
            out["error"] = None
        except RuntimeError as e:
            out["error"] = str(e)
        out["seconds"] = time.monotonic() - start
    else:
        time.sleep(4)  # rank 1 does not arrive in time
    return out


def test_monitored_barrier_names_the_rank_that_did_not_arrive() -> None:
    res = run_ranks(_rank_monitored_barrier, 2)
    assert all(r["all_arrived"] for r in res)
    assert res[0]["error"] and "Ranks 1 failed to pass monitoredBarrier" in res[0]["error"], res[0]
    assert res[0]["seconds"] < 10, res[0]


def _rank_debug_detail(ctx: RankContext) -> dict[str, Any]:
    pg = dist.distributed_c10d._get_default_group()
    out: dict[str, Any] = {
        "level": str(dist.get_debug_level()),
        "wrapped": type(pg._get_backend(torch.device("cpu"))).__name__,
    }
    t = torch.ones(4)
    dist.all_reduce(t)
    out["sum"] = t.tolist()
    try:
        dist.all_reduce(torch.ones(3 + ctx.rank))  # a user bug: the wrapper names it
        out["mismatch"] = None
    except RuntimeError as e:
        out["mismatch"] = str(e)
    return out


@pytest.mark.slow
def test_debug_detail_wraps_xcomm_and_reports_a_mismatch() -> None:
    res = run_ranks(
        _rank_debug_detail, 2, launcher="subprocess", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    )
    for r in res:
        assert r["level"] == "DebugLevel.DETAIL" and r["wrapped"] == "_ProcessGroupWrapper", r
        assert r["sum"] == [2.0] * 4
        assert r["mismatch"] and "Detected mismatch between collectives" in r["mismatch"], r


def _rank_set_timeout(ctx: RankContext) -> dict[str, Any]:
    # torch's own helper (dist.distributed_c10d._set_pg_timeout) only touches
    # backends that are ProcessGroupGloo/NCCL instances and warns otherwise;
    # the backend's own method is what it calls on those.
    pg = dist.distributed_c10d._get_default_group()
    pg._get_backend(torch.device("cpu"))._set_default_timeout(datetime.timedelta(seconds=2))
    out: dict[str, Any] = {}
    t = torch.ones(4)
    dist.all_reduce(t)
    out["sum"] = t.tolist()
    if ctx.rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))  # rank 1 never joins
            out["error"] = None
        except Exception as e:  # noqa: BLE001
            out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - start
    else:
        time.sleep(6)  # alive but absent: only the timeout can end rank 0's wait
    return out


def test_a_timeout_set_after_creation_applies() -> None:
    # The group is created with the suite's 40 s timeout; the 2 s set later
    # must end rank 0's unmatched all_reduce, not a dead peer or the 40 s.
    res = run_ranks(_rank_set_timeout, 2)
    assert res[0]["sum"] == [2.0] * 4
    assert res[0]["error"] and "time" in res[0]["error"].lower(), res[0]
    assert 1.5 < res[0]["seconds"] < 5.5, res[0]


#: xcomm groups whose ops take different routes, each profiled against gloo.
_PROFILED_GROUPS = {
    "shm": {},
    "noshm": {"shm": False},
    "int8": {"shm": False, "compression": "int8", "compression_min_bytes": 0},
    "bf16-shm": {"compression": "bf16", "compression_min_bytes": 0},
    "fusion": {"shm": False, "fusion_threshold_bytes": 1 << 16},
}


def _profiled_ops(ctx: RankContext, group: dist.ProcessGroup) -> dict[str, Any]:
    """Runs each collective once under the profiler on ``group``; returns the
    backend events (``<name>:...``, not c10d's dispatcher ones) of each."""
    from torch.autograd.profiler import profile

    w, r = ctx.world_size, ctx.rank
    t = torch.ones(8, 4) * (r + 1)
    ops: dict[str, Any] = {
        "all_reduce": lambda: dist.all_reduce(t, group=group),
        "all_reduce:async": lambda: dist.all_reduce(t, group=group, async_op=True).wait(),
        "broadcast": lambda: dist.broadcast(t, 0, group=group),
        "reduce": lambda: dist.reduce(t, 0, group=group),
        "all_gather": lambda: dist.all_gather(
            [torch.empty(8, 4) for _ in range(w)], t, group=group
        ),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(8 * w, 4), t, group=group
        ),
        "gather": lambda: dist.gather(
            t, [torch.empty(8, 4) for _ in range(w)] if r == 0 else None, 0, group=group
        ),
        "scatter": lambda: dist.scatter(
            torch.empty(8, 4), [t.clone() for _ in range(w)] if r == 0 else None, 0, group=group
        ),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(8, 4), torch.ones(8 * w, 4), group=group
        ),
        "all_to_all_single": lambda: dist.all_to_all_single(
            torch.empty(8 * w, 4), torch.ones(8 * w, 4), group=group
        ),
        "barrier": lambda: dist.barrier(group=group),
        "send_recv": lambda: (
            dist.send(t, 1, group=group) if r == 0 else dist.recv(t, 0, group=group)
        ),
    }
    out = {}
    for name, fn in ops.items():
        with profile(record_shapes=True) as prof:
            fn()
        out[name] = [
            (e.name, [list(s) for s in e.input_shapes], e.is_async, e.count)
            for e in prof.function_events
            if e.name.split(":")[0] in ("xcomm", "gloo", "shm", "store")
        ]
    return out


def _rank_profiler_events(ctx: RankContext) -> dict[str, Any]:
    import xcomm

    groups = {
        k: dist.new_group(backend="xcomm", pg_options=xcomm.Options(**o))
        for k, o in _PROFILED_GROUPS.items()
    }
    res = {"gloo": _profiled_ops(ctx, ctx.ref)}
    for k, g in groups.items():
        res[k] = _profiled_ops(ctx, g)
    return res


def test_each_op_is_one_profiler_event_named_xcomm_op_with_gloos_input_shapes() -> None:
    """Like Gloo's ``gloo:<op>``, every xcomm op is exactly one async
    ``xcomm:<op>`` event (``xcomm:<op>:<how>`` when compressed or fused), on
    every route, with the shapes Gloo records; the route's own events
    (``shm:...``, the inner ``gloo:...``) never start with ``xcomm:``."""
    for rank, res in enumerate(run_ranks(_rank_profiler_events, 2)):
        for group, ops in res.items():
            if group == "gloo":
                continue
            for op, events in ops.items():
                name = {"all_reduce:async": "all_reduce", "send_recv": ("send", "recv")[rank]}
                name = name.get(op, op)
                mine = [e for e in events if e[0].startswith("xcomm:")]
                where = (rank, group, op, events)
                assert len(mine) == 1, where
                title, shapes, is_async, count = mine[0]
                assert title == f"xcomm:{name}" or title.startswith(f"xcomm:{name}:"), where
                assert is_async and count == 1, where
                ref = [e for e in res["gloo"][op] if e[0].startswith("gloo:")]
                assert len(ref) == 1, (rank, op, res["gloo"][op])
                assert shapes == ref[0][1], (where, ref)
        # How an op was transformed shows in its name.
        assert any(e[0] == "xcomm:all_reduce:int8" for e in res["int8"]["all_reduce"])
        assert any(e[0] == "xcomm:all_reduce:bf16" for e in res["bf16-shm"]["all_reduce"])
        assert any(
            e[0] == "xcomm:reduce_scatter_tensor:int8" for e in res["int8"]["reduce_scatter_tensor"]
        )
        assert any(e[0] == "xcomm:all_reduce:fused" for e in res["fusion"]["all_reduce:async"])


def _futures_not_done_after_wait(ctx: RankContext, route: str) -> dict[str, int]:
    import xcomm

    group = dist.new_group(backend="xcomm", pg_options=xcomm.Options(shm=route == "shm"))
    out = {}
    for name, g in (("xcomm", group), ("gloo", ctx.ref)):
        late = 0
        for _ in range(FUTURE_ROUNDS):
            work = dist.all_reduce(torch.ones(64), group=g, async_op=True)
            work.wait()
            late += not work.get_future().done()
        out[name] = late
    return out


FUTURE_ROUNDS = 500


@pytest.mark.parametrize("route", ["shm", "plain"])
def test_the_future_is_done_when_wait_returns(route: str) -> None:
    """Gloo completes a work's future before its ``wait()`` returns, so a
    callback chained with ``then()`` right after ``wait()`` runs at once;
    torchft's ``Manager`` relies on it (its callback chain breaks otherwise)."""
    for r in run_ranks(_futures_not_done_after_wait, 2, route, timeout=120):
        assert r["gloo"] == 0, r  # the reference
        assert r["xcomm"] == 0, r
