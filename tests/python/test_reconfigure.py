"""torch 2.14's reconfigure on xcomm: one group that changes its members in place.

``init_process_group(..., enable_reconfigure=True)`` gives a group with no
communicator; ``dist._reconfigure(uuid, handles)`` makes it the group of the
processes whose handles (``dist._get_reconfigure_handle()``) it names, rank
by position. The scenarios are those torch's own fault-tolerance suite runs
against Gloo (world size 3, a FileStore): late join, all-reduce and
point-to-point after a reconfigure, shrinking away the last or a middle rank
and growing back, merge and split, identity, handles as a set, a reused uuid
refused, a reconfigure after an abort, a shrink after reconfigures; plus
xcomm's transactional promise: a reconfigure a member never joins fails on
every member that called it, and they all keep the old group, which still
works. Bad handles, and a shrink before the first reconfigure, are refused
by name.

Reference: the sums each membership must give, and Gloo's contract for ranks.
torch 2.13 has no reconfigure: the module is skipped there.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import RankContext, error_of, run_ranks

# every_case: what each case checks is torch 2.14's own contract (scripts/test.sh).
pytestmark = [
    pytest.mark.skipif(
        not hasattr(dist, "_reconfigure"), reason="torch before 2.14 has no reconfigure"
    ),
    pytest.mark.every_case,
]

WORLD = 3
TIMEOUT = datetime.timedelta(seconds=30)


class _Members:
    """Handles exchanged through the group's store, and reconfigures."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank

    def handles(self, key: str, ranks: list[int]) -> list[str]:
        self.store.set(f"{key}/{self.rank}", dist._get_reconfigure_handle())
        return [self.store.get(f"{key}/{r}").decode() for r in ranks]

    def barrier(self, key: str) -> None:
        self.store.set(f"{key}/{self.rank}", "1")
        self.store.wait([f"{key}/{r}" for r in range(WORLD)])

    def reconfigure(self, uuid: int, handles: Any, seconds: float = 30) -> None:
        work = dist._reconfigure(uuid, handles, timeout=datetime.timedelta(seconds=seconds))
        work.wait()


def _members_sum(original_rank: int) -> float:
    """The sum over the group's members of (their original rank + 1): says who is in it."""
    t = torch.tensor([float(original_rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _scenarios(ctx: RankContext, shm: bool) -> dict[str, Any]:
    import xcomm

    r = ctx.rank
    store = dist.FileStore(ctx.fresh_store_path("reconfigure"), WORLD)
    dist.init_process_group(
        "xcomm",
        store=store,
        rank=r,
        world_size=WORLD,
        timeout=TIMEOUT,
        enable_reconfigure=True,
        pg_options=xcomm.Options(shm=shm),
    )
    group = dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cpu"))
    m = _Members(store, r)
    out: dict[str, Any] = {
        "supports": bool(dist._supports_reconfigure()) and bool(backend.supports_reconfigure),
        "before": error_of(lambda: dist.all_reduce(torch.ones(1))),
    }

    # Late join: rank 0 alone first, the others still without a communicator.
    if r == 0:
        m.reconfigure(900, [dist._get_reconfigure_handle()])
        out["alone"] = (dist.get_rank(), dist.get_world_size(), _members_sum(r))
    m.reconfigure(901, m.handles("h901", [0, 1, 2]))
    out["all"] = (dist.get_rank(), dist.get_world_size(), _members_sum(r))
    out["plan"] = xcomm.group_plan()["shape"]

    # Point to point after a reconfigure: a ring, even ranks send first.
    send, recv = torch.full((4,), float(r)), torch.zeros(4)
    right, left = (r + 1) % WORLD, (r - 1) % WORLD
    if r % 2 == 0:
        dist.send(send, right)
        dist.recv(recv, left)
    else:
        dist.recv(recv, left)
        dist.send(send, right)
    out["ring"] = recv.tolist()

    # Shrink away the last rank, then grow back.
    h = m.handles("h902", [0, 1, 2])
    if r != 2:
        m.reconfigure(902, h[:2])
        t = torch.tensor([42.0 if r == 0 else 0.0])
        dist.broadcast(t, src=0)
        out["without_last"] = (
            dist.get_rank(),
            dist.get_world_size(),
            _members_sum(r),
            t.item(),
        )
    m.barrier("b902")
    m.reconfigure(903, m.handles("h903", [0, 1, 2]))
    out["regrown"] = _members_sum(r)

    # Shrink away the middle rank: rank 2 becomes rank 1.
    h = m.handles("h904", [0, 1, 2])
    if r != 1:
        m.reconfigure(904, [h[0], h[2]])
        out["without_middle"] = (dist.get_rank(), dist.get_world_size(), _members_sum(r))
    m.barrier("b904")
    m.reconfigure(905, m.handles("h905", [0, 1, 2]))

    # Split into {0} and {1, 2}, then merge.
    h = m.handles("h906", [0, 1, 2])
    if r == 0:
        m.reconfigure(906, [h[0]])
    else:
        m.reconfigure(907, [h[1], h[2]])
    out["split"] = (dist.get_rank(), dist.get_world_size(), _members_sum(r))
    m.reconfigure(908, m.handles("h908", [0, 1, 2]))
    out["merged"] = _members_sum(r)

    # Identity: the same members again, with their new handles.
    m.reconfigure(909, m.handles("h909", [0, 1, 2]))
    out["identity"] = (dist.get_rank(), _members_sum(r))

    # Handles as a set: ranks follow the handles' order as strings.
    h = m.handles("h910", [0, 1, 2])
    m.reconfigure(910, set(h))
    out["as_set"] = (dist.get_rank(), sorted(h).index(h[r]), _members_sum(r))

    # A uuid used before is refused.
    m.reconfigure(920 + r, [dist._get_reconfigure_handle()])
    out["reused"] = error_of(lambda: m.reconfigure(920 + r, [dist._get_reconfigure_handle()]))
    m.reconfigure(930, m.handles("h930", [0, 1, 2]))

    # After an abort: the group reports it and refuses ops; a reconfigure gives a working one.
    backend = group._get_backend(torch.device("cpu"))
    backend.abort()
    out["aborted"] = (backend.get_error().name, error_of(lambda: dist.all_reduce(torch.ones(1))))
    m.reconfigure(931, m.handles("h931", [0, 1, 2]))
    out["after_abort"] = (backend.get_error().name, _members_sum(r))

    # Transactional: rank 2 never joins uuid 940; ranks 0 and 1 fail within
    # its timeout and keep the 931 group, which rank 2 still has too.
    h = m.handles("h940", [0, 1, 2])
    if r != 2:
        out["not_joined"] = error_of(lambda: m.reconfigure(940, h, seconds=2))
    m.barrier("b940")
    out["kept"] = (dist.get_rank(), dist.get_world_size(), _members_sum(r))

    # A group a reconfigure made shrinks too (in that group's own namespace).
    if r != 2:
        shrunk = group._get_backend(torch.device("cpu")).shrink([2], 0, None)
        t = torch.tensor([float(r + 1)])
        shrunk.allreduce([t]).wait()
        out["shrunk"] = t.item()
        del shrunk
    m.barrier("b950")
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("shm", [True, False], ids=["shared-memory", "plain"])
def test_reconfigure_follows_torchs_contract_on_xcomm(shm: bool) -> None:
    results = run_ranks(
        _scenarios, WORLD, shm, init=False, ref_group=False, destroy=False, timeout=240
    )
    for r, out in enumerate(results):
        assert out["supports"], out
        assert out["before"] is not None and "reconfigure" in out["before"], out
        assert out["all"] == (r, 3, 6.0), out
        assert out["ring"] == [float((r - 1) % 3)] * 4, out
        assert out["regrown"] == 6.0 and out["merged"] == 6.0, out
        assert out["identity"] == (r, 6.0), out
        rank, expected_rank, total = out["as_set"]
        assert rank == expected_rank and total == 6.0, out
        assert out["reused"] is not None and "already used" in out["reused"], out
        assert out["aborted"][0] == "COMM_ERROR" and "aborted" in out["aborted"][1], out
        assert out["after_abort"] == ("SUCCESS", 6.0), out
        assert out["kept"] == (r, 3, 6.0), out
    assert results[0]["alone"] == (0, 1, 1.0)
    # The group reconfigured has the shape any group of its ranks has.
    assert results[0]["plan"] == ("single-host shared memory" if shm else "plain")
    assert [results[r]["without_last"] for r in (0, 1)] == [(0, 2, 3.0, 42.0), (1, 2, 3.0, 42.0)]
    assert "without_last" not in results[2]
    assert [results[r]["without_middle"] for r in (0, 2)] == [(0, 2, 4.0), (1, 2, 4.0)]
    assert [results[r]["split"] for r in range(3)] == [(0, 1, 1.0), (0, 2, 5.0), (1, 2, 5.0)]
    for r in (0, 1):
        assert results[r]["not_joined"] is not None, results[r]
        assert "keeps its group" in results[r]["not_joined"], results[r]
    assert [results[r]["shrunk"] for r in (0, 1)] == [3.0, 3.0]


def _bad_reconfigures(ctx: RankContext) -> dict[str, Any]:
    import xcomm

    store = dist.FileStore(ctx.fresh_store_path("bad"), 2)
    dist.init_process_group(
        "xcomm",
        store=store,
        rank=ctx.rank,
        world_size=2,
        timeout=TIMEOUT,
        enable_reconfigure=True,
        pg_options=xcomm.Options(shm=False),
    )
    m = _Members(store, ctx.rank)
    mine = dist._get_reconfigure_handle()
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    out = {
        # No communicator before the first reconfigure: nothing to shrink.
        "shrink_first": error_of(lambda: backend.shrink([1 - ctx.rank], 0, None)),
        "foreign": error_of(lambda: m.reconfigure(1, ["gloo:0:-1:0:"])),
        "twice": error_of(lambda: m.reconfigure(2, [mine, mine])),
        "absent": error_of(lambda: m.reconfigure(3, ["xcomm:9:-1:9"])),
        "empty": error_of(lambda: m.reconfigure(4, [])),
    }
    # None of them touched the group: a valid reconfigure still works.
    store.set(f"h/{ctx.rank}", mine)
    m.reconfigure(5, [store.get(f"h/{r}").decode() for r in range(2)])
    out["sum"] = _members_sum(ctx.rank)
    dist.destroy_process_group()
    return out


def test_bad_handles_are_refused_by_name_and_leave_the_group_as_it_was() -> None:
    for r in run_ranks(_bad_reconfigures, 2, init=False, ref_group=False, destroy=False):
        assert "ValueError" in r["foreign"] and "not an xcomm reconfigure handle" in r["foreign"]
        assert "ValueError" in r["twice"] and "is given twice" in r["twice"], r
        assert "ValueError" in r["absent"] and "not among the new group's handles" in r["absent"]
        assert r["empty"] is not None and "handle" in r["empty"], r
        assert "ValueError" in r["shrink_first"], r
        assert "no communicator yet" in r["shrink_first"] and "_reconfigure" in r["shrink_first"], r
        assert r["sum"] == 3.0, r
