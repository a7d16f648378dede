"""Sparse COO all_reduce: xcomm gives what Gloo gives, with every group
option, and xcomm.stats() counts the op (it used to raise after the op had
already been handed to Gloo, computing a sparse tensor's nbytes)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import xcomm
from dist_harness import Mismatches, RankContext, assert_no_mismatches, run_ranks

OPTIONS = {
    "default": xcomm.Options(),
    "no-shm": xcomm.Options(shm=False),
    "fp16": xcomm.Options(compression="fp16", compression_min_bytes=0),
    "int8": xcomm.Options(compression="int8", compression_min_bytes=0),
    "fusion": xcomm.Options(fusion_threshold_bytes=1 << 20),
}


def _sparse(ctx: RankContext, dtype: torch.dtype) -> torch.Tensor:
    g = ctx.generator(salt=3)
    # Rank-dependent, overlapping indices (some duplicated within a rank).
    idx = torch.randint(0, 50, (2, 12), generator=g)
    values = torch.randn(12, 3, generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, values, (50, 50, 3))


def _calls() -> int:
    return sum(s["calls"] for s in xcomm.stats().values())


def _rank_sparse(ctx: RankContext) -> list[str]:
    m = Mismatches(ctx)
    assert ctx.ref is not None
    for name, opts in OPTIONS.items():
        group = dist.new_group(backend="xcomm", pg_options=opts)
        for dtype in (torch.float32, torch.float64):
            for async_op in (False, True):
                label = f"{name} {dtype} async={async_op}"
                with m.case(label):
                    xcomm.reset_stats()
                    mine, ref = _sparse(ctx, dtype), _sparse(ctx, dtype)
                    work = dist.all_reduce(mine, group=group, async_op=async_op)
                    if async_op:
                        work.wait()
                    dist.all_reduce(ref, group=ctx.ref)
                    if not torch.equal(mine.to_dense(), ref.to_dense()):
                        m.fail(label, "differs from gloo's result")
                    # Stats are recorded by a callback that may trail wait() briefly.
                    deadline = time.monotonic() + 5
                    while (calls := _calls()) < 1 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    if calls != 1:
                        m.fail(label, f"xcomm.stats() counted {calls} ops, expected 1")
    return m.items


@pytest.mark.parametrize("world_size", [2, 3])
def test_sparse_all_reduce_matches_gloo(world_size: int) -> None:
    assert_no_mismatches(run_ranks(_rank_sparse, world_size, timeout=180))
