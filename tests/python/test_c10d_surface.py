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


def _rank_profiler_names(ctx: RankContext) -> list[str]:
    from torch.profiler import profile

    t = torch.ones(4)
    with profile() as prof:
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_gather([torch.zeros(4) for _ in range(ctx.world_size)], t)
    return sorted({e.name for e in prof.events()})


def test_profiler_events_name_the_collective() -> None:
    for names in run_ranks(_rank_profiler_names, 2):
        joined = " ".join(names)
        for op in ("all_reduce", "broadcast", "all_gather"):
            assert any(op in n and "xcomm" in n for n in names), (op, joined)
