"""MIN and MAX of floating tensors give one answer on every route
(csrc/backend/MinMaxLowering): NaN wherever any rank has one, as
``torch.minimum``/``torch.maximum`` give, and -0 against +0 by the op (MIN
gives -0, MAX +0), as IEEE 754-2019's minimum/maximum.

Before, xcomm's own kernels (shared memory, carried small ops, its
reduce-scatter) propagated NaN while the ops it handed to Gloo (large ops
without shared memory, ``reduce``) kept the first rank's operand
(``std::min``), so one group answered the same MIN differently by op and by
size. The reference here is torch's own ops folded in rank order, not gloo:
gloo's answer is the order-dependent one this replaces. ``torch.minimum``
returns its first operand for opposite zeros, an answer no reduction in
another order can give, so there the reference takes the IEEE one.

The ops run on integer keys, and the ranks' agreement still sees the
caller's dtype: a float32 MIN on one rank against an int32 MIN of the same
size on another raises the mismatch error naming ``Float``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import xcomm
from dist_harness import RankContext, error_of, run_ranks

pytestmark = pytest.mark.xcomm_specific

ROUTES: dict[str, dict[str, Any]] = {
    "shm": {},
    "plain-checked": {"shm": False},
    "plain-not-carried": {"shm": False, "carry_small_ops": False},
    "plain-unchecked": {"shm": False, "check_collectives": False},
    "fused": {"shm": False, "fusion_threshold_bytes": 1 << 16},
}
# Divisible by 2 and 3 ranks (reduce-scatter). Small: carried, shared
# memory's one-barrier path, fused; large: past the carry limit (128 KiB) and
# shared memory's small path (256 KiB), so Gloo's and the chunked kernels run.
SIZES = {"small": 24, "large": 3 << 16}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
OPS = {"MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX}


def _input(rank: int, world: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Values with NaNs, infinities and signed zeros placed per rank, so
    that which rank holds the special value decides a first-operand answer."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    slot = torch.arange(numel) % 16
    last = rank == world - 1
    for r in range(world):  # NaN on rank r only, for every r
        if rank == r:
            x[slot == r] = float("nan")
    x[slot == 8] = -0.0 if rank == 0 else 0.0
    x[slot == 9] = 0.0 if rank == 0 else -0.0 if last else 0.0
    x[slot == 10] = float("inf") if rank == 0 else float("-inf")
    x[slot == 11] = -0.0  # -0 on every rank
    x[slot == 12] = float("nan")  # NaN on every rank
    x[slot == 13] = float("-inf") if last else 1.0
    if last:
        x[slot == 14] = -float("nan")  # a NaN with its sign bit set
    return x.to(dtype)


def _expected(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """torch.minimum/maximum folded in rank order; opposite zeros by the op."""
    fold = torch.minimum if op == "MIN" else torch.maximum
    want = inputs[0].double()
    for t in inputs[1:]:
        want = fold(want, t.double())
    stack = torch.stack([t.double() for t in inputs])
    sign = torch.signbit(stack)
    if op == "MIN":
        want[(want == 0) & ((stack == 0) & sign).any(0)] = -0.0
    else:
        want[(want == 0) & ((stack == 0) & ~sign).any(0)] = 0.0
    return want.to(inputs[0].dtype)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    nan = torch.isnan(want)
    return (
        torch.equal(torch.isnan(got), nan)
        and torch.equal(got[~nan], want[~nan])
        and torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))
    )


def _counters(group: dist.ProcessGroup) -> dict[str, int]:
    backend = group._get_backend(torch.device("cpu"))
    fused = xcomm.stats().get("ALLREDUCE_FUSED", {}).get("calls", 0)
    return {"shm": backend.shm_ops, "carried": backend.carried_ops, "fused": fused}


def _rank_minmax(ctx: RankContext, route: str) -> dict[str, Any]:
    group = dist.new_group(backend="xcomm", pg_options=xcomm.Options(**ROUTES[route]))
    rank, world = ctx.rank, ctx.world_size
    wrong: list[str] = []
    ran: dict[str, dict[str, int]] = {}
    xcomm.reset_stats()
    for size_name, numel in SIZES.items():
        before = _counters(group)
        for dtype in DTYPES:
            inputs = [_input(r, world, numel, dtype) for r in range(world)]
            for op_name, op in OPS.items():
                want = _expected(inputs, op_name)
                mine = want.chunk(world)[rank]
                case = f"{size_name} {dtype} {op_name}"

                t = inputs[rank].clone()
                if route == "fused":  # async: held, and sent with the next op
                    t2 = inputs[rank].clone()
                    works = [dist.all_reduce(x, op=op, group=group, async_op=True) for x in (t, t2)]
                    for w in works:
                        w.wait()
                    if not _same_bits(t2, want):
                        wrong.append(f"all_reduce second {case}")
                else:
                    dist.all_reduce(t, op=op, group=group)
                if not _same_bits(t, want):
                    wrong.append(f"all_reduce {case}")

                base = inputs[rank].clone().repeat_interleave(2)
                t = base[::2]  # a strided view: decoded back through it
                dist.all_reduce(t, op=op, group=group)
                if not _same_bits(t, want) or not _same_bits(base[1::2], inputs[rank]):
                    wrong.append(f"all_reduce strided {case}")

                if hasattr(dist, "all_reduce_coalesced"):
                    ts = [inputs[rank].clone(), inputs[rank].clone()]
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # deprecated API
                        dist.all_reduce_coalesced(ts, op=op, group=group)
                    if not all(_same_bits(x, want) for x in ts):
                        wrong.append(f"all_reduce_coalesced {case}")

                t = inputs[rank].clone()
                dist.reduce(t, dst=1, op=op, group=group)
                # Only the root's tensor is defined after reduce (the others
                # hold what Gloo's algorithm leaves there).
                if rank == 1 and not _same_bits(t, want):
                    wrong.append(f"reduce {case}")

                out = torch.empty(numel // world, dtype=dtype)
                dist.reduce_scatter_tensor(out, inputs[rank].clone(), op=op, group=group)
                if not _same_bits(out, mine):
                    wrong.append(f"reduce_scatter_tensor {case}")

                out = torch.empty(numel // world, dtype=dtype)
                pieces = list(inputs[rank].clone().chunk(world))
                dist.reduce_scatter(out, pieces, op=op, group=group)
                if not _same_bits(out, mine) or not all(
                    _same_bits(p, q) for p, q in zip(pieces, inputs[rank].chunk(world), strict=True)
                ):
                    wrong.append(f"reduce_scatter {case}")
        after = _counters(group)
        ran[size_name] = {k: after[k] - before[k] for k in after}
    return {"wrong": wrong, "ran": ran}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("route", list(ROUTES))
def test_min_and_max_propagate_nan_and_order_zeros_on_every_route(
    route: str, world_size: int
) -> None:
    res = run_ranks(_rank_minmax, world_size, route, timeout=180)
    for rank, r in enumerate(res):
        assert not r["wrong"], f"rank {rank}: {r['wrong']}"
        small, large = r["ran"]["small"], r["ran"]["large"]
        # The route named is the one that ran.
        if route == "shm":
            assert small["shm"] > 0 and large["shm"] > 0, r["ran"]
        else:
            assert small["shm"] == large["shm"] == 0, r["ran"]
        if route == "plain-checked":
            assert small["carried"] > 0 and large["carried"] == 0, r["ran"]
        elif route != "fused":
            assert small["carried"] == large["carried"] == 0, r["ran"]
        if route == "fused":
            assert small["fused"] > 0, r["ran"]


def _rank_hierarchical(ctx: RankContext) -> dict[str, Any]:
    """Two logical hosts of two ranks: all_reduce runs over shared memory and
    then between the hosts' leaders (checked, carried when small)."""
    import os

    os.environ["XCOMM_SHM_HOST_TAG"] = f"host{ctx.rank // 2}"
    group = dist.new_group(backend="xcomm", pg_options=xcomm.Options())
    backend = group._get_backend(torch.device("cpu"))
    wrong: list[str] = []
    for numel in SIZES.values():
        for dtype in DTYPES:
            inputs = [_input(r, ctx.world_size, numel, dtype) for r in range(ctx.world_size)]
            for op_name, op in OPS.items():
                t = inputs[ctx.rank].clone()
                dist.all_reduce(t, op=op, group=group)
                if not _same_bits(t, _expected(inputs, op_name)):
                    wrong.append(f"{numel} {dtype} {op_name}")
    error = error_of(
        lambda: dist.all_reduce(
            torch.ones(6, dtype=torch.float32 if ctx.rank < 2 else torch.int32),
            op=dist.ReduceOp.MIN,
            group=group,
        )
    )
    return {
        "wrong": wrong,
        "plan": xcomm.group_plan(group)["shape"],
        "shm": backend.shm_ops,
        "leader_carried": backend.leader_carried_ops,
        "error": error,
    }


def test_min_and_max_of_a_hierarchical_group() -> None:
    res = run_ranks(_rank_hierarchical, 4, timeout=180)
    for rank, r in enumerate(res):
        assert not r["wrong"], f"rank {rank}: {r['wrong']}"
        assert r["plan"] != "plain" and r["shm"] > 0, r
        if rank % 2 == 0:  # the leaders, whose small steps ride in their check
            assert r["leader_carried"] > 0, r
        # The leaders' check sees each host's call as its caller made it.
        assert r["error"] and r["error"].startswith("ValueError"), r["error"]
        assert "host 0: all_reduce(MIN, Float, 24 bytes)" in r["error"], r["error"]
        assert "host 1: all_reduce(MIN, Int, 24 bytes)" in r["error"], r["error"]


# The ranks' agreement describes the caller's call, not its keys: a float32
# MIN and an int32 MIN of the same size have the same keys' dtype and bytes.
MISMATCH_ROUTES = {
    "shm": {},
    "plain-checked": {"shm": False},
    "plain-not-carried": {"shm": False, "carry_small_ops": False},
}


def _rank_float_against_int(ctx: RankContext, route: str) -> dict[str, Any]:
    group = dist.new_group(backend="xcomm", pg_options=xcomm.Options(**MISMATCH_ROUTES[route]))
    dtype = torch.float32 if ctx.rank == 0 else torch.int32
    n = 6 * ctx.world_size
    MIN = dist.ReduceOp.MIN
    errors = {
        "all_reduce": error_of(lambda: dist.all_reduce(torch.ones(n, dtype=dtype), MIN, group)),
        "reduce": error_of(lambda: dist.reduce(torch.ones(n, dtype=dtype), 1, MIN, group)),
        "reduce_scatter_tensor": error_of(
            lambda: dist.reduce_scatter_tensor(
                torch.ones(6, dtype=dtype), torch.ones(n, dtype=dtype), MIN, group
            )
        ),
        # bfloat16 keys are int32 too: its call is named with its own 2-byte elements.
        "all_reduce bfloat16": error_of(
            lambda: dist.all_reduce(
                torch.ones(n, dtype=torch.bfloat16 if ctx.rank == 0 else torch.int16), MIN, group
            )
        ),
    }
    # Still in step: the same MIN on every rank runs.
    t = torch.tensor([float(ctx.rank), float("nan") if ctx.rank == 1 else 0.0])
    dist.all_reduce(t, op=MIN, group=group)
    return {"errors": errors, "after": t.tolist()}


@pytest.mark.parametrize("route", list(MISMATCH_ROUTES))
def test_a_float_min_against_an_int32_min_of_the_same_size_raises(route: str) -> None:
    res = run_ranks(_rank_float_against_int, 2, route)
    # Rank 0's call as rank 0 made it (float32, 12 elements), not as its keys
    # travel (int32 of the same size; bfloat16's are twice its size).
    if route == "shm":  # its descriptors (collectives/shm/ShmAgreement.cpp)
        calls = {
            "all_reduce": "all_reduce(MIN, Float, 48 bytes)",
            "reduce": "reduce(root=1, Float, 48 bytes)",
            "reduce_scatter_tensor": "reduce_scatter(MIN, Float, 24 bytes)",
            "all_reduce bfloat16": "all_reduce(MIN, BFloat16, 24 bytes)",
        }
    else:  # the checks' rows (backend/CheckedRoute.cpp)
        calls = {
            "all_reduce": "all_reduce(MIN, Float, 48 bytes)",
            "reduce": "reduce(MIN, root=1, Float, 48 bytes)",
            "reduce_scatter_tensor": "reduce_scatter_tensor(MIN, Float, 24 bytes)",
            "all_reduce bfloat16": "all_reduce(MIN, BFloat16, 24 bytes)",
        }
    for rank, r in enumerate(res):
        for op, call in calls.items():
            error = r["errors"][op]
            assert error and error.startswith("ValueError"), (rank, op, error)
            assert f"called different collectives (rank 0: {call}; rank 1: " in error, (
                rank,
                op,
                error,
            )
        assert r["after"][0] == 0.0 and r["after"][1] != r["after"][1], r["after"]


def _rank_gloo_answer(ctx: RankContext) -> dict[str, Any]:
    """What plain gloo answers for the large MIN whose NaN is on rank 1 only."""
    x = _input(ctx.rank, ctx.world_size, SIZES["large"], torch.float32)
    dist.all_reduce(x, op=dist.ReduceOp.MIN, group=ctx.ref)
    nan_on_rank1 = torch.arange(x.numel()) % 16 == 1
    return {"nan_kept": bool(torch.isnan(x[nan_on_rank1]).all())}


def test_gloo_alone_drops_a_nan_that_only_a_later_rank_has() -> None:
    """The difference the lowering removes is real on this torch: Gloo's
    MIN keeps rank 0's number where only rank 1 has NaN."""
    for r in run_ranks(_rank_gloo_answer, 2):
        assert r["nan_kept"] is False, r
