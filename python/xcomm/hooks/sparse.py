"""Top-k and random-k sparsification hooks with error feedback.

Both add the bucket's residual ``e`` to the gradient, ``a = g + e``, send
``k = ceil(density * L)`` of its ``L`` entries and keep the rest as the next
residual, ``e = a - sent``, so nothing is lost, only delayed (as in DGC).

- Top-k sends the ``k`` largest-magnitude entries. Ranks choose different
  positions, so each rank's ``k`` (int32 index, value) pairs are allgathered
  and summed: ``mean = (1/n) sum_r scatter(idx_r, val_r)``. Traffic per rank:
  ``(n-1) * k * (4 + itemsize)`` bytes.
- Random-k draws the same positions on every rank from a shared seed, the
  bucket index and the step (one position in each of ``k`` equal strata of
  the bucket), so a dense allreduce of the ``k`` selected values is exact and
  no indices are sent: ``2 (n-1)/n * k * itemsize`` bytes.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import _C
from ._common import (
    PicklableState,
    StepCounter,
    allreduce_mean,
    check_density,
    check_floating,
    check_start_iter,
    feedback_store,
    warn_host_codec,
)
from .feedback import FeedbackStore
from .stats import CompressionStats, allgather_bytes, allreduce_bytes

__all__ = ["RandomKState", "TopKState", "randomk_hook", "topk_hook"]


@dataclass
class TopKState(PicklableState):
    """State of :func:`topk_hook`.

    Args:
        process_group: the group to reduce over (default: the default group).
        density: fraction of entries sent per bucket, in (0, 1].
        approximate: kept for compatibility; both settings select the exact
            top-k (ties to the lower index) in one fused pass over float32
            buckets, which estimates the threshold from a sample and falls back
            to a full selection when the sample overshoots.
        error_feedback: keep what was not sent for the next step.
        start_iter: iterations reduced uncompressed first (>= 2 with error feedback).
        warmup_steps: after ``start_iter``, the density decays exponentially
            from ``warmup_density`` to ``density`` over this many steps (DGC's
            warm-up); 0 disables it.
        warmup_density: the density at the start of the warm-up.
        seed: seed of the threshold's sampling.
        model: the DDP model; when given, checkpoints keep residuals per
            parameter, so a resumed run continues bit for bit even though a
            fresh DDP lays out its first buckets differently.
        feedback: an error-feedback store to share with other states (a bucket
            then keeps its residual when it switches method); default: its own.

    Example::

        >>> from xcomm.hooks import TopKState, topk_hook
        >>> model.register_comm_hook(TopKState(density=0.01), topk_hook)  # doctest: +SKIP
    """

    process_group: dist.ProcessGroup | None = None
    density: float = 0.01
    approximate: bool = False
    error_feedback: bool = True
    start_iter: int = 2
    warmup_steps: int = 0
    warmup_density: float = 0.25
    seed: int = 0
    model: torch.nn.Module | None = field(default=None, repr=False)
    stats: CompressionStats = field(default_factory=CompressionStats)
    feedback: FeedbackStore | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_density("TopKState", self.density)
        check_density("TopKState (warmup_density)", self.warmup_density)
        check_start_iter("TopKState", self.start_iter, self.error_feedback)
        if self.warmup_steps < 0:
            raise ValueError(
                f"xcomm.hooks.TopKState: warmup_steps must be >= 0, got {self.warmup_steps}"
            )
        self.codec = _C.TopKCodec(
            self.approximate, False, 4096, self.seed
        )  # residuals: self.feedback
        self._chain = _C.TopKAllreduce()
        self.steps = StepCounter()
        self.feedback = feedback_store(self)

    def current_density(self) -> float:
        """The density of this step, following the warm-up schedule."""
        done = self.steps.iter - self.start_iter
        if self.warmup_steps <= 0 or done >= self.warmup_steps:
            return self.density
        start = max(self.warmup_density, self.density)
        return start * (self.density / start) ** (done / self.warmup_steps)

    def state_dict(self) -> dict:
        return {
            "iter": self.steps.iter,
            "feedback": self.feedback.state_dict(),
            "rng": self.codec.get_rng_state(),
            "stats": self.stats.as_dict(),
        }

    def load_state_dict(self, d: dict) -> None:
        self.steps.iter = int(d["iter"])
        self.feedback.load_state_dict(d["feedback"])
        self.codec.set_rng_state(d["rng"])
        self.stats.load_dict(d["stats"])


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the top-k entries of every rank's (gradient + residual)."""
    buffer = bucket.buffer()
    check_floating("topk_hook", buffer)
    warn_host_codec("topk_hook", buffer)
    if state.steps.iter < state.start_iter:
        state.steps.after_bucket(bucket)
        return allreduce_mean(state, bucket, state.stats)
    density = state.current_density()
    state.steps.after_bucket(bucket)

    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = group.size()
    k = _C.TopKCodec.k_for(buffer.numel(), density)
    view = state.feedback.view(bucket)
    if state.error_feedback:
        packed = state.codec.encode_with_feedback(view.key, view.tensor, k, state.feedback.feedback)
    else:
        state.feedback.flush(view)
        packed = state.codec.encode(view.key, view.tensor, k)
    state.stats.record(
        allreduce_bytes(buffer.nbytes, world), allgather_bytes(packed.numel(), world)
    )
    # The allgather and the decode run in C++ (csrc/collectives/chains/SparseAllreduce.hpp):
    # no Python callback, future or collective wrapper per bucket.
    return state._chain.start(state.codec, group, buffer, view.tensor, view.index, packed, k)[0]


@dataclass
class RandomKState(PicklableState):
    """State of :func:`randomk_hook`.

    Args:
        process_group: the group to reduce over (default: the default group).
        density: expected fraction of entries sent per bucket, in (0, 1].
        seed: the shared seed; every rank must use the same one.
        error_feedback: keep what was not sent for the next step.
        start_iter: iterations reduced uncompressed first (>= 2 with error feedback).
        model: the DDP model; when given, checkpoints keep residuals per
            parameter, so a resumed run continues bit for bit even though a
            fresh DDP lays out its first buckets differently.
        feedback: an error-feedback store to share with other states (a bucket
            then keeps its residual when it switches method); default: its own.

    Example::

        >>> from xcomm.hooks import RandomKState, randomk_hook
        >>> model.register_comm_hook(RandomKState(density=0.05), randomk_hook)  # doctest: +SKIP
    """

    process_group: dist.ProcessGroup | None = None
    density: float = 0.01
    seed: int = 0
    error_feedback: bool = True
    start_iter: int = 2
    model: torch.nn.Module | None = field(default=None, repr=False)
    stats: CompressionStats = field(default_factory=CompressionStats)
    feedback: FeedbackStore | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_density("RandomKState", self.density)
        check_start_iter("RandomKState", self.start_iter, self.error_feedback)
        self.codec = _C.RandomKCodec(self.seed, False)  # residuals: self.feedback
        self._chain = _C.RandomKAllreduce()
        self.steps = StepCounter()
        self.feedback = feedback_store(self)

    def state_dict(self) -> dict:
        return {
            "iter": self.steps.iter,
            "feedback": self.feedback.state_dict(),
            "stats": self.stats.as_dict(),
        }

    def load_state_dict(self, d: dict) -> None:
        self.steps.iter = int(d["iter"])
        self.feedback.load_state_dict(d["feedback"])
        self.stats.load_dict(d["stats"])


def randomk_hook(
    state: RandomKState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Averages the same random subset of entries on every rank with one allreduce."""
    buffer = bucket.buffer()
    check_floating("randomk_hook", buffer)
    warn_host_codec("randomk_hook", buffer)
    if state.steps.iter < state.start_iter:
        state.steps.after_bucket(bucket)
        return allreduce_mean(state, bucket, state.stats)
    step = state.steps.iter
    state.steps.after_bucket(bucket)

    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = group.size()
    view = state.feedback.view(bucket)
    key = view.key
    positions = state.codec.positions(key, step, buffer.numel(), state.density, buffer.device)
    if state.error_feedback:
        values = state.codec.encode_with_feedback(
            key, view.tensor, positions, state.feedback.feedback
        )
    else:
        state.feedback.flush(view)
        values = state.codec.encode(key, view.tensor, positions)
    state.stats.record(allreduce_bytes(buffer.nbytes, world), allreduce_bytes(values.nbytes, world))
    # The allreduce and the decode run in C++ (csrc/collectives/chains/SparseAllreduce.hpp).
    return state._chain.start(
        state.codec, group, buffer, view.tensor, view.index, values, positions
    )[0]
