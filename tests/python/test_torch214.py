"""torch 2.14's own ways into a backend: the canonical ``_single`` names and
registration through the ``torch.distributed.backends`` entry point.

torch 2.14 renamed the single-tensor collectives: ``Backend`` declares
``all_gather_single``, ``all_gather_single_coalesced``, ``reduce_scatter_single``,
``reduce_scatter_single_coalesced``, ``all_to_all_single`` and ``gather_single``,
each forwarding to the older name that xcomm overrides (``_allgather_base``
and so on; the older names exist on every torch xcomm supports). These tests
call the new names every way a program can (the ``dist.*`` functions,
``_coalescing_manager``'s fast path, and the backend object itself) on xcomm
groups with and without shared memory, and compare with the same calls on gloo.

torch 2.14 also loads a backend named in ``init_process_group`` from its
entry point when nothing imported it: a fresh interpreter that never imports
``xcomm`` must get a working xcomm group.

Below 2.14 these names and the entry point do not exist: the tests skip there
(``scripts/test.sh`` runs the suite on 2.13 and on 2.14.1).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dist_harness import RankContext, run_ranks, tolerances

TORCH_MINOR = tuple(int(x) for x in torch.__version__.split(".")[:2])
# every_case: what each case checks is torch 2.14's own (scripts/test.sh).
pytestmark = [
    pytest.mark.skipif(
        TORCH_MINOR < (2, 14), reason=f"torch {torch.__version__} predates the 2.14 names"
    ),
    pytest.mark.every_case,
]


def _calls(ctx: RankContext, group: dist.ProcessGroup) -> dict[str, Any]:
    """Every canonical-name call on ``group``; returns what each produced."""
    r, n = ctx.rank, ctx.world_size
    g = ctx.generator(salt=214)
    out: dict[str, Any] = {}

    inp = torch.randn(5, 3, generator=g)
    gathered = torch.empty(n * 5, 3)
    dist.all_gather_single(gathered, inp, group=group)
    out["all_gather_single"] = gathered

    ints = torch.randint(-50, 50, (n * 4,), generator=g, dtype=torch.int64)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        shard = torch.empty(4, dtype=torch.int64)
        dist.reduce_scatter_single(shard, ints.clone(), op=op, group=group)
        out[f"reduce_scatter_single/{op}"] = shard

    # _coalescing_manager's fast path calls group.all_gather_single_coalesced
    # and group.reduce_scatter_single_coalesced.
    # One dtype per call: gloo returns garbage for mixed dtypes here (it
    # gathers the bytes as the first tensor's type); xcomm raises a TypeError.
    ag_outs = [torch.empty(n * 3), torch.empty(n * 2, 2)]
    ag_ins = [torch.randn(3, generator=g), torch.randn(2, 2, generator=g)]
    with dist._coalescing_manager(group=group):
        for o, i in zip(ag_outs, ag_ins):
            dist.all_gather_single(o, i, group=group)
    out["all_gather_single_coalesced"] = ag_outs

    rs_ins = [torch.randn(n * 3, generator=g), torch.randn(n * 6, generator=g)]
    rs_outs = [torch.empty(3), torch.empty(6)]
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        for o, i in zip(rs_outs, rs_ins):
            dist.reduce_scatter_single(o, i, group=group)
    cm.wait()
    out["reduce_scatter_single_coalesced"] = rs_outs

    # Uneven all_to_all_single: rank r sends r + 1 + j elements to rank j.
    send_splits = [r + 1 + j for j in range(n)]
    recv_splits = [j + 1 + r for j in range(n)]
    send = torch.arange(sum(send_splits), dtype=torch.float32) + 100 * r
    recv = torch.empty(sum(recv_splits))
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
    work.wait()
    out["all_to_all_single"] = recv

    # The backend object's own canonical methods, as a program holding the
    # backend (FSDP, torchcomms-style code) calls them.
    backend = group._get_backend(torch.device("cpu"))
    direct_in = torch.full((2,), float(r + 1))
    direct_out = torch.empty(n * 2)
    backend.all_gather_single(direct_out, direct_in, c10d.AllgatherOptions()).wait()
    out["backend.all_gather_single"] = direct_out
    rs_opts = c10d.ReduceScatterOptions()
    rs_opts.reduceOp = dist.ReduceOp.SUM
    direct_shard = torch.empty(2)
    backend.reduce_scatter_single(direct_shard, torch.arange(n * 2.0) * (r + 1), rs_opts).wait()
    out["backend.reduce_scatter_single"] = direct_shard
    return out


def _rank_canonical_names(ctx: RankContext, shm: bool) -> dict[str, Any]:
    import xcomm

    assert ctx.ref is not None
    group = dist.new_group(backend="xcomm", pg_options=xcomm.Options(shm=shm))
    shape = xcomm.group_plan(group)["shape"]
    return {"mine": _calls(ctx, group), "ref": _calls(ctx, ctx.ref), "shape": shape}


def _rank_gather_single(ctx: RankContext, shm: bool) -> dict[str, Any]:
    import xcomm

    assert ctx.ref is not None
    group = dist.new_group(backend="xcomm", pg_options=xcomm.Options(shm=shm))
    out: dict[str, Any] = {}
    n, dst = ctx.world_size, ctx.world_size - 1
    inp = torch.arange(6, dtype=torch.float64).view(2, 3) + 10 * ctx.rank
    stacked = torch.full((n, 2, 3), -1.0, dtype=torch.float64) if ctx.rank == dst else None
    work = dist.gather_single(inp, stacked, dst=dst, group=group, async_op=True)
    work.wait()
    out["stacked"] = stacked
    flat = torch.empty(n * 6, dtype=torch.float64) if ctx.rank == 0 else None
    dist.gather_single(inp, flat, dst=0, group=group)
    out["flat"] = flat
    # A wrong-sized output is a ValueError before anything is sent. Only the
    # destination can see it, so try it on a group of one rank (the others
    # would otherwise wait for that rank until the timeout).
    alone = dist.new_group(ranks=[0], backend="xcomm", pg_options=xcomm.Options(shm=shm))
    if ctx.rank == 0:
        try:
            dist.gather_single(inp, torch.empty(5, dtype=torch.float64), dst=0, group=alone)
            out["bad_size"] = None
        except ValueError as e:
            out["bad_size"] = str(e)
    try:  # gloo has no gather_single at all
        dist.gather_single(inp, flat, dst=0, group=ctx.ref)
        out["gloo"] = "ran"
    except RuntimeError as e:
        out["gloo"] = str(e)
    return out


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "no-shm"])
def test_gather_single_gathers_rows_in_rank_order(shm: bool) -> None:
    n = 3
    res = run_ranks(_rank_gather_single, n, shm=shm)
    expected = torch.stack(
        [torch.arange(6, dtype=torch.float64).view(2, 3) + 10 * r for r in range(n)]
    )
    assert torch.equal(res[n - 1]["stacked"], expected)
    assert torch.equal(res[0]["flat"], expected.flatten())
    assert all(r["stacked"] is None for r in res[:-1]) and all(r["flat"] is None for r in res[1:])
    assert "gather_single" in res[0]["bad_size"] and "must hold 1 x 6" in res[0]["bad_size"], res[0]
    assert "does not support gather_single" in res[0]["gloo"], res[0]


def _assert_same(mine: Any, ref: Any, where: str) -> None:
    if isinstance(ref, list):
        assert len(mine) == len(ref), where
        for i, (m, r) in enumerate(zip(mine, ref)):
            _assert_same(m, r, f"{where}[{i}]")
        return
    assert mine.dtype == ref.dtype and mine.shape == ref.shape, where
    if mine.is_floating_point():
        # Sums of up to three addends, added in another order than gloo's.
        rtol, atol = tolerances(mine.dtype, n_terms=3)
        torch.testing.assert_close(mine, ref, rtol=rtol, atol=atol, msg=where)
    else:
        assert torch.equal(mine, ref), f"{where}: {mine} != {ref}"


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "no-shm"])
# No large_world mark: scripts/test.sh leaves those cases to the first torch, and
# this file runs on torch 2.14+ only.
@pytest.mark.parametrize("world_size", [2, 3])
def test_canonical_names_match_gloo(world_size: int, shm: bool) -> None:
    results = run_ranks(_rank_canonical_names, world_size, shm=shm)
    for rank, res in enumerate(results):
        assert set(res["mine"]) == set(res["ref"])
        for name, ref in res["ref"].items():
            _assert_same(res["mine"][name], ref, f"rank {rank}, {name}")
    # The two parametrisations really are different transports.
    assert results[0]["shape"] == ("single-host shared memory" if shm else "plain"), results[0][
        "shape"
    ]


def _rank_entry_point(ctx: RankContext) -> dict[str, Any]:
    before = "xcomm" in sys.modules
    dist.init_process_group(
        "xcomm",
        init_method="file://" + ctx.fresh_store_path("entry"),
        rank=ctx.rank,
        world_size=ctx.world_size,
    )
    t = torch.arange(4.0) * (ctx.rank + 1)
    dist.all_reduce(t)
    sub = dist.new_group(backend="xcomm")
    s = torch.tensor([ctx.rank + 1])
    dist.all_reduce(s, group=sub)
    return {
        "imported_before": before,
        "imported_after": "xcomm" in sys.modules,
        "backend": dist.get_backend(),
        "backend_type": type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__,
        "sum": t.tolist(),
        "sub": s.item(),
    }


def test_entry_point_registers_xcomm_without_import() -> None:
    # A fresh interpreter per rank (subprocess launcher; the harness imports
    # xcomm only when asked to run it as the default backend, here it is not).
    res = run_ranks(_rank_entry_point, 2, init=False, backend="gloo", launcher="subprocess")
    n = 2
    for r in res:
        assert r["imported_before"] is False, "the test process imported xcomm before init"
        assert r["imported_after"] is True
        assert r["backend"] == "xcomm"
        assert r["backend_type"] == "XcommBackend", r
        assert r["sum"] == [float(i * n * (n + 1) // 2) for i in range(4)]
        assert r["sub"] == n * (n + 1) // 2
