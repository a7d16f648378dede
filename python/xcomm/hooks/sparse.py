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
from ._common import ResidualHookState, allreduce_mean, check_density
from .feedback import FeedbackStore
from .stats import CompressionStats, allgather_bytes, allreduce_bytes

__all__ = [
    "RandomKState",
    "TopKState",
    "randomk_allreduce",
    "randomk_hook",
    "topk_allreduce",
    "topk_hook",
]


@dataclass
class TopKState(ResidualHookState):
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
        per_tensor: select per parameter rather than over the whole bucket:
            the bucket's ``k`` is split between its gradients in proportion to
            each one's non-zero entries at this step, ``k_i = k * nnz_i /
            nnz`` (largest remainders, at most a gradient's size), and each
            sends its own ``k_i`` largest entries. Dense gradients then send
            the same share of themselves (DGC's layer-wise selection); an
            embedding table's gradient keeps its share of the bucket's
            non-zero entries instead of losing them to a dense layer whose
            entries are larger. Same wire format and bytes. On an embedding
            model at 1% it reached a target loss the bucket-wide selection
            missed; on a dense transformer it needed 1.15x the steps, so the
            default is bucket-wide (``docs/benchmarks.md``, "Time to accuracy").

    The math, per bucket of ``L`` entries, ``a = g + e`` (gradient plus
    residual): send ``S = top_k(a)`` (or the union of ``top_{k_i}(a_i)``
    per tensor), keep ``e = a - S``; the mean is ``(1/n) sum_r S_r``.

    Example::

        >>> from xcomm.hooks import TopKState, topk_hook
        >>> model.register_comm_hook(TopKState(density=0.01), topk_hook)  # doctest: +SKIP
        >>> state = TopKState(density=0.01, per_tensor=True)  # layer-wise
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
    per_tensor: bool = False

    def __post_init__(self) -> None:
        check_density("TopKState", self.density)
        check_density("TopKState (warmup_density)", self.warmup_density)
        if self.warmup_steps < 0:
            raise ValueError(
                f"xcomm.hooks.TopKState: warmup_steps must be >= 0, got {self.warmup_steps}"
            )
        self._init_residuals("TopKState")
        self.codec = _C.TopKCodec(
            self.approximate, False, 4096, self.seed
        )  # residuals: self.feedback
        self._chain = _C.TopKAllreduce()

    def current_density(self, step: int | None = None) -> float:
        """The density at iteration ``step`` (default: the coming one),
        following the warm-up schedule."""
        done = (self.steps.iter if step is None else step) - self.start_iter
        if self.warmup_steps <= 0 or done >= self.warmup_steps:
            return self.density
        start = max(self.warmup_density, self.density)
        return start * (self.density / start) ** (done / self.warmup_steps)

    def _extra_state(self) -> dict:
        return {"rng": self.codec.get_rng_state()}

    def _load_extra_state(self, saved: dict) -> None:
        self.codec.set_rng_state(saved["rng"])


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the top-k entries of every rank's (gradient + residual)."""
    step = state.begin_bucket("topk_hook", bucket)
    return topk_allreduce(state, bucket, step)


def topk_allreduce(
    state: TopKState, bucket: dist.GradBucket, step: int, density: float | None = None
) -> torch.futures.Future[torch.Tensor]:
    """:func:`topk_hook`'s reduction of ``bucket`` at iteration ``step``, for
    a hook that counts iterations itself (``auto_hook``), at ``density``
    (default: the state's at that step; every rank must pass the same).

    Example::

        >>> fut = topk_allreduce(TopKState(density=0.01), bucket, step=5)  # doctest: +SKIP
    """
    if density is not None:
        check_density("topk_allreduce", density)
    if step < state.start_iter:
        return allreduce_mean(state, bucket, state.stats)
    buffer = bucket.buffer()
    world = state.group().size()
    if density is None:
        density = state.current_density(step)
    k = _C.TopKCodec.k_for(buffer.numel(), density)
    view = state.codec_view(bucket)
    segments = view.segments if state.per_tensor else []
    if state.error_feedback:
        packed = state.codec.encode_with_feedback(
            view.key, view.tensor, k, state.feedback.feedback, segments
        )
    else:
        packed = state.codec.encode(view.key, view.tensor, k, segments)
    state.stats.record(
        allreduce_bytes(buffer.nbytes, world), allgather_bytes(packed.numel(), world)
    )
    # The allgather and the decode run in C++ (csrc/collectives/chains/SparseAllreduce.hpp):
    # no Python callback, future or collective wrapper per bucket.
    return state._chain.start(
        state.codec, state.group(), buffer, view.tensor, view.index, packed, k
    )[0]


@dataclass
class RandomKState(ResidualHookState):
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
        self._init_residuals("RandomKState")
        self.codec = _C.RandomKCodec(self.seed, False)  # residuals: self.feedback
        self._chain = _C.RandomKAllreduce()


def randomk_hook(
    state: RandomKState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Averages the same random subset of entries on every rank with one allreduce."""
    step = state.begin_bucket("randomk_hook", bucket)
    return randomk_allreduce(state, bucket, step)


def randomk_allreduce(
    state: RandomKState, bucket: dist.GradBucket, step: int
) -> torch.futures.Future[torch.Tensor]:
    """:func:`randomk_hook`'s reduction of ``bucket`` at iteration ``step``
    (the positions are drawn from the seed, the bucket's key and ``step``).

    Example::

        >>> fut = randomk_allreduce(RandomKState(density=0.05), bucket, step=5)  # doctest: +SKIP
    """
    if step < state.start_iter:
        return allreduce_mean(state, bucket, state.stats)
    buffer = bucket.buffer()
    world = state.group().size()
    view = state.codec_view(bucket)
    key = view.key
    positions = state.codec.positions(key, step, buffer.numel(), state.density, buffer.device)
    if state.error_feedback:
        values = state.codec.encode_with_feedback(
            key, view.tensor, positions, state.feedback.feedback
        )
    else:
        values = state.codec.encode(key, view.tensor, positions)
    state.stats.record(allreduce_bytes(buffer.nbytes, world), allreduce_bytes(values.nbytes, world))
    # The allreduce and the decode run in C++ (csrc/collectives/chains/SparseAllreduce.hpp).
    return state._chain.start(
        state.codec, state.group(), buffer, view.tensor, view.index, values, positions
    )[0]
