"""``auto``: per bucket, the reduction that is fastest on this link and machine.

A compressor pays only when the bytes it saves on the link take longer than
the compute it spends. :func:`auto_hook` decides that per bucket from a cost
model with measured inputs, and re-decides as they change.

For a bucket of ``n`` float elements over ``w`` ranks, method ``m`` costs

    ``T(m) = c_m * n  +  C_m * latency  +  B_m(n) / bandwidth``

where ``c_m`` is the codec's measured time per element on the bucket's
device (encode, reduce and decode with error feedback; 0 for ``none``; for
PowerSGD the matrix
products, from the bucket's parameter shapes), ``C_m`` its number of
collectives and ``B_m(n)`` the bytes its collectives put on one rank's link
(``2 (w-1)/w * bytes`` for an allreduce, ``(w-1) * bytes`` for an allgather).
The bucket takes ``argmin T``; it keeps its method unless another is
``switch_margin`` faster, so noise does not flip it, and never keeps one
predicted slower than ``none``.

The loop is closed (``observe=True``, the default; CPU buckets): every reduction is timed
and compared with its prediction (:class:`~xcomm.hooks._measure.ObservedCosts`).
Uncompressed ones (the first ``start_iter`` steps, and buckets on ``none``)
correct the link, so a probe that read a fast link slow is overruled by what
the gradients' own allreduces take; compressed ones correct their method,
so a codec several times slower on these gradients than on the calibration
data (a zero-heavy bucket for top-k) is predicted at what it took. The
corrections are agreed at each round like every other input, so
``T(m) = f_m (c_m n + C_m latency) + f_m f_link B_m(n) / bandwidth`` is the
same on every rank; a method seen slower than uncompressed loses to
``none`` at the next round. A method that has not run yet is predicted with
the least correction of the compressed methods that have (its calibration
is as far off on these buckets as theirs was), so auto does not leave an
observed method for one that only its ``randn`` calibration favours;
:meth:`AutoState.explain` says which predictions are corrected and why a
method was not tried.

Whole steps are checked too (:class:`~xcomm.hooks._measure.UncompressedCheck`,
CPU buckets, ``observe=True`` on a measured link). A reduction's time from
issue to completion is not what it costs the step: on a host whose cores
also run the backward pass, an uncompressed reduction overlaps that pass
and a codec takes cores from it (a byte-level LM at 10 Gbit/s on 2 cores:
int8 predicted 2.7x faster than ``none`` per bucket, whole steps 109 ms
against 102 ms). So some steps after compression starts, a trial runs every
bucket ``none`` on alternate steps (a slow spell of the host falls on both
sides), and compression is kept only where its steps were at least 2%
faster than the uncompressed ones; otherwise every bucket stays
uncompressed, and later trials try compression again. Checks are spaced so their trials
cost at most 1% of the training time, skipped where the uncompressed
reductions alone are predicted to take longer than a step, and come at once
where the steps under the verdict slow down past the other side's.

The objective is time to accuracy, not time per step (``objective``,
default ``"time_to_accuracy"``). A lossy method that sends few bytes but
drops most of each step's gradient saves time per step and costs steps. How
many steps cannot be read off one step's gradient: on a byte-level
transformer LM trained with AdamW, top-k 1% dropped 16-20% of the step's
squared gradient norm and needed 2.2x the steps to a target loss, PowerSGD
rank 4 dropped 2.5-22% and needed 1.8x; on an embedding classifier
PowerSGD dropped 8-25% and needed 1.08x (docs/benchmarks.md, "Time to
accuracy"). The first-order estimate of noise theory, steps grow by
``1 + delta^2 / |g|^2`` for a compression error of squared norm ``delta^2``
(McCandlish et al., 2018, "An Empirical Model of Large-Batch Training"),
is 4-6x too low under Adam, whose per-coordinate normalisation gives the
small coordinates a sparsifier holds back as much weight as the large ones.
So the default objective trusts only what it can bound: a lossy method is a
candidate for a bucket only while the share of the step's gradient it drops
there is at most ``max_lost_share`` (1% by default: what a cast or int8
loses, about 1e-4, passes by far; top-k passes on a bucket whose gradient is
mostly exact zeros, such as an embedding table's, and is a candidate only on
such a bucket, at most half of whose entries are non-zero, since on a dense
one the share it drops under-reads what it costs under Adam; there it sends
every non-zero entry, raising its density above ``min_density`` where the
bucket has more: even 0.1-0.2% of an embedding model's gradient held back by
top-k at 1% left its loss 0.4-0.6% above uncompressed training's), and a
candidate is charged that share of the step time:

    ``T'(m) = T(m) + (|g_b - C_m(g_b)|^2 / |g|^2) * S``

where ``g_b`` is the bucket's gradient, ``|g|^2`` the whole step's, ``C_m``
the method's round trip without error feedback (PowerSGD: the best rank-r
approximation, which its warm-started power iteration approaches) and
``S`` the step time: measured (the median of recent steps, the slowest
rank's) and at least the predicted time of the buckets' reductions. The
shares are measured on the model's own gradients at step ``start_iter - 1``,
again every 50 steps or more where top-k may be chosen (what it drops
changes as training changes the gradient's shape), and agreed (MAX over ranks), so every rank
gates and charges alike. A method that drops more than the bound today may
return when a later measurement finds it under. ``max_lost_share=1.0``
keeps the casts and int8 everywhere and top-k on every mostly zero bucket,
and charges by the share alone (a first-order estimate:
check time to your target loss, ``python -m xcomm_bench time-to-accuracy``);
``objective="step_time"`` drops the bound and the charge. The bound is set
for the optimizer most users run: under SGD with momentum the same methods
cost fewer steps (on a CNN, PowerSGD needed no more steps than
uncompressed training, against 1.29x under AdamW), so there it leaves time
on the table: measure, and name the method or raise the bound.

PowerSGD is not judged by its share: the share it drops of one step's
gradient did not predict its cost in steps (on the CNN it dropped under 1%
of a bucket and needed 1.29-1.38x the steps; on the LM 2.5-22% and
1.8-2.0x). It is judged on the whole step instead, by a gate
(``powersgd_steps``, M, 2.5 by default: a quarter more than the most steps
it was seen to need, 2.0x, so that a step predicted a little fast does not
tip it): with ``S`` the step time as above, ``S_without`` the step
predicted with each bucket on its best other method and ``S_with`` with
PowerSGD wherever it is faster, PowerSGD is a candidate, uncharged, only
while

    ``M * S_with <= S_without``

so it is chosen only where its steps are fast enough that even M times as
many of them reach the loss sooner. With M = 2, at 0.1 Gbit/s, the gate
opened on the LM, whose steps PowerSGD made 1.78x faster than int8's and
needed 2.0x as many of: 1.10x int8's time to the target. Its steps were
1.47x faster on the CNN and 1.27x on a GRU, and 1.25-1.34x at 0.5 Gbit/s.
It is first evaluated at the round after the one that starts compression,
when a method has run and been observed (the starting round has only the
probe and the calibration, and opened the gate on the LM in one run of two).
It opens only when ``M * S_with`` is below ``S_without`` by
``switch_margin`` and, once open, closes only when it exceeds it by as much,
so a noisy step time flips it neither way. The side the run is on is its
measured step; the other side is that step less (or plus) the predicted
saving until it has run, and from then its own measured step, while the
link's bandwidth stays within 1.5x of the one it was measured at. Predicted
both ways, a saving 10-20% above the measured one put the two thresholds
within noise of each other: on the LM at 0.1 Gbit/s the gate flipped 4-10
times a run and paid for both methods. A per-bucket version of the gate
would be wrong: at 0.5 Gbit/s the LM's reductions alone are 4.6x faster with PowerSGD, its
whole steps 1.34x.

Inputs, measured, never guessed:

* the codecs' ``c_m``: timed on this machine on the buckets' device (CPU,
  or a GPU with xcomm's CUDA kernels), on the model's own gradients: the
  largest bucket of the last uncompressed step (``start_iter - 1``), with
  its zeros, ties and magnitudes, at the round that starts compression
  (a small synthetic bucket stands in before, when nothing is compressed);
* the link's latency and bandwidth as the collectives see them (the
  backend's own reduction cost included): every ``interval`` steps (later
  where a round would cost more than ``probe_fraction`` of the steps
  between), at the start of the backward pass (when no collective of the
  hook is in flight), a probe allreduce run twice (the first, untimed,
  lines the ranks up and drains a link's burst; both together sized to cost
  about ``probe_fraction`` of the steps between rounds), and the small
  allreduce that agrees the inputs (its duration is the latency).

That agreement is an allreduce MAX over ranks of every input, so every rank
computes the same choice from the same numbers, and their collectives match.

Lossy methods share one :class:`~xcomm.hooks.FeedbackStore`, so a bucket
that switches method keeps its residual (PowerSGD's per-parameter error is
handed over too); a switch to ``none`` or a cast sends what is owed.

On GPU buckets the probe runs on the GPU (over NCCL) and the codecs are
timed there. Where xcomm was built with its CUDA codec kernels
(``xcomm._C.cuda_codecs``) every allowed method is a candidate; without
them xcomm's int8 and top-k would run on the host, so the candidates are
``none``, ``bf16`` and ``fp16`` (:meth:`AutoState.candidates`).

The choice can be bounded: ``methods`` (allowed set), ``lossless_only``,
``min_density`` (top-k), ``powersgd_rank``. :meth:`AutoState.explain` and
``state.decisions`` tell which method each bucket uses and the predicted
times that chose it; with the timeline on, each decision is a span on the
track "xcomm auto", and ``xcomm.stats()`` counts buckets per method under
``AUTO:<method>``.

Example::

    >>> from xcomm.hooks import AutoState, auto_hook
    >>> state = AutoState(methods=("none", "bf16", "int8", "powersgd"))
    >>> ddp_model.register_comm_hook(state, auto_hook)  # doctest: +SKIP
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import _C
from ..opstats import record_op
from ..trace import add_span, now_us, timeline_enabled
from ._common import (
    IssueOrder,
    PicklableState,
    allreduce_mean,
    check_floating,
    group_size,
    mark_issued,
    then_collective,
)
from ._measure import (
    LinkModel,
    MeasuredLink,
    MethodChoices,
    ObservedCosts,
    UncompressedCheck,
    future_failed,
)
from ._methods import method_names
from .cast import CastState, bf16_cast_hook, fp16_cast_hook
from .feedback import FeedbackStore
from .int8 import Int8State, int8_allreduce
from .powersgd import PowerSGDState, powersgd_allreduce
from .sparse import TopKState, topk_allreduce
from .stats import CompressionStats, allreduce_bytes

__all__ = [
    "DEFAULT_METHODS",
    "METHODS",
    "OBJECTIVES",
    "AutoState",
    "LinkModel",
    "auto_hook",
    "compression_errors",
    "predict_parts",
    "predict_seconds",
]

#: What ``auto`` can choose from, cheapest codec first (ties go to the earlier).
METHODS = method_names("ddp")
_LOSSLESS = method_names("ddp", lossless_only=True)
#: What ``auto`` chooses from unless told otherwise: bf16, int8 and top-k,
#: each only where it drops at most ``max_lost_share`` of the step's gradient
#: (top-k: on a mostly zero bucket), and PowerSGD where its step gate opens
#: (``AutoState.powersgd_steps``).
DEFAULT_METHODS = method_names("ddp", default_only=True)
#: What auto chooses among on a GPU bucket where xcomm has no CUDA codec
#: kernels (its int8, top-k and PowerSGD codecs would run on the host).
_ON_DEVICE = method_names("ddp", device_capable_only=True)
_INT8_CHUNK = _C.Int8Codec.DEFAULT_CHUNK_ELEMS
# Order of the agreed vector: latency, seconds per wire byte, then codec costs.
_CODEC_KEYS = tuple(_C.allreduce_cost_keys(list(METHODS)))
# Codec timings before any bucket is compressed: cheap, replaced at start_iter.
_STAND_IN_NUMEL = 1 << 16
# A synthetic bucket's size where there is no sample: 16 MiB, out of cache as DDP's are.
_CALIBRATION_NUMEL = 1 << 22
# Top-k is a candidate only on a bucket whose entries are at most this share
# non-zero: mostly exact zeros, as an embedding table's gradient is. On dense
# buckets what it drops of the step's gradient says too
# little of the steps it costs under Adam: on a CNN's dense bucket it came
# under the 1% bound late in training (3-4% at step 100, falling) and the run
# needed 1.38x int8's steps to its target loss.
_SPARSE_SHARE = 0.5
# On a mostly zero bucket top-k sends the bucket's measured share of non-zero
# entries (the most any rank measured), when that is more than min_density:
# every non-zero entry of a step like the measured one. An
# embedding model's bucket is 1.6% non-zero (the rows a batch touches, and
# the dense layers after it); top-k at 1% dropped 0.1-0.2% of its gradient
# there, and its loss settled 0.4-0.6% above uncompressed training's, short
# of a target int8 reached in 194 steps. No headroom: at 1.25x the share,
# an n-gram model (two tables, each 1.7% non-zero) at 0.1 Gbit/s paid 9-15%
# more per step than at 1x (138 against 120-126 ms) for the same 278 steps;
# steps busier than the measured one drop only their smallest entries, and
# the losses stayed within 1.3e-3 of uncompressed training's.
# PowerSGD's gate takes a side's measured step time while the link's
# bandwidth is within this factor of the one it was measured at (the
# agreed readings of one link vary by 10-20% on this 2-core host).
_SAME_LINK = 1.5
# Steps at least between two measurements of what top-k drops: a
# measurement runs every codec over the model's gradient once (measured at every
# round, a 3.2M-entry embedding model's top-k steps took 42.5 ms against 34.6).
_REMEASURE_STEPS = 50


def _powersgd_sizes(shapes: list[tuple[int, ...]], rank: int) -> tuple[float, float, float]:
    """(P+uncompressed elements, Q elements, sum of m*n*r) as PowerSGD sends them
    (with torch's default ``min_compression_rate`` of 2)."""
    p_elems = q_elems = mnr = 0.0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) < 2:
            p_elems += numel
            continue
        m, k = shape[0], numel // shape[0]
        r = min(rank, m, k)
        if (m + k) * r * 2 < m * k:
            p_elems += m * r
            q_elems += k * r
            mnr += m * k * r
        else:
            p_elems += numel
    return p_elems, q_elems, mnr


def predict_parts(
    method: str,
    numel: int,
    shapes: list[tuple[int, ...]],
    world: int,
    link: LinkModel,
    costs: dict[str, float],
    *,
    density: float,
    rank: int,
    itemsize: int = 4,
) -> tuple[float, float]:
    """The cost model, split as the closed loop corrects it: predicted
    (codec seconds, link seconds) to reduce one bucket with ``method``.
    The formulas are C++'s (``csrc/collectives/compressed/CostModel``, bound
    as ``_C.predict_allreduce``), the ones the backend's ``compression="auto"``
    predicts with: a ring allreduce of the payload (none, the casts), int8's
    all-to-all and all-gather of the packed shards, top-k's all-gather of
    ``ceil(density * numel)`` (index, value) pairs, PowerSGD's allreduces of
    P and Q (the sizes its hook would use on ``shapes`` at ``rank``).

    Example::

        >>> link = LinkModel(latency_s=1e-4, bandwidth_bytes_per_s=125e6)  # 1 Gbit/s
        >>> codec_s, wire_s = predict_parts("int8", 1 << 20, [(1024, 1024)], 2, link,
        ...                                 {"int8": 1e-9}, density=0.01, rank=4)
        >>> round(codec_s, 6), round(wire_s, 4)
        (0.001049, 0.0086)
    """
    p_elems = q_elems = 0
    mnr = 0.0
    if method == "powersgd":
        p_elems, q_elems, mnr = _powersgd_sizes(shapes, rank)
    codec_s, wire_s = _C.predict_allreduce(
        method,
        numel,
        itemsize,
        world,
        link.latency_s,
        link.bandwidth_bytes_per_s,
        costs,
        int8_chunk_elems=_INT8_CHUNK,
        topk_density=density,
        powersgd_p=int(p_elems),
        powersgd_q=int(q_elems),
        powersgd_multiply_adds=float(mnr),
    )
    return codec_s, wire_s


def predict_seconds(
    method: str,
    numel: int,
    shapes: list[tuple[int, ...]],
    world: int,
    link: LinkModel,
    costs: dict[str, float],
    *,
    density: float,
    rank: int,
    itemsize: int = 4,
) -> float:
    """The cost model: predicted seconds to reduce one bucket with ``method``
    (:func:`predict_parts`, summed).

    Example::

        >>> link = LinkModel(latency_s=1e-4, bandwidth_bytes_per_s=125e6)  # 1 Gbit/s
        >>> predict_seconds("none", 1 << 20, [(1024, 1024)], 2, link, {},
        ...                 density=0.01, rank=4)  # doctest: +ELLIPSIS
        0.0336...
    """
    codec_s, wire_s = predict_parts(
        method, numel, shapes, world, link, costs, density=density, rank=rank, itemsize=itemsize
    )
    return codec_s + wire_s


def calibrate_codecs(
    numel: int = _CALIBRATION_NUMEL,
    world: int = 2,
    rank: int = 4,
    device: torch.device | None = None,
    sample: torch.Tensor | None = None,
) -> dict[str, float]:
    """Measures each codec's seconds per element on this machine (float32,
    encode + reduce + decode with error feedback, best of 3; C++'s
    ``calibrateAllreduceCodecs``, csrc/collectives/compressed/CodecCalibration,
    which the backend's ``compression="auto"`` times with too), on a bucket of
    ``numel`` elements on ``device`` (default the CPU; a CUDA device times
    xcomm's kernels there, to completion): 16 MiB by default, out of cache
    as DDP's are. ``sample``: time them on these values instead (a real
    gradient bucket: a codec's cost depends on its input, e.g. top-k's on
    a bucket of mostly zeros); ``numel`` is then its size.

    Example::

        >>> costs = calibrate_codecs(numel=1 << 16)
        >>> sorted(costs) == sorted(["bf16", "fp16", "int8", "topk", "powersgd_mnr",
        ...                          "powersgd_pass"])
        True
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    if sample is not None:
        x = sample.detach().reshape(-1).to(device=device, dtype=torch.float32)
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(numel, generator=g).to(device)
    # The one calibration every auto times with (the backend's too).
    compressed = [m for m in METHODS if m != "none"]  # the registry's (hooks/_methods.py)
    return dict(_C.calibrate_allreduce_codecs(x, world, _INT8_CHUNK, rank, compressed))


def compression_errors(
    buffer: torch.Tensor,
    gradients: list[torch.Tensor],
    methods: tuple[str, ...],
    *,
    density: float,
    rank: int,
) -> dict[str, float]:
    """The squared norm each lossy method's round trip loses on one bucket
    (``buffer``, flat; ``gradients``, its parameters' gradients, shaped),
    without error feedback: casts and xcomm's int8 and top-k codecs as they
    run; PowerSGD as the best rank-``rank`` approximation of each matrix it
    compresses (its warm-started power iteration approaches it; vectors and
    matrices too small to pay are sent whole).

    Example::

        >>> g = torch.zeros(1000)
        >>> g[:5] = 1.0  # five non-zeros: top-k at 1% (10 entries) keeps them all
        >>> lost = compression_errors(g, [g], ("none", "topk", "bf16"), density=0.01, rank=4)
        >>> lost["topk"], lost["bf16"]
        (0.0, 0.0)
    """
    x = buffer.detach().reshape(-1).to(torch.float32)
    numel = x.numel()
    lost: dict[str, float] = {}
    for method in methods:
        if method == "none":
            continue
        if method in ("bf16", "fp16"):
            dtype = torch.bfloat16 if method == "bf16" else torch.float16
            lost[method] = float((x.to(dtype).to(torch.float32) - x).square().sum())
            continue
        if method == "powersgd":
            total = 0.0
            # svd_lowrank draws its starting vectors: keep the caller's RNG
            # (the CPU's, and the bucket's GPU's) as it was.
            devices = [buffer.device] if buffer.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(0)
                for g in gradients:
                    if g.dim() < 2:
                        continue
                    mat = g.detach().reshape(g.shape[0], -1).to(torch.float32)
                    m, k = mat.shape
                    r = min(rank, m, k)
                    if (m + k) * r * 2 >= m * k:  # sent whole (_powersgd_sizes' rule)
                        continue
                    top = torch.svd_lowrank(mat, q=min(r + 4, m, k), niter=2)[1][:r]
                    total += max(float(mat.square().sum() - top.square().sum()), 0.0)
            lost[method] = total
            continue
        decoded = torch.empty_like(x)
        if method == "int8":
            codec = _C.Int8Codec(_INT8_CHUNK)
            shard = codec.shard_elems(numel, 1)
            packed = codec.pack_shards_with_feedback(x.clone(), 1, _C.ErrorFeedback(), 0)
            codec.unpack_all(codec.reduce_and_pack(packed, shard, 1.0), shard, decoded)
        elif method == "topk":
            codec = _C.TopKCodec(False, False)
            k = _C.TopKCodec.k_for(numel, density)
            packed = codec.encode_with_feedback(0, x.clone(), k, _C.ErrorFeedback())
            codec.decode(packed.reshape(1, -1), k, decoded, 1.0)
        else:
            raise ValueError(f"xcomm.hooks.auto: unknown method {method!r}; choose from {METHODS}")
        lost[method] = float((decoded - x).square().sum())
    return lost


#: What ``AutoState(objective=...)`` accepts.
OBJECTIVES = ("time_to_accuracy", "step_time")


@dataclass
class AutoState(PicklableState):
    """State of :func:`auto_hook` (see the module docstring for the model).

    Args:
        process_group: the group to reduce over (default: the default group).
        methods: the methods it may choose from (a subset of :data:`METHODS`;
            default :data:`DEFAULT_METHODS`).
        lossless_only: choose only methods that lose nothing (``none``).
        min_density: the least density top-k sends (its accuracy bound); on a
            mostly zero bucket with more non-zero entries than that, it sends
            them all (:meth:`topk_density`).
        powersgd_rank: PowerSGD's rank (its accuracy bound).
        interval: steps between re-evaluations (at least; more where a
            round would cost more than ``probe_fraction`` of them).
        start_iter: steps reduced uncompressed first (>= 2: DDP rebuilds its
            buckets after the first), while the link is measured.
        switch_margin: a bucket changes method only when another is predicted
            this fraction faster.
        probe_fraction: the share of a step the bandwidth probe may take.
        link: a fixed :class:`LinkModel` instead of measuring (a known
            network; tests).
        codec_costs: fixed codec costs (seconds per element, keys as
            :func:`calibrate_codecs` returns) instead of measuring.
        observe: correct the model by what each method is seen to take
            (see the module docstring); ``False`` trusts the model alone
            (with a fixed ``link`` and ``codec_costs``: a hypothetical
            machine, as tests use), and the accuracy charge uses the
            predicted reduction time, not measured steps.
        model: the DDP model, so residuals are checkpointed by parameter.
        objective: ``"time_to_accuracy"`` (default) leaves out a lossy method
            where it drops more than ``max_lost_share`` of the step's gradient
            and charges the rest the share they drop times the step time (see
            the module docstring); ``"step_time"`` chooses by time per step
            alone.
        max_lost_share: under ``"time_to_accuracy"``, the most of the step's
            gradient (share of its squared norm) a cast, int8 or top-k may
            drop on a bucket and still be chosen for it (its accuracy bound).
        powersgd_steps: under ``"time_to_accuracy"``, the most steps to a
            target loss PowerSGD is assumed to need, as a multiple of the
            steps uncompressed training needs (M, its gate: see the module
            docstring); ``math.inf`` never chooses it.

    Example::

        >>> AutoState(lossless_only=True).allowed
        ('none',)
    """

    process_group: dist.ProcessGroup | None = None
    methods: tuple[str, ...] = DEFAULT_METHODS
    lossless_only: bool = False
    min_density: float = 0.01
    powersgd_rank: int = 4
    interval: int = 5
    start_iter: int = 2
    switch_margin: float = 0.1
    probe_fraction: float = 0.01
    link: LinkModel | None = None
    codec_costs: dict[str, float] | None = None
    observe: bool = True
    model: torch.nn.Module | None = field(default=None, repr=False)
    stats: CompressionStats = field(default_factory=CompressionStats)
    objective: str = "time_to_accuracy"
    max_lost_share: float = 0.01
    powersgd_steps: float = 2.5

    def __post_init__(self) -> None:
        self.methods = tuple(self.methods)
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(
                f"xcomm.hooks.AutoState: methods must be a non-empty subset of {METHODS}; "
                f"got {self.methods}"
            )
        if self.start_iter < 2:
            raise ValueError(
                f"xcomm.hooks.AutoState: start_iter must be >= 2, got {self.start_iter}; "
                "DDP rebuilds its buckets after the first iteration"
            )
        if self.interval < 1:
            raise ValueError(f"xcomm.hooks.AutoState: interval must be >= 1, got {self.interval}")
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"xcomm.hooks.AutoState: objective must be one of {OBJECTIVES}, "
                f"got {self.objective!r}"
            )
        if not (0.0 <= self.max_lost_share <= 1.0):
            raise ValueError(
                "xcomm.hooks.AutoState: max_lost_share must be in [0, 1] (a share of the "
                f"step's squared gradient norm), got {self.max_lost_share}"
            )
        if not self.powersgd_steps >= 1.0:
            raise ValueError(
                "xcomm.hooks.AutoState: powersgd_steps must be >= 1 (PowerSGD's steps to a "
                f"target as a multiple of uncompressed training's), got {self.powersgd_steps}"
            )
        if not (0.0 < self.min_density <= 1.0):
            raise ValueError(
                f"xcomm.hooks.AutoState: min_density must be in (0, 1], got {self.min_density}"
            )
        if self.powersgd_rank < 1:
            raise ValueError(
                f"xcomm.hooks.AutoState: powersgd_rank must be >= 1, got {self.powersgd_rank}"
            )
        allowed = [m for m in METHODS if m in self.methods]
        if self.lossless_only:
            allowed = [m for m in allowed if m in _LOSSLESS]
            if not allowed:
                raise ValueError(
                    "xcomm.hooks.AutoState: lossless_only leaves no method: add 'none' to methods"
                )
        self.allowed: tuple[str, ...] = tuple(allowed)
        self.feedback = FeedbackStore(self.model)
        self.order = IssueOrder()
        pg = self.process_group
        self._int8 = Int8State(pg, _INT8_CHUNK, stats=self.stats, feedback=self.feedback)
        self._topk = TopKState(pg, self.min_density, stats=self.stats, feedback=self.feedback)
        self._cast = CastState(pg, stats=self.stats)
        self._powersgd = PowerSGDState(
            pg, matrix_approximation_rank=self.powersgd_rank, start_powerSGD_iter=2
        )
        self._powersgd.stats = self.stats
        self.iter = 0
        self._choices = MethodChoices(self.switch_margin)
        self._measure = MeasuredLink(
            ("allreduce",), _CODEC_KEYS, self.probe_fraction, self.interval
        )
        self._agreed: tuple[LinkModel, dict[str, float]] | None = None
        self._observed = ObservedCosts(self.allowed)
        #: Whether compressing pays in whole steps, measured by trials of
        #: ``none`` (with ``observe`` on a measured link, where ``none`` is allowed).
        self.check = UncompressedCheck()
        #: What each bucket ran at its last step: its decision, or ``none``
        #: on the uncompressed steps of a check's trial.
        self.ran: dict[int, str] = {}
        self._fresh_round = False
        self._in_step = False
        # Each bucket's (numel, parameter shapes, itemsize, device type), to ask
        # whether a new reading of the link would change its method.
        self._bucket_inputs: dict[int, tuple[int, list[tuple[int, ...]], int, str]] = {}
        # The largest bucket of the last uncompressed step (a copy), which the
        # codecs are timed on at the round that starts compression; then None.
        self._sample: torch.Tensor | None = None
        #: What the codecs were last timed on (``explain()`` says it).
        self.calibrated_on = "nothing yet" if self.codec_costs is None else "given (codec_costs)"
        # The accuracy term (objective "time_to_accuracy"): at step
        # _errors_step each bucket's squared norm and what each lossy method
        # loses of it, on this rank; from the next round, agreed as each
        # bucket's lost share of the step's gradient (``lost_share``).
        self._errors_step = self.start_iter - 1
        self._errors: dict[int, dict[str, float]] = {}
        self._energy: dict[int, float] = {}
        #: Each bucket's share of the step's squared gradient norm each lossy
        #: method loses (agreed by all ranks; empty before it is measured).
        self.lost_share: dict[int, dict[str, float]] = {}
        # Each measured bucket's share of non-zero entries on this rank, to agree.
        self._nonzero: dict[int, float] = {}
        # The density top-k sends on each bucket where it is raised above
        # min_density to cover the bucket's non-zero entries (agreed).
        self._topk_density: dict[int, float] = {}
        #: The step time the accuracy term charges by (agreed at the last round).
        self.charged_step_seconds = 0.0
        #: PowerSGD's gate at the last round: ``(open, S_with, S_without)`` in
        #: seconds (None before it was evaluated, and where it does not apply).
        self.powersgd_gate: tuple[bool, float, float] | None = None
        # The agreed step time measured on each side of the gate (True: with
        # PowerSGD running) and the link bandwidth it was measured at.
        self._gate_steps: dict[bool, tuple[float, float]] = {}
        # Whether the gate's S_with and S_without were measured or predicted.
        self._gate_sources = ("predicted", "predicted")

    @property
    def decisions(self) -> dict[int, dict[str, Any]]:
        """Each bucket's method, the step it started, and the predicted
        seconds of every allowed method that chose it."""
        return self._choices.decisions

    @property
    def switches(self) -> int:
        """How many times a bucket changed method."""
        return self._choices.switches

    # -- checkpointing --

    def state_dict(self) -> dict:
        """Counters, decisions, agreed inputs, the observed corrections and
        every method's state; with a fixed ``link`` and ``codec_costs`` and
        ``observe=False`` (no timing decides anything) a resumed run
        continues bit for bit."""
        link, costs = self._agreed if self._agreed else (None, None)
        return {
            "version": 1,
            "iter": self.iter,
            "next_round": self._measure.next_round,
            "decisions": {k: dict(v) for k, v in self.decisions.items()},
            "agreed": None if link is None else [link.latency_s, link.bandwidth_bytes_per_s, costs],
            "feedback": self.feedback.state_dict(),
            "topk_rng": self._topk.codec.get_rng_state(),
            "powersgd": self._powersgd.state_dict(),
            "stats": self.stats.as_dict(),
            "observed": self._observed.state_dict(),
            "lost_share": {str(k): dict(v) for k, v in self.lost_share.items()},
            "topk_density": {str(k): v for k, v in self._topk_density.items()},
            "charged_step_seconds": self.charged_step_seconds,
            "powersgd_gate": None if self.powersgd_gate is None else list(self.powersgd_gate),
            "gate_steps": {str(int(k)): list(v) for k, v in self._gate_steps.items()},
            "check": self.check.state_dict(),
        }

    def load_state_dict(self, d: dict) -> None:
        if d.get("version") != 1:
            raise ValueError(f"xcomm.hooks.AutoState: unknown state version {d.get('version')!r}")
        self.iter = int(d["iter"])
        # Checkpoints from before rounds were spaced by cost: every interval steps.
        rounds_done = max(0, math.ceil((self.iter - self.start_iter) / self.interval))
        self._measure.next_round = int(
            d.get("next_round", self.start_iter + rounds_done * self.interval)
        )
        self._choices.decisions = {int(k): dict(v) for k, v in d["decisions"].items()}
        if d["agreed"] is not None:
            lat, bw, costs = d["agreed"]
            self._agreed = (LinkModel(float(lat), float(bw)), dict(costs))
        self.feedback.load_state_dict(d["feedback"])
        self._topk.codec.set_rng_state(d["topk_rng"])
        self._powersgd.load_state_dict(d["powersgd"])
        self.stats.load_dict(d["stats"])
        self._observed.load_state_dict(d.get("observed", {}))  # none before the closed loop
        self.lost_share = {int(k): dict(v) for k, v in d.get("lost_share", {}).items()}
        self._topk_density = {int(k): float(v) for k, v in d.get("topk_density", {}).items()}
        self.charged_step_seconds = float(d.get("charged_step_seconds", 0.0))
        gate = d.get("powersgd_gate")
        self.powersgd_gate = None if gate is None else (bool(gate[0]), *map(float, gate[1:]))
        self._gate_steps = {
            bool(int(k)): (float(v[0]), float(v[1])) for k, v in d.get("gate_steps", {}).items()
        }
        self.check.load_state_dict(d.get("check", {}))  # none before the check
        if not self.lost_share and self.iter >= self._errors_step:
            # A checkpoint from before the accuracy term: measure it on the next step.
            self._errors_step = self.iter

    # -- explanation --

    @property
    def link_estimate(self) -> LinkModel | None:
        """The link every rank agreed on at the last re-evaluation (None before)."""
        return self._agreed[0] if self._agreed is not None else None

    @property
    def next_round(self) -> int:
        """The step at which the next measuring round is due (the same on every rank)."""
        return self._measure.next_round

    def methods_by_bucket(self) -> list[str]:
        """Each bucket's current method, in bucket order: ``none`` for every
        bucket while the uncompressed check's verdict holds them so (the
        model's choices stay in :attr:`decisions`); during a check's trial
        the model's choices, which alternate steps run (:attr:`ran`: what
        each bucket ran last)."""
        if self._checking and self.check.forces_none:
            return ["none"] * len(self.decisions)
        return [self.decisions[k]["method"] for k in sorted(self.decisions)]

    def explain(self) -> str:
        """A table: each bucket's method and the predicted milliseconds of every
        allowed method that chose it; the corrections applied (each method's
        observed/predicted, and for a method not run yet whose correction it
        takes or that it has none); under each bucket, why a method that has
        not run was not tried."""
        link_line = None
        if self._agreed is not None:
            link = self._agreed[0]
            link_line = (
                f"link: latency {link.latency_s * 1e3:.3f} ms, "
                f"bandwidth {link.bandwidth_bytes_per_s * 8 / 1e9:.3f} Gbit/s (agreed by all ranks)"
                f"\ncodecs timed on: {self.calibrated_on}"
            )
            if self.observe:
                link_line += "\n" + self._observed.explain()
            if self._checking:
                link_line += "\n" + self.check.explain()
            link_line += "\n" + self._objective_line()
        return self._choices.explain("bucket", link_line)

    def _objective_line(self) -> str:
        if self.objective == "step_time":
            return "objective: time per step (lossy methods are not charged for steps)"
        if not self.lost_share:
            line = (
                "objective: time to accuracy; the gradient each method loses is not measured "
                f"yet (at step {self._errors_step}): no method is bounded or charged before"
            )
        else:
            line = (
                "objective: time to accuracy; a lossy method is chosen only where it drops at "
                f"most {100 * self.max_lost_share:.3g}% of the step's gradient (max_lost_share), "
                "and its time adds the share it drops x the step time, "
                f"{self.charged_step_seconds * 1e3:.2f} ms"
            )
        if self.powersgd_gate is not None:
            is_open, with_s, without_s = self.powersgd_gate
            margin = f"{100 * self.switch_margin:.3g}% (switch_margin)"
            with_from, without_from = self._gate_sources
            line += (
                f"\npowersgd gate {'open' if is_open else 'closed'}: step with it "
                f"{with_s * 1e3:.2f} ms ({with_from}) x {self.powersgd_steps:g} (powersgd_steps) = "
                f"{self.powersgd_steps * with_s * 1e3:.2f} ms against {without_s * 1e3:.2f} ms "
                f"without it ({without_from}); it {'closes above' if is_open else 'opens below'} "
                f"that by {margin}"
            )
        elif "powersgd" in self.allowed and self.objective == "time_to_accuracy":
            line += (
                "\npowersgd gate closed: evaluated from the first round after compression starts"
            )
        return line

    # -- measurement and agreement --

    def candidates(self, device_type: str) -> tuple[str, ...]:
        """The allowed methods for a bucket on ``device_type``: all of them on
        the CPU, and on a GPU where xcomm has its CUDA codec kernels
        (``xcomm._C.cuda_codecs``); without them, on a GPU, those that run
        there (``none``, ``bf16``, ``fp16``).

        Example::

            >>> AutoState().candidates("cpu")
            ('none', 'bf16', 'int8', 'topk', 'powersgd')
        """
        if device_type == "cpu" or _C.cuda_codecs:
            return self.allowed
        found = tuple(m for m in self.allowed if m in _ON_DEVICE)
        if not found:
            raise ValueError(
                f"xcomm.hooks.auto_hook: on {device_type} buckets auto can choose only "
                f"{_ON_DEVICE} here: this xcomm was built without its CUDA codec kernels "
                "(xcomm._C.cuda_codecs is False; build it where a CUDA toolkit is found), so "
                f"its int8 and top-k would run on the host; methods={self.allowed} leaves none "
                "of them"
            )
        return found

    def _round(self, group: dist.ProcessGroup | None, world: int, device: torch.device) -> None:
        """At the start of a re-evaluation step: probe the link with one
        allreduce on the buckets' device (the path their collectives take)
        and agree on every input (:class:`MeasuredLink`)."""

        def probe(nbytes: int) -> float:
            t = torch.zeros(max(1, nbytes // 4), device=device)
            dist.all_reduce(t, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # NCCL's sync op returns once enqueued
            return float(allreduce_bytes(t.nbytes, world))

        def calibrate() -> dict[str, float]:
            if self.codec_costs is not None:
                return self.codec_costs
            sample, self._sample = self._sample, None
            if sample is None:
                # Nothing compressed yet: a small stand-in, replaced at
                # start_iter; after it (a resumed run) a full synthetic bucket.
                numel = _STAND_IN_NUMEL if self.iter < self.start_iter else _CALIBRATION_NUMEL
                self.calibrated_on = f"randn, {numel} elements"
                return calibrate_codecs(numel, world=world, rank=self.powersgd_rank, device=device)
            self.calibrated_on = f"this model's largest bucket, {sample.numel()} elements"
            return calibrate_codecs(
                world=world, rank=self.powersgd_rank, device=device, sample=sample
            )

        if self._sample is not None and self.iter >= self.start_iter:
            self._measure.local_costs = None  # time the codecs again, on the sample
        observed = self._observed.local() if self.observe else []
        errors = self._local_lost_share()
        trial = self.check.local_trial_seconds(self.iter) if self._checking else []
        links, costs = self._measure.agree(
            group,
            {"allreduce": probe},
            calibrate,
            step=self.iter,
            fixed=None if self.link is None else {"allreduce": self.link},
            device=device,
            matters=lambda links, costs: any(
                self._choices.would_switch(
                    index,
                    self._charged(
                        index, self._predict(index, *inputs, world, links["allreduce"], costs)
                    ),
                )
                for index, inputs in self._bucket_inputs.items()
            ),
            extra={"observed": observed, "errors": errors, "trial": trial},
        )
        agreed_extra = self._measure.agreed_extra
        if self.observe:
            self._observed.update(agreed_extra["observed"])
            self._observed.set_link(1.0 / links["allreduce"].bandwidth_bytes_per_s)
        if errors:
            self._agree_lost_share(agreed_extra["errors"])
        agreed_trial = agreed_extra["trial"]
        if self.iter < self.start_iter:  # one round to start with, the next at start_iter
            self._measure.next_round = self.start_iter
        self._agreed = (links["allreduce"], costs)
        self._fresh_round = True
        if self.lost_share or (self.iter >= self.start_iter and self._bucket_inputs):
            self.charged_step_seconds = self._step_seconds(world)
            # A trial's recent steps are partly uncompressed: not a side's step.
            self._evaluate_powersgd_gate(world, record=not agreed_trial)
        if self._checking and device.type == "cpu" and self.iter >= self.start_iter:
            due = self.check.at_round(
                self.iter,
                self._measure.agreed_step_seconds,
                compressing=any(d["method"] != "none" for d in self.decisions.values()),
                none_can_win=self._uncompressed_seconds(world) < self._measure.agreed_step_seconds,
                trial_s=agreed_trial,
            )
            if due is not None:
                # A trial's steps are timed up to its end, not past it, and
                # no round comes between: a round's fresh choice could put
                # its compressed side on none (or another method) midway.
                self._measure.next_round = due
        upcoming = self._measure.next_round - 1
        if (
            self.iter >= self.start_iter
            and "topk" in self.allowed
            and upcoming >= self._errors_step + _REMEASURE_STEPS
        ):
            # What top-k drops depends on the gradient's shape, which
            # training changes: early gradients sit in a few large entries
            # (top-k 1% dropped 19% of a byte-level LM's at step 2), later
            # ones spread. Measure again on the step before a round (the same
            # step on every rank: agreed), at most every _REMEASURE_STEPS
            # steps (each costs a pass of every codec).
            self._errors_step = upcoming

    # -- the accuracy term (objective "time_to_accuracy") --

    def _measure_errors(self, bucket: dist.GradBucket, world: int) -> None:
        """What each lossy candidate would lose of this bucket (before it is
        reduced or its residual added), and the bucket's inputs."""
        buffer = bucket.buffer()
        shapes = [tuple(p.shape) for p in bucket.parameters()]
        index = bucket.index()
        self._bucket_inputs[index] = (
            buffer.numel(),
            shapes,
            buffer.element_size(),
            buffer.device.type,
        )
        # PowerSGD is judged by its step gate, not by what it drops (and
        # measuring that would cost a low-rank SVD of every matrix).
        lossy = tuple(
            m for m in self.candidates(buffer.device.type) if m not in ("none", "powersgd")
        )
        # Counted only where top-k may run (on a GPU the count waits for the device).
        nonzero = 1.0
        if "topk" in lossy:
            nonzero = int(torch.count_nonzero(buffer.detach())) / max(buffer.numel(), 1)
        # Top-k takes only mostly zero buckets (at most _SPARSE_SHARE non-zero).
        dense = "topk" in lossy and nonzero > _SPARSE_SHARE
        self._nonzero[index] = nonzero
        self._energy[index] = float(buffer.detach().float().square().sum())
        self._errors[index] = compression_errors(
            buffer,
            bucket.gradients(),
            tuple(m for m in lossy if not (dense and m == "topk")),
            density=self._covering_density(nonzero),
            rank=self.powersgd_rank,
        )
        if dense:
            self._errors[index]["topk"] = math.inf  # not a candidate (see _SPARSE_SHARE)

    def _covering_density(self, nonzero: float) -> float:
        """Top-k's density on a bucket whose share of non-zero entries is
        ``nonzero``: ``min_density``, or enough to send every non-zero entry
        where that is more and the bucket is mostly zeros."""
        if nonzero > _SPARSE_SHARE:
            return self.min_density
        return max(self.min_density, nonzero)

    def topk_density(self, index: int) -> float:
        """The density top-k sends on bucket ``index``: ``min_density``, or
        more on a mostly zero bucket, to cover its non-zero entries (agreed
        by all ranks at the round after they were measured).

        Example::

            >>> AutoState().topk_density(0)
            0.01
        """
        return self._topk_density.get(index, self.min_density)

    def _local_lost_share(self) -> list[float]:
        """This rank's lost shares, bucket by bucket and method by method in a
        fixed order, to agree at the round after they were measured (every
        rank measures at the same step, so every rank sends them or none)."""
        if not self._errors or self.iter <= self._errors_step:
            return []
        total = max(sum(self._energy.values()), 1e-30)
        shares = [
            self._errors[index][m] / total
            for index in sorted(self._errors)
            for m in sorted(self._errors[index])
        ]
        return shares + [self._nonzero[index] for index in sorted(self._errors)]

    def _agree_lost_share(self, agreed: list[float]) -> None:
        values = iter(agreed)
        self.lost_share = {
            index: {m: next(values) for m in sorted(self._errors[index])}
            for index in sorted(self._errors)
        }
        # The most non-zero entries any rank saw: top-k's k covers them on every rank.
        self._topk_density = {}
        for index in sorted(self._errors):
            density = self._covering_density(next(values))
            if density != self.min_density:
                self._topk_density[index] = density
        self._errors, self._energy, self._nonzero = {}, {}, {}

    def _step_seconds(self, world: int) -> float:
        """The step time the accuracy term charges by: the agreed median of
        recent steps, and at least what the model predicts the buckets'
        reductions take with their current methods (on a fixed ``link`` the
        measured steps do not see that link)."""
        assert self._agreed is not None
        link, costs = self._agreed
        reductions = 0.0
        for index, (numel, shapes, itemsize, device_type) in self._bucket_inputs.items():
            # Before the first choice the bucket went uncompressed ("none", allowed or not).
            current = self.decisions.get(index, {}).get("method", "none")
            predicted = self._predict(
                index, numel, shapes, itemsize, device_type, world, link, costs
            )
            if current not in predicted:
                predicted[current] = sum(
                    self._parts(current, index, numel, shapes, itemsize, world, link, costs)
                )
            reductions += predicted[current]
        # observe=False: no timing decides anything (a rerun, or a copy of the
        # state in a spawned process, chooses bit for bit what this one does).
        measured = self._measure.agreed_step_seconds if self.observe else 0.0
        return max(measured, reductions)

    @property
    def _checking(self) -> bool:
        """Whether the uncompressed check runs: measured steps decide it, so
        with ``observe`` on a measured link (a fixed one is not what the
        steps see), and where ``none`` is allowed."""
        return self.observe and self.link is None and "none" in self.allowed

    def _uncompressed_seconds(self, world: int) -> float:
        """The buckets' reductions uncompressed, as predicted (corrected):
        at least what a step takes without compression."""
        assert self._agreed is not None
        link, costs = self._agreed
        return sum(
            self._observed.predict(
                "none", *self._parts("none", index, numel, shapes, itemsize, world, link, costs)
            )
            for index, (numel, shapes, itemsize, _) in self._bucket_inputs.items()
        )

    def _evaluate_powersgd_gate(self, world: int, record: bool = True) -> None:
        """PowerSGD's gate (module docstring): is the whole step with it, M
        times over, predicted no slower than the step without it? From the
        agreed inputs only, so every rank opens or closes it alike. With
        ``record`` off (the round that ends a check's trial, whose recent
        steps are partly uncompressed) the measured step is not kept as the
        current side's."""
        inputs_by_bucket = self._bucket_inputs.values()
        if self.objective != "time_to_accuracy" or not any(
            "powersgd" in self.candidates(inputs[3]) for inputs in inputs_by_bucket
        ):
            return
        assert self._agreed is not None
        if not any(index in self.decisions for index in self._bucket_inputs):
            # The round that starts compression: its step time is of
            # uncompressed steps and no method has been observed, so its
            # prediction is the probe and calibration alone. Opening on it
            # put the LM on PowerSGD for its first rounds in one run of two
            # (320 steps to target against int8's 280). Closed until a round
            # with a method running.
            self.powersgd_gate = None
            return
        link, costs = self._agreed
        current_s = without_s = with_s = 0.0
        for index, inputs in self._bucket_inputs.items():
            numel, shapes, itemsize, device_type = inputs
            raw = self._predict(index, numel, shapes, itemsize, device_type, world, link, costs)
            current = self.decisions.get(index, {}).get("method", "none")
            if current not in raw:
                raw[current] = sum(
                    self._parts(current, index, numel, shapes, itemsize, world, link, costs)
                )
            current_s += raw[current]
            others = self._bounded(index, {m: t for m, t in raw.items() if m != "powersgd"})
            best_other = raw[min(others, key=others.__getitem__)] if others else raw[current]
            without_s += best_other
            with_s += min(best_other, raw.get("powersgd", best_other))
        rest = max(self.charged_step_seconds - current_s, 0.0)
        with_s, without_s = rest + with_s, rest + without_s
        # The side the run is on is its measured step; the other side is
        # this step less (or plus) the predicted saving, unless it has run on
        # a link like this one: then its measured step. Predicted, a saving
        # 10-20% above the measured one put the two sides' thresholds within
        # noise of each other, and the gate flipped every round or two (the
        # LM at 0.1 Gbit/s: 4-10 times a run, paying for both methods).
        running = any(d.get("method") == "powersgd" for d in self.decisions.values())
        measured = self._measure.agreed_step_seconds if self.observe else 0.0
        if measured > 0.0 and record:
            self._gate_steps[running] = (measured, link.bandwidth_bytes_per_s)
        other = self._gate_steps.get(not running)
        sources = ["predicted", "predicted"]  # S_with's and S_without's
        sources[0 if running else 1] = "measured" if measured > 0.0 else "predicted"
        if other is not None and abs(math.log(other[1] / link.bandwidth_bytes_per_s)) <= math.log(
            _SAME_LINK
        ):
            if running:
                without_s = other[0]
            else:
                with_s = other[0]
            sources[1 if running else 0] = "measured"
        self._gate_sources = (sources[0], sources[1])
        # Hysteresis both ways, as for a bucket's method: it opens only on a
        # win by switch_margin and closes only on a loss by it. Opening on
        # any win let one noisy step time open it: on the LM at 0.1 Gbit/s
        # under load (M x S_with about 8% above S_without) it opened in three
        # runs of five, each time until PowerSGD was observed.
        was_open = self.powersgd_gate is not None and self.powersgd_gate[0]
        margin = 1.0 + self.switch_margin
        if was_open:
            is_open = self.powersgd_steps * with_s <= without_s * margin
        else:
            is_open = self.powersgd_steps * with_s * margin <= without_s
        self.powersgd_gate = (is_open, with_s, without_s)

    def _bounded(self, index: int, predicted: dict[str, float]) -> dict[str, float]:
        """``predicted`` without the casts, int8 and top-k where they drop more
        than ``max_lost_share`` of the step's gradient on the bucket, and the
        rest plus their accuracy charge. If every method drops more, the one
        that drops least (``methods`` left nothing under the bound)."""
        if index not in self.lost_share or not predicted:
            return predicted
        share = self.lost_share[index]
        step_s = self.charged_step_seconds
        kept = [m for m in predicted if share.get(m, 0.0) <= self.max_lost_share]
        if not kept:
            kept = [min(predicted, key=lambda m: share.get(m, 0.0))]
        return {m: predicted[m] + share.get(m, 0.0) * step_s for m in kept}

    def _charged(self, index: int, predicted: dict[str, float]) -> dict[str, float]:
        """Under ``"time_to_accuracy"``: ``predicted`` bounded and charged
        (:meth:`_bounded`), PowerSGD kept, uncharged, only while its gate is
        open (it is closed until first evaluated), or where ``methods`` left
        nothing else."""
        if self.objective == "step_time":
            return predicted
        gate_open = self.powersgd_gate is not None and self.powersgd_gate[0]
        bounded = self._bounded(index, {m: t for m, t in predicted.items() if m != "powersgd"})
        if "powersgd" in predicted and (gate_open or not bounded):
            bounded["powersgd"] = predicted["powersgd"]
        return bounded

    def _choose(self, bucket: dist.GradBucket, world: int) -> str:
        index, numel = bucket.index(), bucket.buffer().numel()
        method = self._choices.current(index, numel, self.iter, self._fresh_round)
        if method is not None:
            return method
        assert self._agreed is not None
        link, costs = self._agreed
        shapes = [tuple(p.shape) for p in bucket.parameters()]
        itemsize = bucket.buffer().element_size()
        device_type = bucket.buffer().device.type
        self._bucket_inputs[index] = (numel, shapes, itemsize, device_type)
        raw = self._predict(index, numel, shapes, itemsize, device_type, world, link, costs)
        predicted = self._charged(index, raw)
        method = self._choices.choose(index, numel, self.iter, predicted)
        notes = []
        if self.observe:
            notes = self._never_run_notes(
                method, predicted, index, numel, shapes, itemsize, world, link, costs
            )
        if "powersgd" in raw and "powersgd" not in predicted:
            notes.append(
                "powersgd not chosen: its step gate is closed (explain()'s objective line)"
            )
        if predicted is not raw and index in self.lost_share:
            shares = self.lost_share[index]
            lost = ", ".join(
                f"{m} {100 * share:.3g}% (+{(predicted[m] - raw[m]) * 1e3:.2f} ms)"
                for m, share in shares.items()
                if m in predicted and math.isfinite(share)
            )
            if lost:
                notes.append(f"accuracy charge: share of the step's gradient lost: {lost}")
            over = [m for m in raw if m not in predicted and m != "powersgd"]
            if "topk" in over and math.isinf(shares.get("topk", 0.0)):
                over.remove("topk")
                notes.append(
                    f"topk not chosen: more than {100 * _SPARSE_SHARE:.3g}% of the bucket's "
                    "entries are non-zero (it takes only mostly zero buckets)"
                )
            if over:
                dropped = ", ".join(f"{m} {100 * shares.get(m, 0.0):.3g}%" for m in over)
                notes.append(
                    f"not chosen, dropping more than max_lost_share "
                    f"{100 * self.max_lost_share:.3g}% of the step's gradient: {dropped}"
                )
        if "topk" in predicted and index in self._topk_density:
            notes.append(
                f"topk sends {100 * self._topk_density[index]:.3g}% of the entries here, above "
                f"min_density {100 * self.min_density:.3g}%: every non-zero one "
                "(the share of the rank that measured the most)"
            )
        self.decisions[index]["notes"] = notes
        return method

    def _never_run_notes(
        self,
        chosen: str,
        predicted: dict[str, float],
        index: int,
        numel: int,
        shapes: list[tuple[int, ...]],
        itemsize: int,
        world: int,
        link: LinkModel,
        costs: dict[str, float],
    ) -> list[str]:
        """For each candidate that has not run yet: its prediction on its
        calibration, the correction applied (whose, or none yet) and why it
        was not tried (or that it was chosen untried)."""
        notes = []
        for m, t in predicted.items():
            if m == "none" or self._observed.key(m) in self._observed.seen:
                continue
            calibrated = self._observed.base(
                m, *self._parts(m, index, numel, shapes, itemsize, world, link, costs)
            )
            source = self._observed.inherited_from(m)
            if source is None:
                how = (
                    f"predicted {t * 1e3:.2f} ms on its calibration (uncorrected: no "
                    "compressed method has run yet)"
                )
            else:
                how = (
                    f"{calibrated * 1e3:.2f} ms on its calibration, {t * 1e3:.2f} ms corrected "
                    f"by {source}'s x{self._observed.factor(m):.2f}"
                )
            if m == chosen:
                notes.append(f"{m} chosen before it has run: {how}")
                continue
            why = "slower than" if t >= predicted[chosen] else "within the switch margin of"
            notes.append(
                f"{m} not tried (never run here): {how}, {why} {chosen}'s "
                f"{predicted[chosen] * 1e3:.2f} ms"
            )
        return notes

    def _predict(
        self,
        index: int,
        numel: int,
        shapes: list[tuple[int, ...]],
        itemsize: int,
        device_type: str,
        world: int,
        link: LinkModel,
        costs: dict[str, float],
    ) -> dict[str, float]:
        """Every candidate method's predicted seconds for bucket ``index``
        (corrected by what the methods were seen to take)."""
        return {
            m: self._observed.predict(
                m, *self._parts(m, index, numel, shapes, itemsize, world, link, costs)
            )
            for m in self.candidates(device_type)
        }

    def _parts(
        self,
        method: str,
        index: int,
        numel: int,
        shapes: list[tuple[int, ...]],
        itemsize: int,
        world: int,
        link: LinkModel,
        costs: dict[str, float],
    ) -> tuple[float, float]:
        """The model's (codec seconds, link seconds) for bucket ``index``."""
        return predict_parts(
            method,
            numel,
            shapes,
            world,
            link,
            costs,
            density=self.topk_density(index),
            rank=self.powersgd_rank,
            itemsize=itemsize,
        )

    def _watch(
        self,
        fut: torch.futures.Future,
        bucket: dist.GradBucket,
        method: str,
        step: int,
        issued_at: float,
    ) -> None:
        """Times this bucket's reduction, issued at ``issued_at``
        (``time.perf_counter()``), for the closed loop; from step 1 (step 0
        runs DDP's first buckets and pays first-touch costs)."""
        buffer = bucket.buffer()
        # CPU buckets only: a NCCL future completes once its kernels are
        # queued, so its done callback would time the enqueue, not the
        # reduction (to be measured on a GPU before the loop covers them).
        if not self.observe or self._agreed is None or step < 1 or buffer.device.type != "cpu":
            return
        link, costs = self._agreed
        shapes = [tuple(p.shape) for p in bucket.parameters()]
        world = group_size(self.process_group)
        parts = self._parts(
            method,
            bucket.index(),
            buffer.numel(),
            shapes,
            buffer.element_size(),
            world,
            link,
            costs,
        )
        self._observed.watch(fut, method, self._observed.base(method, *parts), issued_at)


def _ordered(
    state: AutoState, bucket: dist.GradBucket, issue: Any
) -> torch.futures.Future[torch.Tensor]:
    """Runs a one-collective method in its turn of the shared issue order."""
    ready, issued = state.order.next_turn()

    def start(f: torch.futures.Future) -> torch.futures.Future:
        try:
            fut = issue()
        except BaseException as e:
            mark_issued(issued, e)
            raise
        mark_issued(issued)
        return fut

    if ready.done() and not future_failed(ready):
        # Its turn already (the usual case: the bucket before issued its
        # last collective from this thread): issue now and hand DDP the
        # method's own future, without a forwarding future and callback.
        return start(ready)
    return then_collective(ready, start, bucket.buffer().device)


def auto_hook(state: AutoState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket with the method the cost model predicts fastest."""
    buffer = bucket.buffer()
    check_floating("auto_hook", buffer)
    group, world = state.process_group, group_size(state.process_group)
    if not state._in_step:  # the first bucket of a step: nothing of ours in flight
        state._in_step = True
        took = state._measure.step_started(
            comparable=not state._checking or state.check.settled(state.iter - 1)
        )
        if took is not None and state._checking:
            state.check.record(state.iter - 1, took)
        due = state.iter >= state._measure.next_round
        if due or state._agreed is None:
            state._round(group, world, buffer.device)
    if "powersgd" in state.candidates(buffer.device.type):
        # PowerSGD numbers parameters in the order it first sees them; seeing
        # every bucket from the first step keeps that order the same in a
        # resumed run, whichever bucket it compresses first.
        state._powersgd.observe_layout(bucket.index(), bucket, buffer)
    step = state.iter
    if step == state._errors_step and state.objective == "time_to_accuracy":
        state._measure_errors(bucket, world)
    if bucket.is_last():
        state.iter += 1
        state._in_step = False
    if step < state.start_iter:
        keep = state.codec_costs is None and step == state.start_iter - 1
        if keep and (state._sample is None or buffer.numel() > state._sample.numel()):
            state._sample = buffer.detach().clone()  # before the allreduce averages it
        state.ran[bucket.index()] = "none"
        issued_at = time.perf_counter()
        fut = allreduce_mean(state, bucket, state.stats)
        state._watch(fut, bucket, "none", step, issued_at)
        return fut

    t0 = now_us() if timeline_enabled() else 0
    previous = state.decisions.get(bucket.index(), {}).get("method")
    method = state._choose(bucket, world)
    if state._checking and state.check.runs_none(step):
        # The uncompressed check holds this step uncompressed (its verdict,
        # or a trial's uncompressed step); decisions keep the model's choice,
        # which a trial's compressed steps run: it is not a choice of none
        # that hysteresis would hold against compressing again.
        method = "none"
    state.ran[bucket.index()] = method
    if bucket.is_last():
        state._fresh_round = False
    if previous == "powersgd" and method != "powersgd":
        state._powersgd.release_error(bucket)  # the method that now runs sends it
    if method in ("none", "bf16", "fp16", "powersgd"):
        view = state.feedback.view(bucket)
        state.feedback.flush(view)  # what earlier lossy steps owe is sent now
        view.write_back()
    state._powersgd.iter = step  # torch's PowerSGDState counts in its hook; this one counts here
    issued_at = time.perf_counter()  # the codec's work on this thread counts too
    if method == "none":
        fut = _ordered(state, bucket, lambda: allreduce_mean(state, bucket, state.stats))
    elif method in ("bf16", "fp16"):
        cast = bf16_cast_hook if method == "bf16" else fp16_cast_hook
        fut = _ordered(state, bucket, lambda: cast(state._cast, bucket))
    elif method == "topk":
        density = state.topk_density(bucket.index())
        fut = _ordered(
            state, bucket, lambda: topk_allreduce(state._topk, bucket, step, density=density)
        )
    elif method == "int8":
        fut = int8_allreduce(state._int8, bucket, step, state.order)
    else:
        fut = powersgd_allreduce(state._powersgd, bucket, state.order)
    state._watch(fut, bucket, method, step, issued_at)
    record_op(f"AUTO:{method}", buffer.nbytes, 0)
    if t0:
        d = state.decisions[bucket.index()]
        add_span(
            f"auto: {method}",
            "auto",
            "xcomm auto",
            t0,
            now_us(),
            {
                "bucket": bucket.index(),
                "step": step,
                **{f"predicted_ms_{m}": round(t * 1e3, 3) for m, t in d["predicted_s"].items()},
            },
        )
    return fut
