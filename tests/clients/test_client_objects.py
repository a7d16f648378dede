"""Object collectives and ``dist.monitored_barrier`` as user code calls them.

Every case runs on the default group of xcomm and of gloo (same inputs) and
the per-rank results must be equal: the objects received, and for a
monitored barrier that a rank skips, the error raised on rank 0 (which must
name the missing rank on both backends).
"""

from __future__ import annotations

import datetime
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from client_common import PG_TIMEOUT, assert_same, run_both

from dist_harness import RankContext, run_ranks


def _payload(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(42 + rank)
    return {
        "rank": rank,
        "name": f"worker-{rank}" * (rank + 1),
        "tensor": torch.randn(3, 4, generator=g),
        "ints": list(range(rank * 5)),
        "nested": {"t": torch.arange(rank + 2, dtype=torch.int64), "none": None},
        "big": bytes(range(256)) * (40 * (rank + 1)),  # ~10-20 KB: not a tiny message
    }


def _objects(ctx: RankContext) -> dict[str, Any]:
    rank, ws = ctx.rank, ctx.world_size
    out: dict[str, Any] = {}

    gathered: list[Any] = [None] * ws
    dist.all_gather_object(gathered, _payload(rank))
    out["all_gather_object"] = gathered

    objs = [_payload(100), "second", 3.5] if rank == 0 else [None, None, None]
    dist.broadcast_object_list(objs, src=0)
    out["broadcast_object_list"] = objs

    objs = [None, None] if rank == 0 else [{"from": 1}, (1, 2, 3)]
    dist.broadcast_object_list(objs, src=1)
    out["broadcast_object_list_src1"] = objs

    recv: list[Any] = [None]
    scatter_in = [_payload(200 + r) for r in range(ws)] if rank == 0 else None
    dist.scatter_object_list(recv, scatter_in, src=0)
    out["scatter_object_list"] = recv[0]

    gather_out: list[Any] | None = [None] * ws if rank == ws - 1 else None
    dist.gather_object(_payload(300 + rank), gather_out, dst=ws - 1)
    out["gather_object"] = gather_out

    # The object collectives must leave the group usable for tensor collectives.
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    out["all_reduce_after"] = t
    return out


@pytest.mark.client
def test_object_collectives_match_gloo() -> None:
    res = run_both(_objects)
    assert_same(res)
    # and they are right, not merely equal
    r0 = res["xcomm"][0]
    assert r0["all_gather_object"][1]["name"] == "worker-1worker-1"
    assert res["xcomm"][1]["broadcast_object_list"][1:] == ["second", 3.5]
    assert res["xcomm"][0]["broadcast_object_list_src1"] == [{"from": 1}, (1, 2, 3)]
    assert res["xcomm"][1]["scatter_object_list"]["rank"] == 201
    assert [p["rank"] for p in res["xcomm"][1]["gather_object"]] == [300, 301]


#: torch's ``dist.monitored_barrier`` refuses any backend not named "gloo";
#: ``import xcomm`` routes it, for xcomm groups, to the group's own
#: ``monitored_barrier``, which runs Gloo's (python/xcomm/compat.py).
WAIT_ALL = pytest.mark.parametrize("wait_all_ranks", [False, True], ids=["first", "wait_all"])


def _monitored(ctx: RankContext, wait_all_ranks: bool) -> list[Any]:
    out: list[Any] = []
    for _ in range(3):
        dist.monitored_barrier(
            timeout=datetime.timedelta(seconds=10), wait_all_ranks=wait_all_ranks
        )
        out.append("passed")
    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t)
    out.append(t)
    return out


def _missing_rank(ctx: RankContext, wait_all_ranks: bool) -> str:
    """Rank 1 never arrives; rank 0's monitored_barrier must fail naming it."""
    if ctx.rank == 0:
        try:
            dist.monitored_barrier(
                timeout=datetime.timedelta(seconds=2), wait_all_ranks=wait_all_ranks
            )
        except Exception as e:  # noqa: BLE001 - the message is what is compared
            msg = f"{type(e).__name__}: {e}"
        else:
            msg = "no error"
        ctx.signal("rank0_done")
        return msg
    ctx.wait_signal("rank0_done", timeout=30)
    return "absent"


def _normalise(msg: str) -> str:
    """The part of the message that names the failure (drop gloo's file:line prefix)."""
    m = re.search(r"Ranks? [\d, ]+ failed to pass monitoredBarrier[^\n]*", msg)
    return m.group(0) if m else msg


def _check_missing(msgs: list[str]) -> None:
    assert msgs[1] == "absent"
    assert re.search(r"Ranks? 1 failed to pass monitoredBarrier", msgs[0]), msgs[0]


@pytest.mark.client
@WAIT_ALL
def test_monitored_barrier_reference_on_gloo(wait_all_ranks: bool) -> None:
    """The client itself is right: on gloo the barrier passes, and a rank that
    does not arrive is named in rank 0's error."""
    kw = {"backend": "gloo", "ref_group": False, "pg_timeout": PG_TIMEOUT}
    assert run_ranks(_monitored, 2, wait_all_ranks, **kw)[0][-1].item() == 3.0
    _check_missing(run_ranks(_missing_rank, 2, wait_all_ranks, **kw))


@pytest.mark.client
@WAIT_ALL
def test_monitored_barrier_passes(wait_all_ranks: bool) -> None:
    res = run_both(_monitored, wait_all_ranks)
    assert_same(res)


@pytest.mark.client
@WAIT_ALL
def test_monitored_barrier_names_the_missing_rank(wait_all_ranks: bool) -> None:
    res = run_both(_missing_rank, wait_all_ranks)
    _check_missing(res["xcomm"])
    assert _normalise(res["xcomm"][0]) == _normalise(res["gloo"][0]), res
