"""FSDP2 (``fully_shard``), FSDP1 (``FullyShardedDataParallel``) and
``torch.distributed.checkpoint`` on CPU, on xcomm and on gloo.

Each client trains a small MLP a few SGD steps with a fixed seed and
per-rank data, then returns the full (unsharded) parameters, the losses and
the local shards. Two ranks: every reduction is a sum of two floats (or
their average), which does not depend on summation order, so xcomm's results
must be bitwise equal to gloo's.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from client_common import assert_same, run_both
from torch import nn

from dist_harness import RankContext

STEPS = 4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _train(model: nn.Module, rank: int, steps: range) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in steps:
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_like_local_training(params: dict[str, torch.Tensor]) -> None:
    """Data-parallel SGD over 2 ranks = local SGD on both ranks' batches at once."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        (x0, y0), (x1, y1) = _batch(0, step), _batch(1, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
        opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)


def _fsdp2_model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().clone()
    return out


def _fsdp2(ctx: RankContext) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    model = _fsdp2_model()
    losses = _train(model, ctx.rank, range(STEPS))
    shards = {
        n: p.to_local().detach().clone()
        for n, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    return {"losses": losses, "params": _full_params(model), "shards": shards}


@pytest.mark.client
def test_fsdp2_fully_shard_matches_gloo() -> None:
    res = run_both(_fsdp2)
    assert_same(res)
    # FSDP2 really sharded (dim-0 halves) and ranks agree on the full parameters
    r0, r1 = res["xcomm"]
    assert r0["shards"]["0.weight"].shape == (16, 16)
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    _assert_like_local_training(r0["params"])


def _fsdp1(ctx: RankContext) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_mlp(), device_id=torch.device("cpu"), use_orig_params=True)
    losses = _train(model, ctx.rank, range(STEPS))
    with FSDP.summon_full_params(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


@pytest.mark.client
def test_fsdp1_matches_gloo() -> None:
    res = run_both(_fsdp1)
    assert_same(res)
    r0, r1 = res["xcomm"]
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    _assert_like_local_training(r0["params"])


def _dcp(ctx: RankContext) -> dict[str, Any]:
    """Train, save the sharded state dict (model + optimizer) with DCP, train
    on; then a fresh model loads the checkpoint and trains the same steps: its
    parameters must equal the uninterrupted run's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ckpt = os.path.join(ctx.tmpdir, "ckpt")
    model = _fsdp2_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def steps(m: nn.Module, o: torch.optim.Optimizer, rng: range) -> None:
        for step in rng:
            x, y = _batch(ctx.rank, step)
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()

    steps(model, opt, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    saved = _full_params(model)
    steps(model, opt, range(2, 4))
    uninterrupted = _full_params(model)

    torch.manual_seed(123)  # the fresh model starts elsewhere
    model2 = _fsdp2_model()
    for p in model2.parameters():
        with torch.no_grad():
            p.add_(1.0)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    steps(model2, opt2, range(1))  # creates momentum buffers to be overwritten
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_params(model2)
    steps(model2, opt2, range(2, 4))
    resumed = _full_params(model2)
    files = sorted(os.listdir(ckpt)) if ctx.rank == 0 else []
    dist.barrier()
    return {
        "saved": saved,
        "loaded": loaded,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "files": files,
    }


@pytest.mark.client
def test_dcp_save_load_sharded_state_matches_gloo() -> None:
    res = run_both(_dcp)
    assert_same(res)
    for r in res["xcomm"]:
        for name in r["saved"]:
            assert torch.equal(r["loaded"][name], r["saved"][name]), name
            assert torch.equal(r["resumed"][name], r["uninterrupted"][name]), name
    assert ".metadata" in res["xcomm"][0]["files"]
