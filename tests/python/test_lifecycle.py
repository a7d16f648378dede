"""Aborting and shutting down xcomm groups, as torch.distributed does them.

Reference: gloo's behaviour for the same calls (the group goes away; a new
group over the same ranks works and computes the right sums).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dist_harness import BACKEND, RankContext, free_port, run_ranks


def _abort_subgroup_then_use_another(ctx: RankContext) -> list[float]:
    sub = dist.new_group(backend=BACKEND)
    t = torch.ones(4)
    dist.all_reduce(t, group=sub)
    c10d._abort_process_group(sub)  # aborts the subgroup's backends (xcomm's, then Gloo's)
    other = dist.new_group(backend=BACKEND)
    u = torch.full((4,), float(ctx.rank + 1))
    dist.all_reduce(u, group=other)
    dist.all_reduce(t)  # the default group still works
    return [t[0].item(), u[0].item()]


def test_abort_a_subgroup_then_keep_working() -> None:
    ws = 3
    for first, second in run_ranks(_abort_subgroup_then_use_another, ws):
        assert first == ws * ws  # ones summed twice
        assert second == ws * (ws + 1) / 2


def _shutdown_backend(ctx: RankContext) -> str:
    sub = dist.new_group(backend=BACKEND, timeout=datetime.timedelta(seconds=20))
    dist.all_reduce(torch.ones(2), group=sub)
    backend = sub._get_backend(torch.device("cpu"))
    backend.shutdown()
    backend.shutdown()  # idempotent
    dist.barrier()
    return "ok"


def test_shutdown_is_idempotent() -> None:
    assert run_ranks(_shutdown_backend, 2) == ["ok", "ok"]


def _abort_default_group(ctx: RankContext) -> str:
    dist.all_reduce(torch.ones(2))
    c10d._abort_process_group()  # the default group: torch tears down the world
    return "ok"


def test_abort_the_default_group() -> None:
    assert run_ranks(_abort_default_group, 2, ref_group=False, destroy=False) == ["ok", "ok"]


def _destroy_while_a_callback_needs_the_gil(ctx: RankContext) -> dict[str, object]:
    ran: list[float] = []

    def slow_callback(fut: torch.futures.Future) -> torch.Tensor:
        # Runs on an xcomm completion thread; the sleep lets the main thread
        # reach the group's teardown, then the callback needs the GIL again.
        time.sleep(0.5)
        ran.append(fut.value()[0][0].item())
        return fut.value()[0]

    t = torch.ones(4)
    if ctx.rank == 0:
        work = dist.all_reduce(t, async_op=True)
        chained = work.get_future().then(slow_callback)
        ctx.signal("attached")  # rank 1 joins the allreduce only now
    else:
        ctx.wait_signal("attached", 30)
        work = dist.all_reduce(t, async_op=True)
        chained = work.get_future().then(slow_callback)
    del work, t  # xcomm's threads now hold the last references to the op's tensor
    t0 = time.monotonic()
    dist.destroy_process_group()  # the group's last reference goes here, under the GIL
    return {"destroy_s": time.monotonic() - t0, "ran": ran, "done": chained.done()}


def test_destroy_while_a_completion_thread_needs_the_gil() -> None:
    """Issue 16: since torch 2.14 a backend is destroyed from its Python object's
    dealloc, with the GIL held. xcomm's destructor joins its completion threads;
    one running a Python callback (or dropping the last reference to a tensor
    with a Python object) needs the GIL, so the join hung for ever. The backend's
    holder now lets go of the GIL while the backend is destroyed."""
    for res in run_ranks(_destroy_while_a_callback_needs_the_gil, 2, timeout=60):
        assert res["destroy_s"] < 10, res
        assert res["ran"] in ([], [2.0]), res


def _recreate_over_one_store(
    ctx: RankContext, store_kind: str, port: int, slow_rank: int | None, hosts: int
) -> list[dict[str, Any]]:
    import xcomm

    if hosts > 1:  # two emulated hosts: the hierarchical shape
        os.environ["XCOMM_SHM_HOST_TAG"] = f"host{ctx.rank * hosts // ctx.world_size}"
    timeout = datetime.timedelta(seconds=20)
    # One store for the whole run, as torchrun's agent store or a store the
    # program made itself: every group name repeats, and its keys are there.
    if store_kind == "tcp":
        store: dist.Store = dist.TCPStore(
            "127.0.0.1", port, ctx.world_size, is_master=ctx.rank == 0, timeout=timeout
        )
    else:
        store = dist.FileStore(ctx.fresh_store_path("shared"), ctx.world_size)
    seen = []
    for incarnation in range(3):
        if ctx.rank == slow_rank:
            time.sleep(0.5)  # the others read the store before this rank writes to it
        dist.init_process_group(
            "xcomm", store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout
        )
        sub = dist.new_group(backend="xcomm")  # the same subgroup name each time, too
        t = torch.full((5,), float(ctx.rank + 1 + incarnation))
        dist.all_reduce(t)
        u = torch.full((3,), float(ctx.rank))
        dist.broadcast(u, src=ctx.world_size - 1, group=sub)
        seen.append(
            {
                "shape": xcomm.group_plan()["shape"],
                "sub_shape": xcomm.group_plan(sub)["shape"],
                "sum": t.tolist(),
                "bcast": u.tolist(),
            }
        )
        dist.destroy_process_group()
    return seen


@pytest.mark.parametrize(
    "store_kind, slow_rank, hosts, world_size",
    [
        ("tcp", None, 1, 2),
        ("tcp", 1, 1, 2),
        ("tcp", 0, 1, 2),
        ("file", 1, 1, 2),
        pytest.param("tcp", 3, 2, 4, marks=pytest.mark.large_world),
    ],
    ids=["tcp", "tcp-slow-rank1", "tcp-slow-rank0", "file-slow-rank1", "tcp-2hosts-slow-rank3"],
)
def test_recreating_groups_over_a_store_that_holds_earlier_keys(
    store_kind: str, slow_rank: int | None, hosts: int, world_size: int
) -> None:
    """Issue 12: destroy_process_group() + init_process_group() over a store
    that outlives the group. Every key of the new group has its old name, so a
    rank that read the store before a slow peer wrote to it read the earlier
    group's shm segment name (and fell back to Gloo, or diverged from its
    peers) or its Gloo addresses (connection refused; plain gloo fails the same
    way). Each group now keeps its keys under a token rank 0 hands out."""
    expected_shape = "single-host shared memory" if hosts == 1 else "hierarchical"
    n = world_size
    res = run_ranks(
        _recreate_over_one_store,
        world_size,
        store_kind,
        free_port(),
        slow_rank,
        hosts,
        init=False,
        timeout=90,
    )
    for rank, seen in enumerate(res):
        assert len(seen) == 3, seen
        for i, inc in enumerate(seen):
            assert inc["shape"] == expected_shape and inc["sub_shape"] == expected_shape, (
                rank,
                i,
                inc,
            )
            assert inc["sum"] == [float(sum(r + 1 + i for r in range(n)))] * 5, (rank, i, inc)
            assert inc["bcast"] == [float(n - 1)] * 3, (rank, i, inc)


_EXIT_PROBE = """
import atexit, sys, time
# Registered before xcomm's handler, so it runs after it (atexit is LIFO).
atexit.register(lambda: print(time.monotonic(), flush=True))
import xcomm
from xcomm import compat
compat.EXIT_GRACE_S = 0.5
compat._made_groups = sys.argv[1] == "made"
print(time.monotonic(), flush=True)
"""


def _exit_handler_seconds(made: bool) -> float:
    """The time xcomm's atexit handler took in a fresh interpreter."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_PROBE, "made" if made else "none"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    last_statement, after_handler = (float(v) for v in proc.stdout.split()[-2:])
    return after_handler - last_statement


@pytest.mark.skipif(BACKEND != "xcomm", reason="xcomm's own exit handler")
def test_exit_gives_communication_threads_a_moment_with_the_gil_free() -> None:
    """At exit a Gloo worker may drop the last reference to a Python-owned
    tensor; if Python is finalizing by then, the thread's forced unwind aborts
    the process. xcomm's atexit handler (registered at import) sleeps briefly,
    before finalization, where xcomm made a group, and not otherwise."""
    assert _exit_handler_seconds(made=True) >= 0.5
    assert _exit_handler_seconds(made=False) < 0.2
