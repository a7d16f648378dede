"""DistributedDataParallel over the backend under test vs DDP over gloo.

In the same rank processes, two copies of a model (identical initial state,
deliberately different on every rank so DDP's initial broadcast from rank 0
matters) are wrapped in DDP: one over the default group (backend under
test), one over the gloo reference group (``process_group=ctx.ref``).  Both
train 20 steps of SGD on the same per-rank data, with

* the default reduction (DDP's built-in allreduce),
* ``default_hooks.allreduce_hook``,
* ``default_hooks.fp16_compress_hook``,
* ``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=1,
  start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)``
  (torch seeded identically before each state is built),

on an MLP and on a tiny conv net with BatchNorm (buffers broadcast), using a
small ``bucket_cap_mb`` so gradients span several buckets (PowerSGD: one
bucket, see ``_train``).

Reference: the gloo DDP run.  World size 2: parameters must be IDENTICAL
(``torch.equal``; a sum of two floats is order-independent).  World size 3:
summation order may legitimately differ from gloo's ring, so a tight
float32 tolerance is used (stated in the failure message).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import small_mlp
from dist_harness import Mismatches, RankContext, assert_no_mismatches, run_ranks, world_size_params

STEPS = 20
#: World size 3 tolerance (summation order of 3 float32 gradients may differ).
WS3_RTOL, WS3_ATOL = 1e-4, 1e-5
#: fp16_compress_hook sums float16 values: at 3 ranks the shared-memory path
#: adds them in float32 and rounds once where Gloo rounds after every add, so
#: the gradients differ by float16 roundings (2**-11 relative) and, after 20
#: SGD steps, the parameters by a few 1e-3 at most.
WS3_TOL_BY_HOOK = {"fp16_compress_hook": (5e-3, 5e-3)}
HOOKS = ("default", "allreduce_hook", "fp16_compress_hook", "powerSGD_hook")


def _convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, 4),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (small_mlp, (8, 12)),
    "convnet": (_convnet, (4, 2, 9, 9)),
}


def _batch(rank: int, step: int, input_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(input_shape, generator=g)
    y = torch.randn(input_shape[0], 4, generator=g)
    return x, y


def _register_hook(model: DDP, hook: str, group: dist.ProcessGroup | None) -> None:
    if hook == "default":
        return
    if hook == "allreduce_hook":
        model.register_comm_hook(group, default_hooks.allreduce_hook)
    elif hook == "fp16_compress_hook":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powerSGD_hook":
        torch.manual_seed(1234)  # identical state for both runs
        state = powersgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=1,
            start_powerSGD_iter=2,
            use_error_feedback=True,
            warm_start=True,
        )
        model.register_comm_hook(state, powersgd.powerSGD_hook)
    else:
        raise ValueError(hook)


def _train(
    ctx: RankContext,
    base: nn.Module,
    input_shape: tuple[int, ...],
    hook: str,
    group: dist.ProcessGroup | None,
) -> tuple[list[torch.Tensor], list[float]]:
    # Several small buckets, except for PowerSGD: its hook chains collectives
    # through future callbacks, whose order across concurrently reduced
    # buckets is not deterministic across ranks (a collective mismatch, even
    # on gloo alone at world size 3), so it gets one bucket.
    bucket_cap_mb = 25.0 if hook == "powerSGD_hook" else 0.002
    model = DDP(copy.deepcopy(base), process_group=group, bucket_cap_mb=bucket_cap_mb)
    _register_hook(model, hook, group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _batch(ctx.rank, step, input_shape)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = [p.detach().clone() for p in model.module.parameters()]
    state += [b.detach().clone() for b in model.module.buffers()]
    return state, losses


def _rank_ddp(ctx: RankContext, hook: str, exact: bool) -> dict[str, Any]:
    m = Mismatches(ctx)
    summaries: dict[str, Any] = {}
    for model_name, (build, input_shape) in MODELS.items():
        torch.manual_seed(100 + ctx.rank)  # different init per rank: DDP must broadcast rank 0's
        base = build()
        label = f"DDP {model_name} hook={hook}"
        with m.case(label):
            got, got_losses = _train(ctx, base, input_shape, hook, None)
            ref, _ = _train(ctx, base, input_shape, hook, ctx.ref)
            if len(got) != len(ref):
                m.fail(label, f"{len(got)} tensors vs {len(ref)}")
            for i, (a, b) in enumerate(zip(got, ref, strict=True)):
                if exact:
                    if not torch.equal(a, b):
                        diff = (a.double() - b.double()).abs().max().item()
                        m.fail(
                            label,
                            f"tensor {i} {tuple(a.shape)} not identical to gloo's "
                            f"(max |diff| {diff:.3g})",
                        )
                else:
                    rtol, atol = WS3_TOL_BY_HOOK.get(hook, (WS3_RTOL, WS3_ATOL))
                    try:
                        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
                    except AssertionError as e:
                        m.fail(
                            label, f"tensor {i} {tuple(a.shape)} (rtol={rtol}, atol={atol}): {e}"
                        )
            summaries[model_name] = {
                "losses": got_losses,
                "params": got,
                "n_params": len(list(base.parameters())),
            }
    # The parameters (not the BatchNorm running stats, which are updated
    # locally by the last forward) must also agree across ranks.
    for model_name, info in summaries.items():
        with m.case(f"{model_name} cross-rank consistency"):
            for i, p in enumerate(info["params"][: info["n_params"]]):
                p0 = p.clone()
                dist.broadcast(p0, src=0, group=ctx.ref)
                if not torch.equal(p, p0):
                    m.fail(
                        f"{model_name} hook={hook}",
                        f"tensor {i} differs from rank 0's after training",
                    )
    return {"mismatches": m.items, "losses": {k: v["losses"] for k, v in summaries.items()}}


def _check(results: list[dict[str, Any]]) -> None:
    assert_no_mismatches([r["mismatches"] for r in results])
    for r in results:
        for name, losses in r["losses"].items():
            assert all(torch.isfinite(torch.tensor(losses))), f"{name}: non-finite loss {losses}"


@pytest.mark.slow
@pytest.mark.parametrize("hook", HOOKS)
def test_ddp_identical_to_gloo_ws2(hook: str) -> None:
    """World size 2: DDP parameters after 20 steps are bitwise equal to gloo's."""
    _check(run_ranks(_rank_ddp, 2, hook, True, timeout=120))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", world_size_params((3,)))
@pytest.mark.parametrize("hook", HOOKS)
def test_ddp_close_to_gloo_ws3(hook: str, world_size: int) -> None:
    """World size 3: equal to gloo's within float32 summation-order tolerance."""
    _check(run_ranks(_rank_ddp, world_size, hook, False, timeout=120))
