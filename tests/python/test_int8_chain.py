"""The int8 hook's collectives chained in C++ (``_C.Int8Allreduce``).

Reference: the same codec phases run by hand in Python with blocking
collectives (pack, alltoall, reduce-and-pack, allgather, unpack), which is
what the hook did before its chain moved to C++: the results must be equal
bit for bit, with several buckets in flight at once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddp_helpers import FailedWork
from dist_harness import RankContext, run_ranks

xcomm = pytest.importorskip("xcomm")
from xcomm import hooks

CHUNK = 64
# Odd sizes: shards that do not divide the bucket, a bucket smaller than the
# world's shards, one larger than a chunk per rank.
SIZES = (1000, 7, 4099)


class _Bucket:
    """What the hook uses of ``dist.GradBucket``."""

    def __init__(self, index: int, numel: int, is_last: bool) -> None:
        self._buffer = torch.empty(numel)
        self._param = torch.nn.Parameter(torch.empty(numel))
        self._index, self._last = index, is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer]

    def parameters(self) -> list[torch.Tensor]:
        return [self._param]

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def _by_hand(
    codec: Any, feedback: Any, key: int, flat: torch.Tensor, world: int, ef: bool
) -> torch.Tensor:
    flat = flat.clone()
    if ef:
        packed = codec.pack_shards_with_feedback(flat, world, feedback, key)
    else:
        packed = codec.pack_shards(flat, world)
    received = torch.empty_like(packed)
    dist.all_to_all_single(received, packed)
    mean = codec.reduce_and_pack(received, codec.shard_elems(flat.numel(), world), float(world))
    gathered = torch.empty(world * mean.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered, mean)
    codec.unpack_all(gathered, codec.shard_elems(flat.numel(), world), flat)
    return flat


def _rank_hook_vs_by_hand(ctx: RankContext, ef: bool) -> None:
    world = ctx.world_size
    state = hooks.Int8State(chunk_elems=CHUNK, error_feedback=ef, start_iter=2 if ef else 0)
    codec, feedback = xcomm._C.Int8Codec(CHUNK), xcomm._C.ErrorFeedback()
    buckets = [_Bucket(i, n, i == len(SIZES) - 1) for i, n in enumerate(SIZES)]
    for step in range(5):
        grads = [
            torch.randn(n, generator=ctx.generator(salt=10 * step + i)) for i, n in enumerate(SIZES)
        ]
        for b, g in zip(buckets, grads):
            b.buffer().copy_(g)
        # Every bucket in flight before any is waited for: the turns order them.
        futures = [hooks.int8_compress_hook(state, b) for b in buckets]
        got = [f.wait() for f in futures]
        for i, (g, out) in enumerate(zip(grads, got)):
            assert out.data_ptr() == buckets[i].buffer().data_ptr()
            if step < state.start_iter:
                want = g.clone()
                dist.all_reduce(want)
                want /= world
                torch.testing.assert_close(out, want)
                continue
            want = _by_hand(codec, feedback, i, g, world, ef)
            assert torch.equal(out, want), f"step {step}, bucket {i}"
    assert state.steps.iter == 5


@pytest.mark.parametrize("ef", [True, False])
@pytest.mark.parametrize("world_size", [2, 3])
def test_hook_equals_the_codec_phases_run_by_hand(world_size: int, ef: bool) -> None:
    run_ranks(_rank_hook_vs_by_hand, world_size, ef)


class _FailingAlltoall(dist.ProcessGroup):
    """The WORLD group, except that its ``fail_at``-th alltoall fails; the
    allgathers go to WORLD's backend."""

    def __init__(self, fail_at: int) -> None:
        world = dist.group.WORLD
        super().__init__(world.rank(), world.size())
        self._world, self.fail_at, self.calls = world, fail_at, 0
        cpu = torch.device("cpu")
        self._register_backend(cpu, dist.ProcessGroup.BackendType.CUSTOM, world._get_backend(cpu))

    def alltoall_base(self, out: Any, inp: Any, out_splits: Any, in_splits: Any, opts: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            return FailedWork(f"injected alltoall failure {self.calls}")
        return self._world.alltoall_base(out, inp, out_splits, in_splits, opts)

    all_to_all_single = alltoall_base

    def getBackendName(self) -> str:
        return "failing-alltoall"


def _rank_failure(ctx: RankContext, fail_at: int) -> list[str]:
    group = _FailingAlltoall(fail_at)
    state = hooks.Int8State(group, chunk_elems=CHUNK, error_feedback=False, start_iter=0)
    buckets = [_Bucket(i, n, i == len(SIZES) - 1) for i, n in enumerate(SIZES)]
    for b in buckets:
        b.buffer().normal_(generator=ctx.generator())
    futures = [hooks.int8_compress_hook(state, b) for b in buckets]
    outcome = []
    for f in futures:
        try:
            f.wait()
            outcome.append("ok")
        except RuntimeError as e:
            outcome.append(str(e))
    return [*outcome, f"alltoalls {group.calls}"]


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_failed_collective_fails_its_bucket_and_the_later_ones(fail_at: int) -> None:
    """The failed bucket's error reaches its future; later buckets, waiting
    for their turn, fail with the same error and issue nothing."""
    for outcome in run_ranks(_rank_failure, 2, fail_at):
        message = f"injected alltoall failure {fail_at}"
        assert outcome[: fail_at - 1] == ["ok"] * (fail_at - 1), outcome
        assert all(message in o for o in outcome[fail_at - 1 : len(SIZES)]), outcome
        assert outcome[-1] == f"alltoalls {fail_at}", outcome


def test_the_chain_without_a_codec_or_group_is_a_clear_error() -> None:
    chain = xcomm._C.Int8Allreduce()
    codec = xcomm._C.Int8Codec(CHUNK)
    t = torch.zeros(4)
    packed = codec.pack_shards(t, 1)
    with pytest.raises(RuntimeError, match="a codec and a process group are needed"):
        chain.start(None, None, t, t, None, packed)
    with pytest.raises(RuntimeError, match="a codec and a process group are needed"):
        chain.start(codec, None, t, t, None, packed)
