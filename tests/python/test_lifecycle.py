"""Aborting and shutting down xcomm groups, as torch.distributed does them.

Reference: gloo's behaviour for the same calls (the group goes away; a new
group over the same ranks works and computes the right sums).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dist_harness import BACKEND, RankContext, run_ranks


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
