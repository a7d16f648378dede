"""Backend-level fusion of small allreduces (``xcomm.Options(fusion_threshold_bytes=...)``).

Reference: the same ops on the gloo reference group. The fused transfers are
counted in ``xcomm.stats()["ALLREDUCE_FUSED"]``; the test drives a sequence
whose flush points are known in advance and checks the count.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import xcomm
from dist_harness import RankContext, run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

THRESHOLD = 4096


def _fused_group() -> dist.ProcessGroup:
    return dist.new_group(
        backend="xcomm", pg_options=xcomm.Options(fusion_threshold_bytes=THRESHOLD)
    )


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
        dist.all_reduce(t, op=op, group=group, async_op=True)
        for t, (_, op) in zip(mine, plan)
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
    for r in run_ranks(_rank_burst, 2):
        assert all(r["equal"]), r["equal"]
        assert r["broadcast_ok"] and r["sync_ok"] and r["chain_ok"]
        assert r["fused_calls"] == 6  # 13 small ops in 6 transfers
        assert r["unfused_calls"] == 1  # the 8000-byte one


def _rank_ddp(ctx: RankContext) -> bool:
    # DDP takes each bucket's future at once: fusion must never hold it back.
    group = _fused_group()
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


def test_ddp_over_a_fusing_group_identical_to_gloo() -> None:
    assert all(run_ranks(_rank_ddp, 2))


def test_fusion_threshold_option_is_checked() -> None:
    with pytest.raises(ValueError, match="fusion_threshold_bytes must be >= 0"):
        xcomm.Options(fusion_threshold_bytes=-1)
    with pytest.raises(TypeError, match="fusion_threshold_bytes must be an int"):
        xcomm.Options(fusion_threshold_bytes=True)
