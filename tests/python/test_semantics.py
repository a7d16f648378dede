"""Process-group semantics of the backend under test.

Reference used by each test:

* subgroups (``new_group`` with a subset of ranks, ``new_subgroups``,
  ``new_subgroups_by_enumeration``): the same collectives on a gloo group over
  the same ranks (``Checker``), point-to-point inside a subgroup: the math;
* many async ops in flight, waited in reverse order / through futures:
  the math (inputs are small integers, results are exact);
* ``work.wait(timeout=...)`` with a peer that never joins: must raise within
  a bounded time;
* destroy + re-init in the same process, double import / reload: the
  collectives after it give the mathematically expected results;
* failures surface from ``work.wait()`` and ``work.get_future().wait()``
  (a peer that never joins a group with a short timeout), and other groups
  stay usable afterwards.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import (
    BACKEND,
    Checker,
    Mismatches,
    RankContext,
    assert_no_mismatches,
    backend_pg_options,
    free_port,
    make_input,
    run_ranks,
    world_size_params,
)

N = 13
PG = dist.ProcessGroup | None


# --------------------------------------------------------------------------- #
# Subgroups
# --------------------------------------------------------------------------- #


def _subgroup_battery(chk: Checker, members: list[int], label: str) -> None:
    """Collectives on ``chk.group`` (members = sorted global ranks) vs gloo."""
    ctx = chk.ctx
    gsize = len(members)
    grank = members.index(ctx.rank)
    n = gsize

    for dtype in (torch.float32, torch.int64):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):

            def ar(group: PG, async_op: bool, dtype: torch.dtype = dtype, op: Any = op) -> Any:
                t = make_input(ctx, dtype, (N,))
                return dist.all_reduce(t, op=op, group=group, async_op=async_op), [t]

            chk.run(f"{label} all_reduce {dtype} {op}", ar, n_terms=n)

    for src in members:

        def bc(group: PG, async_op: bool, src: int = src) -> Any:
            t = make_input(ctx, torch.float32, (N,))
            return dist.broadcast(t, src=src, group=group, async_op=async_op), [t]

        chk.run(f"{label} broadcast src={src} (global rank)", bc, n_terms=n)

        def bc_g(group: PG, async_op: bool, gsrc: int = members.index(src)) -> Any:
            t = make_input(ctx, torch.int64, (N,))
            return dist.broadcast(t, group=group, async_op=async_op, group_src=gsrc), [t]

        chk.run(
            f"{label} broadcast group_src={members.index(src)}", bc_g, modes=("sync",), n_terms=n
        )

        def red(group: PG, async_op: bool, dst: int = src) -> Any:
            t = make_input(ctx, torch.float32, (N,))
            work = dist.reduce(t, dst=dst, group=group, async_op=async_op)
            return work, [t] if ctx.rank == dst else []

        chk.run(f"{label} reduce dst={src}", red, n_terms=n)

        def gat(group: PG, async_op: bool, dst: int = src) -> Any:
            t = make_input(ctx, torch.int64, (N,))
            gl = (
                [torch.zeros(N, dtype=torch.int64) for _ in range(gsize)]
                if ctx.rank == dst
                else None
            )
            return dist.gather(t, gl, dst=dst, group=group, async_op=async_op), gl or []

        chk.run(f"{label} gather dst={src}", gat, modes=("sync",), n_terms=n)

        def sca(group: PG, async_op: bool, s: int = src) -> Any:
            out = torch.zeros(N)
            sl = (
                [make_input(ctx, torch.float32, (N,), salt=j) for j in range(gsize)]
                if ctx.rank == s
                else None
            )
            return dist.scatter(out, sl, src=s, group=group, async_op=async_op), [out]

        chk.run(f"{label} scatter src={src}", sca, modes=("sync",), n_terms=n)

    def ag(group: PG, async_op: bool) -> Any:
        t = make_input(ctx, torch.float32, (N,))
        out = torch.zeros(gsize * N)
        return dist.all_gather_into_tensor(out, t, group=group, async_op=async_op), [out]

    chk.run(f"{label} all_gather_into_tensor", ag, n_terms=n)

    def ag_list(group: PG, async_op: bool) -> Any:
        t = make_input(ctx, torch.int64, (N,))
        out = [torch.zeros(N, dtype=torch.int64) for _ in range(gsize)]
        return dist.all_gather(out, t, group=group, async_op=async_op), out

    chk.run(f"{label} all_gather", ag_list, modes=("sync",), n_terms=n)

    def rs(group: PG, async_op: bool) -> Any:
        inp = make_input(ctx, torch.float32, (gsize * N,))
        out = torch.zeros(N)
        return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op), [out]

    chk.run(f"{label} reduce_scatter_tensor", rs, n_terms=n)

    def a2a(group: PG, async_op: bool) -> Any:
        ins = [(grank + j) % 3 for j in range(gsize)]
        outs = [(j + grank) % 3 for j in range(gsize)]
        inp = make_input(ctx, torch.int64, (sum(ins),))
        out = torch.zeros(sum(outs), dtype=torch.int64)
        return dist.all_to_all_single(out, inp, outs, ins, group=group, async_op=async_op), [out]

    chk.run(f"{label} all_to_all_single uneven", a2a, n_terms=n)

    with chk.case(f"{label} barrier"):
        dist.barrier(group=chk.group)

    # Point to point inside the subgroup (global ranks), math reference.
    if gsize > 1:
        with chk.case(f"{label} send/recv ring"):
            nxt, prv = members[(grank + 1) % gsize], members[(grank - 1) % gsize]
            payload = make_input(ctx, torch.float32, (N,), salt=21)
            buf = torch.zeros(N)
            works = [
                dist.irecv(buf, src=prv, group=chk.group),
                dist.isend(payload, dst=nxt, group=chk.group),
            ]
            for w in works:
                w.wait()
            chk.compare(
                f"{label} send/recv ring",
                buf,
                make_input(ctx, torch.float32, (N,), salt=21, rank=prv),
            )


def _subsets(ws: int) -> list[list[int]]:
    return {
        2: [[1], [0, 1]],
        3: [[0, 2], [1, 2], [0]],
        4: [[1, 3], [0, 1, 2], [2], [3, 0, 1]],
    }[ws]


def _rank_subgroups(ctx: RankContext) -> list[str]:
    ws = ctx.world_size
    items: list[str] = []
    for subset in _subsets(ws):
        # new_group must be called by every rank, members or not.
        g = dist.new_group(ranks=subset)
        gr = dist.new_group(ranks=subset, backend="gloo")
        members = sorted(subset)
        if ctx.rank in members:
            chk = Checker(ctx, group=g, ref_group=gr)
            _subgroup_battery(chk, members, f"new_group({subset})")
            items += chk.items

    # new_subgroups: equal-sized consecutive groups.
    size = 2 if ws % 2 == 0 else 1
    cur, _ = dist.new_subgroups(group_size=size)
    cur_ref, _ = dist.new_subgroups(group_size=size, backend="gloo")
    members = list(range(ctx.rank - ctx.rank % size, ctx.rank - ctx.rank % size + size))
    chk = Checker(ctx, group=cur, ref_group=cur_ref)
    _subgroup_battery(chk, members, f"new_subgroups(group_size={size})")
    items += chk.items

    if ws == 4:
        layout = [[0, 2], [1, 3]]
        cur, _ = dist.new_subgroups_by_enumeration(layout)
        cur_ref, _ = dist.new_subgroups_by_enumeration(layout, backend="gloo")
        members = next(m for m in layout if ctx.rank in m)
        chk = Checker(ctx, group=cur, ref_group=cur_ref)
        _subgroup_battery(chk, members, f"new_subgroups_by_enumeration({layout})")
        items += chk.items

        # Ops in flight on two overlapping groups at once, waited in reverse.
        m = Mismatches(ctx)
        with m.case("interleaved default/subgroup async ops"):
            a = torch.full((N,), ctx.rank + 1, dtype=torch.int64)
            b = torch.full((N,), 10 * (ctx.rank + 1), dtype=torch.int64)
            wa = dist.all_reduce(a, async_op=True)
            wb = dist.all_reduce(b, group=cur, async_op=True)
            wb.wait()
            wa.wait()
            m.compare("interleaved: default group", a, torch.full((N,), 10, dtype=torch.int64))
            m.compare(
                "interleaved: subgroup",
                b,
                torch.full((N,), 10 * sum(r + 1 for r in members), dtype=torch.int64),
            )
        items += m.items
    return items


@pytest.mark.parametrize("world_size", world_size_params((2, 3, 4)))
def test_subgroups(world_size: int) -> None:
    """Subgroups (new_group subsets, new_subgroups, by_enumeration) match gloo subgroups."""
    assert_no_mismatches(run_ranks(_rank_subgroups, world_size))


# --------------------------------------------------------------------------- #
# Many ops in flight
# --------------------------------------------------------------------------- #


def _rank_many_in_flight(ctx: RankContext, count: int) -> list[str]:
    m = Mismatches(ctx)
    ws = ctx.world_size
    rank_sum = ws * (ws + 1) // 2

    with m.case("100 async all_reduce waited in reverse order"):
        works, tensors, expected = [], [], []
        for i in range(count):
            size = 1 if i % 3 == 0 else (N if i % 3 == 1 else 4099)
            dtype = torch.int64 if i % 2 == 0 else torch.float32
            op = dist.ReduceOp.SUM if i % 4 < 2 else dist.ReduceOp.MAX
            t = torch.full((size,), i * (ctx.rank + 1), dtype=dtype)
            works.append(dist.all_reduce(t, op=op, async_op=True))
            tensors.append(t)
            value = i * rank_sum if op == dist.ReduceOp.SUM else i * ws
            expected.append(torch.full((size,), value, dtype=dtype))
        for w in reversed(works):
            w.wait()
        for i, (t, e) in enumerate(zip(tensors, expected, strict=True)):
            m.compare(f"in-flight all_reduce #{i}", t, e)

    with m.case("100 async mixed collectives completed via collect_all(futures)"):
        works, outs, expected = [], [], []
        for i in range(count):
            kind = i % 3
            if kind == 0:
                t = torch.full((N,), i + ctx.rank, dtype=torch.int64)
                works.append(dist.all_reduce(t, async_op=True))
                expected.append(torch.full((N,), ws * i + ws * (ws - 1) // 2, dtype=torch.int64))
            elif kind == 1:
                t = torch.full((N,), i * 100 + ctx.rank, dtype=torch.int64)
                root = i % ws
                works.append(dist.broadcast(t, src=root, async_op=True))
                expected.append(torch.full((N,), i * 100 + root, dtype=torch.int64))
            else:
                src = torch.full((3,), i * 1000 + ctx.rank, dtype=torch.int64)
                t = torch.zeros(3 * ws, dtype=torch.int64)
                works.append(dist.all_gather_into_tensor(t, src, async_op=True))
                expected.append(torch.arange(ws, dtype=torch.int64).repeat_interleave(3) + i * 1000)
            outs.append(t)
        torch.futures.collect_all([w.get_future() for w in works]).wait()
        for i, (t, e) in enumerate(zip(outs, expected, strict=True)):
            m.compare(f"in-flight mixed #{i}", t, e)
        for i, w in enumerate(works):
            if not w.is_completed():
                m.fail(
                    f"in-flight mixed #{i}", "is_completed() is False after its future completed"
                )
    return m.items


@pytest.mark.parametrize("world_size", world_size_params((2, 4)))
def test_many_async_ops_in_flight(world_size: int) -> None:
    """100 async ops issued back to back, then waited in reverse order / via futures."""
    assert_no_mismatches(run_ranks(_rank_many_in_flight, world_size, 100))


# --------------------------------------------------------------------------- #
# Timeouts and failures surfacing from wait() / get_future()
# --------------------------------------------------------------------------- #


def _rank_wait_timeout(ctx: RankContext, wait_s: float) -> dict[str, Any] | None:
    if ctx.rank != 0:
        # Never joins the collective; stays alive until rank 0 is done.
        ctx.wait_signal("done", 60)
        return None
    t = torch.ones(N)
    work = dist.all_reduce(t, async_op=True)
    t0 = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=wait_s))
        outcome: dict[str, Any] = {"raised": False, "elapsed": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001
        outcome = {
            "raised": True,
            "elapsed": time.monotonic() - t0,
            "type": type(e).__name__,
            "message": str(e),
        }
    ctx.signal("done")
    return outcome


@pytest.mark.slow
def test_wait_timeout_expires() -> None:
    """work.wait(timeout=1s) raises (RuntimeError) within a bounded time when
    rank 1 never joins the collective."""
    wait_s = 1.0
    res = run_ranks(
        _rank_wait_timeout, 2, wait_s, pg_timeout=datetime.timedelta(seconds=6), timeout=60
    )[0]
    assert res is not None
    assert res["raised"], (
        f"wait(timeout={wait_s}s) returned after {res['elapsed']:.2f}s without raising"
    )
    assert 0.5 * wait_s <= res["elapsed"] < wait_s + 5, f"raised after {res['elapsed']:.2f}s"
    assert res["type"] in ("RuntimeError", "DistBackendError", "DistError", "TimeoutError"), res


def _rank_async_errors(ctx: RankContext, group_timeout_s: float) -> dict[str, Any]:
    tmo = datetime.timedelta(seconds=group_timeout_s)
    opts = backend_pg_options(tmo, ctx.backend)
    g1 = dist.new_group(timeout=tmo, pg_options=opts)
    g2 = dist.new_group(timeout=tmo, pg_options=opts)
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        for name, group, how in (("wait", g1, "wait"), ("future", g2, "future")):
            t = torch.ones(N)
            t0 = time.monotonic()
            try:
                work = dist.all_reduce(t, group=group, async_op=True)
            except Exception as e:  # noqa: BLE001
                out[name] = {
                    "raised_at": "call",
                    "message": str(e),
                    "elapsed": time.monotonic() - t0,
                }
                continue
            try:
                if how == "wait":
                    work.wait()
                else:
                    work.get_future().wait()
                out[name] = {"raised_at": None, "elapsed": time.monotonic() - t0}
            except Exception as e:  # noqa: BLE001
                out[name] = {
                    "raised_at": how,
                    "type": type(e).__name__,
                    "message": str(e),
                    "elapsed": time.monotonic() - t0,
                }
        ctx.signal("failed_ops_done")
    else:
        ctx.wait_signal("failed_ops_done", 60)
    # The default group must still work after failures on other groups.
    t = torch.full((N,), ctx.rank + 1.0)
    dist.all_reduce(t)
    out["default_group_after"] = t[0].item()
    return out


@pytest.mark.slow
def test_errors_surface_from_wait_and_future() -> None:
    """A collective that fails (peer never joins a group with a 2 s timeout)
    raises from work.wait() and from work.get_future().wait(); other groups
    remain usable."""
    res = run_ranks(_rank_async_errors, 2, 2.0, timeout=60)
    r0 = res[0]
    for name in ("wait", "future"):
        info = r0[name]
        assert info["raised_at"] == name, f"expected the failure to surface from {name}(): {info}"
        assert info["elapsed"] < 15, (
            f"{name}: took {info['elapsed']:.1f}s to fail with a 2s timeout"
        )
    for r, out in enumerate(res):
        assert out["default_group_after"] == 3.0, f"rank {r}: default group result {out}"


# --------------------------------------------------------------------------- #
# Re-initialisation and imports
# --------------------------------------------------------------------------- #


def _check_group_works(m: Mismatches, label: str) -> None:
    ctx = m.ctx
    ws = dist.get_world_size()
    t = torch.full((N,), ctx.rank + 1, dtype=torch.int64)
    dist.all_reduce(t)
    m.compare(f"{label}: all_reduce", t, torch.full((N,), ws * (ws + 1) // 2, dtype=torch.int64))
    b = torch.full((N,), ctx.rank, dtype=torch.float32)
    dist.broadcast(b, src=ws - 1)
    m.compare(f"{label}: broadcast", b, torch.full((N,), ws - 1.0))
    sub = dist.new_group(ranks=[0])
    if ctx.rank == 0:
        s = torch.ones(3)
        dist.all_reduce(s, group=sub)
        m.compare(f"{label}: singleton subgroup", s, torch.ones(3))
    dist.barrier()


def _rank_reinit(ctx: RankContext, port: int) -> list[str]:
    m = Mismatches(ctx)
    ws, backend = ctx.world_size, ctx.backend
    _check_group_works(m, "first init")
    dist.destroy_process_group()
    if dist.is_initialized():
        m.fail("destroy", "dist.is_initialized() still True after destroy_process_group()")

    inits: list[tuple[str, dict[str, Any]]] = [
        ("file://", {"init_method": "file://" + ctx.fresh_store_path("second")}),
        ("tcp://", {"init_method": f"tcp://127.0.0.1:{port}"}),
        ("store=FileStore", {"store": dist.FileStore(ctx.fresh_store_path("fourth"), ws)}),
    ]
    for name, kwargs in inits:
        label = f"re-init via {name}"
        with m.case(label):
            dist.init_process_group(backend=backend, rank=ctx.rank, world_size=ws, **kwargs)
            if dist.get_backend() != backend:
                m.fail(label, f"get_backend() is {dist.get_backend()!r}")
            _check_group_works(m, label)
            dist.destroy_process_group()
    return m.items


@pytest.mark.parametrize("world_size", world_size_params((2, 3)))
def test_destroy_and_reinit(world_size: int) -> None:
    """destroy_process_group, then init_process_group again (3 more times,
    file://, tcp://, store=) in the same processes; collectives still correct."""
    assert_no_mismatches(run_ranks(_rank_reinit, world_size, free_port()))


def _rank_import_twice(ctx: RankContext) -> list[str]:
    import dataclasses
    import importlib

    import xcomm

    m = Mismatches(ctx)
    import xcomm as again

    if again is not xcomm:
        m.fail("import twice", "second import returned a different module")
    with m.case("importlib.reload(xcomm)"):
        importlib.reload(xcomm)
    with m.case("importlib.reload(xcomm) again"):
        importlib.reload(xcomm)
    if "xcomm" not in dist.Backend.backend_list:
        m.fail(
            "registration", f"'xcomm' not in dist.Backend.backend_list: {dist.Backend.backend_list}"
        )
    with m.case("xcomm.Options"):
        if not dataclasses.is_dataclass(xcomm.Options):
            m.fail("xcomm.Options", "is not a dataclass")
        if xcomm.Options().timeout is not None:
            m.fail(
                "xcomm.Options", f"default timeout is {xcomm.Options().timeout!r}, expected None"
            )
    with m.case("init after reload"):
        dist.init_process_group(
            backend="xcomm",
            init_method="file://" + ctx.fresh_store_path("after_reload"),
            rank=ctx.rank,
            world_size=ctx.world_size,
            pg_options=xcomm.Options(timeout=datetime.timedelta(seconds=30)),
        )
        _check_group_works(m, "after import twice + reload")
        dist.destroy_process_group()
    return m.items


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "xcomm", reason="tests the xcomm package itself")
def test_import_twice_and_reload() -> None:
    """`import xcomm` twice and importlib.reload(xcomm) in a fresh interpreter
    do not fail, and the backend still works afterwards."""
    assert_no_mismatches(run_ranks(_rank_import_twice, 2, init=False, launcher="subprocess"))


def _rank_options_timeout(ctx: RankContext) -> dict[str, Any] | None:
    import xcomm

    g = dist.new_group(
        timeout=datetime.timedelta(minutes=10),
        pg_options=xcomm.Options(timeout=datetime.timedelta(seconds=2)),
    )
    if ctx.rank != 0:
        ctx.wait_signal("done", 60)  # never joins the collective on g
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(N), group=g)
        out: dict[str, Any] = {"raised": False}
    except Exception as e:  # noqa: BLE001
        out = {"raised": True, "error": f"{type(e).__name__}: {e}"}
    out["elapsed"] = time.monotonic() - t0
    ctx.signal("done")
    return out


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "xcomm", reason="xcomm.Options")
def test_options_timeout_wins_over_group_timeout() -> None:
    """xcomm.Options(timeout=2s) takes precedence over new_group(timeout=10min):
    a collective whose peer never joins fails after about 2 s."""
    res = run_ranks(_rank_options_timeout, 2, timeout=60)[0]
    assert res is not None and res["raised"], f"did not raise: {res}"
    assert res["elapsed"] < 15, f"raised only after {res['elapsed']:.1f}s: {res}"
