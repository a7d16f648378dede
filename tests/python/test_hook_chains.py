"""The int8, top-k and random-k hooks' collectives chained in C++
(``_C.Int8Allreduce``, ``_C.TopKAllreduce``, ``_C.RandomKAllreduce``).

Reference: the same codec phases run by hand in Python with blocking
collectives (int8: pack, alltoall, reduce-and-pack, allgather, unpack; top-k:
encode, allgather, decode; random-k: encode, allreduce, decode), which is
what the hooks did before their chains moved to C++: the results must be
equal bit for bit, with several buckets in flight at once.
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
DENSITY = 0.05
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


def _int8_by_hand(codec: Any, feedback: Any, key: int, flat: torch.Tensor, ef: bool) -> None:
    world = dist.get_world_size()
    if ef:
        packed = codec.pack_shards_with_feedback(flat, world, feedback, key)
    else:
        packed = codec.pack_shards(flat, world)
    received = torch.empty_like(packed)
    dist.all_to_all_single(received, packed)
    shard = codec.shard_elems(flat.numel(), world)
    mean = codec.reduce_and_pack(received, shard, float(world))
    gathered = torch.empty(world * mean.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered, mean)
    codec.unpack_all(gathered, shard, flat)


def _topk_by_hand(codec: Any, feedback: Any, key: int, flat: torch.Tensor, ef: bool) -> None:
    world = dist.get_world_size()
    k = xcomm._C.TopKCodec.k_for(flat.numel(), DENSITY)
    packed = (
        codec.encode_with_feedback(key, flat, k, feedback) if ef else codec.encode(key, flat, k)
    )
    gathered = torch.empty(world * packed.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered, packed)
    codec.decode(gathered, k, flat, float(world))


def _randomk_by_hand(
    codec: Any, feedback: Any, key: int, flat: torch.Tensor, ef: bool, step: int
) -> None:
    positions = codec.positions(key, step, flat.numel(), DENSITY)
    if ef:
        values = codec.encode_with_feedback(key, flat, positions, feedback)
    else:
        values = codec.encode(key, flat, positions)
    dist.all_reduce(values)
    codec.decode(values, positions, flat, float(dist.get_world_size()))


def _method(method: str, ef: bool) -> tuple[Any, Any, Any]:
    """(state, hook, by_hand(flat, key, step)) of a method, the reference with
    its own codec and residuals."""
    start = 2 if ef else 0
    feedback = xcomm._C.ErrorFeedback()
    if method == "int8":
        state = hooks.Int8State(chunk_elems=CHUNK, error_feedback=ef, start_iter=start)
        codec = xcomm._C.Int8Codec(CHUNK)
        return (
            state,
            hooks.int8_compress_hook,
            lambda flat, key, step: _int8_by_hand(codec, feedback, key, flat, ef),
        )
    if method == "topk":
        state = hooks.TopKState(density=DENSITY, error_feedback=ef, start_iter=start, seed=3)
        codec = xcomm._C.TopKCodec(False, False, 4096, 3)
        return (
            state,
            hooks.topk_hook,
            lambda flat, key, step: _topk_by_hand(codec, feedback, key, flat, ef),
        )
    state = hooks.RandomKState(density=DENSITY, error_feedback=ef, start_iter=start, seed=3)
    codec = xcomm._C.RandomKCodec(3, False)
    return (
        state,
        hooks.randomk_hook,
        lambda flat, key, step: _randomk_by_hand(codec, feedback, key, flat, ef, step),
    )


def _rank_hook_vs_by_hand(ctx: RankContext, method: str, ef: bool) -> None:
    world = ctx.world_size
    state, hook, by_hand = _method(method, ef)
    buckets = [_Bucket(i, n, i == len(SIZES) - 1) for i, n in enumerate(SIZES)]
    for step in range(5):
        grads = [
            torch.randn(n, generator=ctx.generator(salt=10 * step + i)) for i, n in enumerate(SIZES)
        ]
        for b, g in zip(buckets, grads):
            b.buffer().copy_(g)
        # Every bucket in flight before any is waited for: the turns order them.
        futures = [hook(state, b) for b in buckets]
        got = [f.wait() for f in futures]
        for i, (g, out) in enumerate(zip(grads, got)):
            assert out.data_ptr() == buckets[i].buffer().data_ptr()
            want = g.clone()
            if step < state.start_iter:
                dist.all_reduce(want)
                want /= world
                torch.testing.assert_close(out, want)
                continue
            by_hand(want, i, step)
            assert torch.equal(out, want), f"step {step}, bucket {i}"
    assert state.steps.iter == 5


@pytest.mark.parametrize("ef", [True, False])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("method", ["int8", "topk", "randomk"])
def test_hook_equals_the_codec_phases_run_by_hand(method: str, world_size: int, ef: bool) -> None:
    run_ranks(_rank_hook_vs_by_hand, world_size, method, ef)


class _FailingGroup(dist.ProcessGroup):
    """The WORLD group, except that its ``fail_at``-th alltoall or allreduce
    fails; the allgathers go to WORLD's backend."""

    def __init__(self, fail_at: int) -> None:
        world = dist.group.WORLD
        super().__init__(world.rank(), world.size())
        self._world, self.fail_at, self.calls = world, fail_at, 0
        cpu = torch.device("cpu")
        self._register_backend(cpu, dist.ProcessGroup.BackendType.CUSTOM, world._get_backend(cpu))

    def _failed(self) -> FailedWork | None:
        self.calls += 1
        if self.calls == self.fail_at:
            return FailedWork(f"injected failure {self.calls}")
        return None

    def alltoall_base(self, out: Any, inp: Any, out_splits: Any, in_splits: Any, opts: Any) -> Any:
        return self._failed() or self._world.alltoall_base(out, inp, out_splits, in_splits, opts)

    all_to_all_single = alltoall_base

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        return self._failed() or self._world.allreduce(tensors, opts or dist.AllreduceOptions())

    def getBackendName(self) -> str:
        return "failing"


def _rank_failure(ctx: RankContext, method: str, fail_at: int) -> list[str]:
    group = _FailingGroup(fail_at)
    if method == "int8":
        state = hooks.Int8State(group, chunk_elems=CHUNK, error_feedback=False, start_iter=0)
        hook = hooks.int8_compress_hook
    else:
        state = hooks.RandomKState(group, density=DENSITY, error_feedback=False, start_iter=0)
        hook = hooks.randomk_hook
    buckets = [_Bucket(i, n, i == len(SIZES) - 1) for i, n in enumerate(SIZES)]
    for b in buckets:
        b.buffer().normal_(generator=ctx.generator())
    futures = [hook(state, b) for b in buckets]
    outcome = []
    for f in futures:
        try:
            f.wait()
            outcome.append("ok")
        except RuntimeError as e:
            outcome.append(str(e))
    return [*outcome, f"collectives {group.calls}"]


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_failed_int8_collective_fails_its_bucket_and_the_later_ones(fail_at: int) -> None:
    """int8's alltoall is issued in the bucket's turn: the failed bucket's
    error reaches its future; later buckets, waiting for their turn, fail with
    the same error and issue nothing."""
    for outcome in run_ranks(_rank_failure, 2, "int8", fail_at):
        message = f"injected failure {fail_at}"
        assert outcome[: fail_at - 1] == ["ok"] * (fail_at - 1), outcome
        assert all(message in o for o in outcome[fail_at - 1 : len(SIZES)]), outcome
        assert outcome[-1] == f"collectives {fail_at}", outcome


def test_a_failed_randomk_allreduce_fails_its_bucket_only() -> None:
    """Random-k's one collective is out before it fails, so the next buckets'
    turns have come and they complete."""
    for outcome in run_ranks(_rank_failure, 2, "randomk", 2):
        assert outcome[0] == "ok", outcome
        assert "injected failure 2" in outcome[1], outcome
        assert outcome[2] == "ok", outcome
        assert outcome[-1] == f"collectives {len(SIZES)}", outcome


def test_a_chain_without_a_codec_or_group_is_a_clear_error() -> None:
    t = torch.zeros(4)
    int8 = xcomm._C.Int8Codec(CHUNK)
    topk = xcomm._C.TopKCodec(False, False, 4096, 0)
    randomk = xcomm._C.RandomKCodec(0, False)
    starts = [
        lambda codec: xcomm._C.Int8Allreduce().start(codec, None, t, t, None, t),
        lambda codec: xcomm._C.TopKAllreduce().start(codec, None, t, t, None, t, 1),
        lambda codec: xcomm._C.RandomKAllreduce().start(codec, None, t, t, None, t, t),
    ]
    for start, codec in zip(starts, (int8, topk, randomk)):
        for c in (None, codec):
            with pytest.raises(RuntimeError, match="a codec and a process group are needed"):
                start(c)


def _rank_bad_packed(ctx: RankContext) -> str:
    t = torch.zeros(8)
    bad = torch.zeros(3, 4, dtype=torch.uint8)  # 3 rows for a world of 1
    try:
        xcomm._C.Int8Allreduce().start(xcomm._C.Int8Codec(CHUNK), dist.group.WORLD, t, t, None, bad)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_int8_chain_refuses_a_payload_not_shaped_by_pack_shards() -> None:
    for message in run_ranks(_rank_bad_packed, 1):
        assert "packed must be uint8 [world_size, bytes]" in message, message
