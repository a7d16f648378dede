"""DTensor and tensor parallelism on a CPU DeviceMesh, on xcomm and on gloo.

* ``distribute_tensor`` and ``redistribute`` through Shard(0) -> Replicate ->
  Shard(1) -> Shard(0), and a Partial DTensor (``from_local``; redistributing
  *to* Partial is internal-only in torch) -> Replicate (all-reduce) and ->
  Shard(0) (reduce-scatter); sharded matmul and sum;
* ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on a
  two-layer MLP, a few SGD steps;
* functional collectives (``torch.distributed._functional_collectives``)
  eagerly and under ``torch.compile`` (``aot_eager``: traced through dynamo
  and AOTAutograd without needing a C++ compiler).

Two ranks: results must be bitwise equal to gloo's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from client_common import assert_same, run_both
from torch import nn

from dist_harness import RankContext


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _redistribute(ctx: RankContext) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = _mesh()
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))
    out: dict[str, Any] = {}
    d = distribute_tensor(full, mesh, [Shard(0)])
    out["shard0_local"] = d.to_local().clone()
    r = d.redistribute(mesh, [Replicate()])
    out["replicate"] = r.to_local().clone()
    s1 = r.redistribute(mesh, [Shard(1)])
    out["shard1_local"] = s1.to_local().clone()
    out["s1_to_s0"] = s1.redistribute(mesh, [Shard(0)]).to_local().clone()

    # A genuinely partial tensor: each rank holds its own summand.
    local = torch.randn(4, 3, generator=torch.Generator().manual_seed(100 + ctx.rank))
    part = DTensor.from_local(local, mesh, [Partial()])
    out["sum_replicate"] = part.redistribute(mesh, [Replicate()]).to_local().clone()
    out["sum_shard0"] = part.redistribute(mesh, [Shard(0)]).to_local().clone()
    out["full_tensor"] = s1.full_tensor().clone()
    # DTensor ops that communicate: matmul of sharded operands, a sum
    a = distribute_tensor(full, mesh, [Shard(1)])
    b = distribute_tensor(full.t().contiguous(), mesh, [Shard(0)])
    out["matmul"] = (a @ b).full_tensor().clone()
    out["sum"] = d.sum().full_tensor().clone()
    return out


@pytest.mark.client
def test_dtensor_redistribute_matches_gloo() -> None:
    res = run_both(_redistribute)
    assert_same(res)
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))
    r0 = res["xcomm"][0]
    assert torch.equal(r0["replicate"], full)
    assert torch.equal(r0["full_tensor"], full)
    summands = [torch.randn(4, 3, generator=torch.Generator().manual_seed(100 + r)) for r in (0, 1)]
    assert torch.equal(r0["sum_replicate"], summands[0] + summands[1])
    torch.testing.assert_close(r0["matmul"], full @ full.t())


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _tensor_parallel(ctx: RankContext) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = _mesh()
    model = parallelize_module(_MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs, losses = [], []
    for step in range(4):
        # TP: every rank sees the same input batch
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        opt.step()
        outs.append(out.detach().clone())
        losses.append(loss.item())
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"outs": outs, "losses": losses, "params": params}


@pytest.mark.client
def test_tensor_parallel_colwise_rowwise_matches_gloo() -> None:
    res = run_both(_tensor_parallel)
    assert_same(res)
    # and equals the same training without parallelism
    ref = _MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(res["xcomm"][0]["params"][name], p.detach())


def _funcols(t: torch.Tensor, group: Any) -> tuple[torch.Tensor, ...]:
    import torch.distributed._functional_collectives as funcol

    s = funcol.all_reduce(t, "sum", group)
    m = funcol.all_reduce(t * 2, "max", group)
    g = funcol.all_gather_tensor(t, 0, group)
    rs = funcol.reduce_scatter_tensor(t, "sum", 0, group)
    return s + 1, m, g, rs


def _functional(ctx: RankContext, compiled: bool) -> dict[str, Any]:
    mesh = _mesh()
    t = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (ctx.rank + 1) + 0.25
    out: dict[str, Any] = {}
    for label, group in (("world", dist.group.WORLD), ("mesh", mesh)):
        fn = _funcols
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(_funcols, backend="aot_eager", fullgraph=True)
        res = fn(t, group)
        out[label] = [r.clone() for r in res]
    return out


@pytest.mark.client
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_functional_collectives_match_gloo(compiled: bool) -> None:
    res = run_both(_functional, compiled, timeout=120)
    assert_same(res)
    t0 = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 0.25
    t1 = torch.arange(8, dtype=torch.float32).reshape(4, 2) * 2 + 0.25
    s, m, g, rs = res["xcomm"][1]["world"]
    assert torch.equal(s, t0 + t1 + 1)
    assert torch.equal(m, torch.maximum(t0, t1) * 2)
    assert torch.equal(g, torch.cat([t0, t1]))
    assert torch.equal(rs, (t0 + t1)[2:])
