"""The measured inputs of ``auto``'s cost models, agreed by every rank.

Both ``auto`` choosers (:mod:`.auto` for DDP buckets, :mod:`.fsdp` for
FSDP2's reduce-scatters) predict each method's time from the same kind of
inputs: the link's latency, its seconds per byte for the collectives the
methods use, and each codec's CPU seconds per element on this machine. The
link is measured by the collectives themselves (probes on the group), the
codecs by timing them once; then one allreduce MAX makes every input the
same on every rank, so every rank computes the same choice and their
collectives match. :class:`MeasuredLink` does that part;
:class:`MethodChoices` keeps each key's choice with hysteresis.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import _C


@dataclass
class LinkModel:
    """A link as collectives see it: ``latency_s`` per collective plus
    ``bytes / bandwidth_bytes_per_s`` (bytes on one rank's link).

    Example::

        >>> LinkModel(latency_s=1e-4, bandwidth_bytes_per_s=125e6).seconds(2, 125e6)
        1.0002
    """

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and self.bandwidth_bytes_per_s > 0):
            raise ValueError(
                "xcomm.hooks.LinkModel: latency_s must be >= 0 and bandwidth_bytes_per_s > 0, "
                f"got {self.latency_s} and {self.bandwidth_bytes_per_s}"
            )

    def seconds(self, collectives: int, wire_bytes: float) -> float:
        return collectives * self.latency_s + wire_bytes / self.bandwidth_bytes_per_s


#: A probe: issues one collective of about ``nbytes`` on the group and
#: returns the bytes it put on this rank's link, in the unit its link is
#: modelled in.
Probe = Callable[[int], float]


class MeasuredLink:
    """Measures the link (one probe per collective kind) and each codec's
    cost, and agrees them across ranks.

    Each round: each probe runs twice back to back and the second is timed,
    then one allreduce MAX agrees every input (its duration, the ranks being
    in step: the latency). The untimed first run lines the ranks up (their
    backward passes end apart; the timed one must time the link, not the
    wait for the slower rank) and drains what a link lets through faster
    than its sustained rate after an idle moment (a token-bucket burst,
    switch buffers): gradients go out back to back, at the sustained rate,
    and a probe that fit in the burst read a 3 Gbit/s emulated link as
    several times faster. The latency is the least of the recent agreements
    and may explain at most half of a probe, so a noisy latency cannot make
    the link look infinitely fast; the agreed latency is the least over
    ranks (the first rank at an agreement also waits for the others). The
    link used is the median of the last three rounds' agreed readings, so
    one noisy probe (a 3 Gbit/s emulated link once read under 1 Gbit/s, once
    over 8) cannot flip a choice. A reading more than 2x off the median
    (before or after it joined), where it would change a choice, makes the
    next round due at the next step (up to three in a row), so a real change
    is followed within a step of the round that saw it, and a noisy one is
    outvoted at the cost of one round. Probes are sized from the faster of
    the median and the newest reading: a probe too small for its link reads
    it slow, and sizing from that reading would keep it small.

    Probes are sized to cost about ``probe_fraction`` of the ``interval``
    steps between rounds, growing at most 4x a round, and are at least 64 kB
    (a smaller one measures a link's burst, not the link). Where a round
    costs more than that (a small model on a slow link: 20 ms steps at 0.1
    Gbit/s), rounds are spaced further apart so they still take about
    ``probe_fraction`` of the training time. A round's cost is what its
    bytes and latency predict plus what the recent rounds took beyond
    theirs (the median of the last three, agreed as the slowest rank's):
    the backward pass waits for a round, and on a busy host its collectives
    also wait to line up and on the scheduler. What a round took is its
    own duration plus the hidden cost of the round before it: what that
    round's whole step took beyond the median of the steps before it and
    beyond the round's duration (:meth:`step_started`). A round delays the
    buckets' own collectives behind it, which its duration does not see: on
    the DDP sweep (the MLP at 0.1 Gbit/s) rounds came 8 steps apart and
    each step with one took about 87 ms over the others', where the rounds'
    durations predicted 14 ms: 5.5% of the run instead of 1%. The next
    round is due at step
    :attr:`next_round`, computed from agreed values only, so every rank runs
    it at the same step.

    The arithmetic (readings, latency, probe sizing, spacing, confirmations)
    is C++'s (``_C.LinkEstimate``, csrc/collectives/compressed/LinkEstimate),
    the one the backend's ``compression="auto"`` measures with too; this
    class runs the probes and the agreement on the hooks' group.

    Args:
        kinds: the probes' names, in the order their links are agreed.
        codec_keys: the codec costs to agree, in order.
        probe_fraction: the share of the training time rounds may take.
        interval: the fewest steps between rounds.
    """

    #: The smallest probe, bytes.
    MIN_PROBE_BYTES = _C.LinkEstimate.MIN_PROBE_BYTES
    #: A reading this far off the median is confirmed by a round at the next step.
    CHANGE_FACTOR = _C.LinkEstimate.CHANGE_FACTOR
    #: The most rounds in a row due at the next step.
    MAX_CONFIRMATIONS = _C.LinkEstimate.MAX_CONFIRMATIONS

    def __init__(
        self,
        kinds: tuple[str, ...],
        codec_keys: tuple[str, ...],
        probe_fraction: float,
        interval: int,
    ) -> None:
        self.kinds = kinds
        self.codec_keys = codec_keys
        self._estimate = _C.LinkEstimate(len(kinds), probe_fraction, interval)
        self.step_times: list[float] = []
        self._step_start: float | None = None
        self._round_in_step = False
        self.local_costs: dict[str, float] | None = None
        #: The links (by kind) and codec costs every rank agreed on last.
        self.agreed: tuple[dict[str, LinkModel], dict[str, float]] | None = None
        #: The step at which the next round is due.
        self.next_round = 0
        #: The ``extra`` values every rank agreed on last.
        self.agreed_extra: dict[str, list[float]] = {}
        #: The median recent step time, the slowest rank's, as the last round agreed it.
        self.agreed_step_seconds = 0.0
        #: What the last steps with a round took beyond the median step
        #: before them and the round's own duration, seconds (this rank's;
        #: the newest last).
        self.round_step_hidden: list[float] = []
        self._round_took = 0.0  # the last round's own duration, seconds

    @property
    def interval(self) -> int:
        return int(self._estimate.interval)

    @property
    def probe_fraction(self) -> float:
        return float(self._estimate.probe_fraction)

    @property
    def probe_bytes(self) -> int:
        """The next probe's size, bytes."""
        return int(self._estimate.probe_bytes)

    @probe_bytes.setter
    def probe_bytes(self, nbytes: int) -> None:
        self._estimate.probe_bytes = int(nbytes)

    @property
    def latencies(self) -> list[float]:
        """This rank's last agreements' durations, seconds (the least is the latency)."""
        return list(self._estimate.agreements)

    @latencies.setter
    def latencies(self, seconds: Sequence[float]) -> None:
        self._estimate.agreements = list(seconds)

    @property
    def round_overheads(self) -> list[float]:
        """What the last rounds took beyond what their bytes and latency
        explain (agreed: the slowest rank's), seconds; the newest last."""
        return list(self._estimate.round_overheads)

    def step_started(self, comparable: bool = True) -> float | None:
        """Called at the start of each step: the probes' budget is a share of
        the median recent step time (of steps without a round: a round's own
        cost must not size the next). Returns the step just ended's seconds,
        or None if it ran a round (or is the first). A step that ran a
        round is kept as what it took beyond the median of the five steps
        before it and the round's own duration (the round's hidden cost),
        where ``comparable`` (the caller's word that they and it reduced
        alike: not a trial of uncompressed steps)."""
        now = time.perf_counter()
        took = None
        if self._step_start is not None and not self._round_in_step:
            took = now - self._step_start
            self.step_times = [*self.step_times[-9:], took]
        elif self._step_start is not None and comparable and self.step_times:
            recent = sorted(self.step_times[-5:])
            beyond = now - self._step_start - recent[len(recent) // 2] - self._round_took
            self.round_step_hidden = [*self.round_step_hidden[-2:], max(beyond, 0.0)]
        self._step_start = now
        self._round_in_step = False
        return took

    def agree(
        self,
        group: dist.ProcessGroup | None,
        probes: Mapping[str, Probe] | None,
        calibrate: Callable[[], dict[str, float]],
        *,
        step: int,
        fixed: Mapping[str, LinkModel] | None = None,
        matters: Callable[[dict[str, LinkModel], dict[str, float]], bool] | None = None,
        device: torch.device | None = None,
        extra: Mapping[str, Sequence[float]] | None = None,
    ) -> tuple[dict[str, LinkModel], dict[str, float]]:
        """One round at ``step``: probe (unless ``fixed`` links are given),
        agree, schedule the next round; returns the agreed links by kind and
        codec costs. ``matters(links, costs)`` says whether the newest
        reading, were it the link, would change a choice: only then is a
        reading far off the median confirmed at the next step. ``extra``
        holds the caller's own values by part (:class:`ObservedCosts`'
        ratios, a trial's step times), each agreed in the same allreduce as
        the MAX over ranks, into :attr:`agreed_extra` under the same
        names."""
        self._round_in_step = True
        agree_start = time.perf_counter()
        if self.local_costs is None:
            self.local_costs = dict(calibrate())
        round_start = time.perf_counter()
        estimate = self._estimate
        seconds_per_byte = dict.fromkeys(self.kinds, 0.0)
        if fixed is None:
            assert probes is not None
            nbytes = estimate.probe_bytes
            for kind in self.kinds:
                probes[kind](nbytes)  # lines the ranks up, drains a burst
                t0 = time.perf_counter()
                wire = probes[kind](nbytes)
                seconds_per_byte[kind] = estimate.seconds_per_byte(time.perf_counter() - t0, wire)
        recent = sorted(self.step_times[-5:])
        step_seconds = recent[len(recent) // 2] if recent else 0.0  # median: robust to pauses
        # The latency is agreed as the least over ranks (negated, so the one
        # MAX agrees it). What this round has cost so far (the backward pass
        # waits for it), plus the previous agreement's duration as this one's.
        spent = time.perf_counter() - round_start + estimate.last_agreement
        if self.round_step_hidden:  # what the last round's step took beyond it and the others
            spent += self.round_step_hidden[-1]
        local = [-estimate.latency, step_seconds, spent]
        local += [seconds_per_byte[k] for k in self.kinds]
        local += [self.local_costs[k] for k in self.codec_keys]
        parts = {name: list(values) for name, values in (extra or {}).items()}
        for values in parts.values():
            local += values
        # On the buckets' device: a NCCL group has no CPU collectives.
        agreed = torch.tensor(local, dtype=torch.float64, device=device)
        t0 = time.perf_counter()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        estimate.agreement_took(time.perf_counter() - t0)
        values = agreed.tolist()
        latency, step_seconds, n = -values[0], values[1], len(self.kinds)
        self.agreed_step_seconds = step_seconds
        ncodecs = len(self.codec_keys)
        costs = dict(zip(self.codec_keys, values[3 + n : 3 + n + ncodecs]))
        offset = 3 + n + ncodecs
        self.agreed_extra = {}
        for name, part in parts.items():
            self.agreed_extra[name] = values[offset : offset + len(part)]
            offset += len(part)

        def as_links(per_byte: Sequence[float]) -> dict[str, LinkModel]:
            return {
                k: LinkModel(latency, 1.0 / max(s, 1e-15)) for k, s in zip(self.kinds, per_byte)
            }

        if fixed is not None:
            links, stride = dict(fixed), self.interval
        else:
            newest = values[3 : 3 + n]
            links = as_links(estimate.fold(latency, step_seconds, values[2], newest))
            changed = estimate.changed
            if changed and matters is not None:
                changed = matters(as_links(newest), costs)
            stride = estimate.stride(changed)
        self.next_round = step + stride
        self.agreed = (links, costs)
        self._round_took = time.perf_counter() - agree_start
        return self.agreed


class MethodChoices:
    """Each key's method (a DDP bucket, an FSDP2 module), chosen by the rule
    every auto shares (C++ ``chooseMethod``, also the backend's): the least
    predicted time; a key keeps its method unless another is predicted
    ``switch_margin`` faster, so noise does not flip it, but never one
    predicted slower than ``"none"``.

    ``decisions[key]`` holds the method, the step it started (``since``), the
    step it was last evaluated (``round``), the key's size and every allowed
    method's predicted seconds; a chooser may add ``notes`` (lines
    :meth:`explain` prints under the key).
    """

    def __init__(self, switch_margin: float) -> None:
        self.switch_margin = switch_margin
        self.decisions: dict[Any, dict[str, Any]] = {}
        self.switches = 0

    def current(self, key: Any, numel: int, step: int, fresh: bool) -> str | None:
        """The key's method if it need not be re-evaluated now, else None."""
        d = self.decisions.get(key)
        if d is None or d["numel"] != numel or (fresh and d["round"] != step):
            return None
        return d["method"]

    def _pick(self, predicted: dict[str, float], keep: str | None) -> str:
        """The C++ rule every auto shares (``xcomm._C.choose_method``): the
        least predicted time, ties to the first (cheapest codec); ``keep`` is
        kept unless another is ``switch_margin`` faster, but never while
        predicted slower than ``"none"``."""
        names = list(predicted)
        index = _C.choose_method(
            [float(predicted[m]) for m in names],
            names.index(keep) if keep in predicted else -1,
            self.switch_margin,
            names.index("none") if "none" in predicted else -1,
        )
        return names[index]

    def would_switch(self, key: Any, predicted: dict[str, float]) -> bool:
        """Whether ``predicted`` times would move the key off its method."""
        current = self.decisions.get(key)
        if current is None:
            return False
        if current["method"] not in predicted:  # no longer a candidate (e.g. over a bound)
            return True
        return self._pick(predicted, current["method"]) != current["method"]

    def choose(self, key: Any, numel: int, step: int, predicted: dict[str, float]) -> str:
        current = self.decisions.get(key)
        keep = None
        if current is not None and current["numel"] == numel and current["method"] in predicted:
            keep = current["method"]
        method = self._pick(predicted, keep)
        since = current["since"] if keep is not None and method == keep else step
        if current is not None and method != current["method"]:
            self.switches += 1
        self.decisions[key] = {
            "method": method,
            "since": since,
            "round": step,
            "numel": numel,
            "predicted_s": predicted,
        }
        return method

    def explain(self, what: str, link_line: str | None) -> str:
        """A table: each key's method and the predicted milliseconds of every
        allowed method that chose it."""
        lines = [link_line] if link_line else []
        for key in sorted(self.decisions):
            d = self.decisions[key]
            times = ", ".join(f"{m} {t * 1e3:.2f}" for m, t in d["predicted_s"].items())
            lines.append(
                f"{what} {key} ({d['numel']} elements): {d['method']} since step "
                f"{d['since']}; predicted ms: {times}"
            )
            lines.extend(f"  {note}" for note in d.get("notes", ()))
        return "\n".join(lines)


class ObservedCosts:
    """What each method is seen to take, against what the model predicted:
    the closed loop that corrects a mispredicted method within a round.

    The model's inputs are measured, but on other data than the buckets (the
    codecs on ``randn``, the link by a probe): a zero-heavy gradient can make
    a codec several times slower than calibrated, and a probe can read a
    fast link at a fraction of its rate. So every reduction is timed, from
    when the hook was called (or the previous reduction finished, if later:
    reductions share the link one after the other) until its future
    completes, and compared with its prediction. Uncompressed reductions
    correct the link (key ``"link"``: their prediction is the link's time
    alone, and every method's wire time uses the corrected link); a
    compressed one corrects its method (its prediction already uses the
    corrected link, so the ratio holds what the model lacks: the codec's real
    cost on these buckets, its extra collectives' waits).

    At each round :meth:`local` gives this rank's ratios since the last one
    (observed seconds over predicted seconds, summed; 0 where nothing was
    seen), the round agrees them as the MAX over ranks (the slowest rank's
    view, the same on every rank) and :meth:`update` folds them into the
    factors: a method's prediction becomes ``factor * (codec + link factor *
    wire)``, so a method seen to take 10x its prediction is predicted at
    what it took, and one seen slower than uncompressed loses to it at the
    next round. A key's first agreed ratio becomes its factor; each later
    one is averaged in geometrically with the factor, ``f <- sqrt(f * r)``
    (each round weighs as much as all the earlier ones together). One
    round's ratio is noisy where a reduction shares 2 cores with the
    backward pass: on a byte-level LM at 10 Gbit/s, int8's swung between
    0.59 and 2.74 from one round to the next and the link's between 0.66
    and 3.76; taken whole, the 2.74 left int8 for ``none`` for the rest of
    the run (a method not run is not seen again), 11% slower steps. A factor
    not seen again keeps its last value.

    The link's factor corrects the link reading it was seen against
    (:meth:`set_link`, at each round): a probe reads a link slow while it is
    small, and close to right once it has grown, and a factor of 0.29 learned
    on a 1.3 Gbit/s reading, applied to a later 6.0 Gbit/s one, predicted the
    MLP's uncompressed buckets at 3.6x faster than they ran at 10 Gbit/s and
    sent them uncompressed for 13 steps. A reading over 2x off the one the
    factor was seen against drops the factor, and the reading stands until
    uncompressed reductions are seen against it; where they were seen in
    the round just ended, the factor is instead rescaled to the new
    reading, so the corrected link stays where they ran.

    A method that has never run in this run has no ratio of its own, and its
    calibration (``randn`` data, an idle machine) is as wrong for it as it
    was for the methods that did run on these buckets: on 2 busy cores a
    reduction waits for the backward pass's threads whatever its codec, and
    the sweep saw top-k at 1.46x its model while int8 and fp16, never run,
    were predicted at 1.00x, looked cheaper, and were each tried for a round
    at 1.8x and 2.6x. So a never-run method is predicted with the least
    factor of the compressed methods that have run (:meth:`factor`): the
    most favourable correction the run has evidence for, so it is still
    tried where it would win by that evidence, but not on a calibration the
    run has shown to be optimistic. Before any compressed method has run it
    keeps its calibration (factor 1). The ratios are agreed, so which
    methods have run, and the factors, are the same on every rank.

    The arithmetic is C++'s (``_C.ObservedFactors``,
    csrc/collectives/compressed/ObservedFactors), the one the backend's
    ``compression="auto"`` uses too; this class keys it by method name and
    times the hooks' futures.

    Example::

        >>> o = ObservedCosts(("none", "int8", "topk"))
        >>> o.record("topk", observed_s=0.010, predicted_s=0.001)
        >>> o.update(o.local())  # one rank: its own ratios are the agreed ones
        >>> round(o.predict("topk", codec_s=0.0005, wire_s=0.0005), 6)
        0.01
        >>> o.factor("int8"), o.inherited_from("int8")  # never run: top-k's correction
        (10.0, 'topk')
    """

    #: Factors are kept within [FLOOR, CEILING]: one odd reading (a paused
    #: process) cannot make a method look free or unusable for good.
    FLOOR, CEILING = _C.ObservedFactors.FLOOR, _C.ObservedFactors.CEILING

    def __init__(self, methods: Sequence[str]) -> None:
        self.keys = ("link", *[m for m in methods if m != "none"])
        # The arithmetic, one for every auto (the backend's too): C++'s.
        self._factors = _C.ObservedFactors(len(self.keys))
        self._index = {k: i for i, k in enumerate(self.keys)}
        #: Whether the last link reading dropped the link's factor (explain()).
        self.link_dropped = False
        self._lock = threading.Lock()
        self._last_done = 0.0
        # Reductions watched and not yet recorded, in the order they were issued.
        self._pending: collections.deque[tuple[Any, Any, str, float, float]] = collections.deque()

    @staticmethod
    def key(method: str) -> str:
        return "link" if method == "none" else method

    @property
    def factors(self) -> dict[str, float]:
        """Each key's own factor (1 until a round saw it)."""
        return {k: self._factors.stored(i) for i, k in enumerate(self.keys)}

    @property
    def seen(self) -> set[str]:
        """The keys some round agreed a ratio for (the same on every rank)."""
        return {k for i, k in enumerate(self.keys) if self._factors.seen(i)}

    def inherited_from(self, method: str) -> str | None:
        """For a compressed method that has never run: the method whose
        factor it is predicted with (the least factor among the compressed
        methods that ran; ties to the earlier), or None where none has run
        (its calibration stands). None for a method that has run."""
        index = self._index[self.key(method)]
        source = self._factors.source(index)
        return None if source is None or source == index else self.keys[source]

    def factor(self, method: str) -> float:
        """The correction applied to ``method``'s prediction: its own
        observed/predicted ratio, or for a method never run, the least of
        those that ran (1 before any has)."""
        return self._factors.factor(self._index[self.key(method)])

    def predict(self, method: str, codec_s: float, wire_s: float) -> float:
        """The corrected prediction of ``method``, from the model's parts."""
        return self._factors.predict(self._index[self.key(method)], codec_s, wire_s)

    def base(self, method: str, codec_s: float, wire_s: float) -> float:
        """What an observation of ``method`` is compared with: its
        prediction without its own factor."""
        return self._factors.base(self._index[self.key(method)], codec_s, wire_s)

    def record(self, key: str, observed_s: float, predicted_s: float) -> None:
        with self._lock:
            self._factors.record(self._index[key], observed_s, predicted_s)

    def watch(
        self, fut: torch.futures.Future, method: str, predicted_s: float, issued_at: float
    ) -> None:
        """Times ``fut``, issued at ``issued_at`` (``time.perf_counter()``),
        and records it under ``method``'s key once it completed (read at a
        later call, not by a callback on ``fut``: a Python callback would
        take the GIL on the thread completing DDP's future)."""
        self._harvest()
        clock = _C.CompletionClock(fut)
        self._pending.append((fut, clock, self.key(method), predicted_s, issued_at))

    def _harvest(self) -> None:
        """Records the watched reductions that completed, in the order they
        were issued; each counts from its issue or the previous one's end,
        whichever is later (the reductions share the link in turn)."""
        while self._pending:
            fut, clock, key, predicted_s, issued_at = self._pending[0]
            finished = clock.done_at
            if finished is None:
                return
            self._pending.popleft()
            if math.isnan(finished) or future_failed(fut):  # failed: not a time
                continue
            start, self._last_done = max(issued_at, self._last_done), finished
            self.record(key, finished - start, predicted_s)

    def local(self) -> list[float]:
        """This rank's ratios since the last :meth:`update` (0: not seen)."""
        self._harvest()
        with self._lock:
            return self._factors.local()

    def update(self, agreed: Sequence[float]) -> None:
        """Folds the agreed ratios into the factors (a key's first one is
        taken whole, later ones averaged geometrically with the factor; each
        reading bounded to [FLOOR, CEILING] first) and starts a new period."""
        with self._lock:
            self._factors.update(list(agreed))

    def set_link(self, seconds_per_byte: float) -> bool:
        """The agreed link reading (of the kind uncompressed reductions use)
        the predictions use from now on; call after :meth:`update`. Returns
        whether it dropped the link's factor (a reading over
        ``ObservedFactors.RELEARN`` times off the one it was seen against,
        with no uncompressed reduction seen since the last round; with
        one, the factor is rescaled to the new reading and kept)."""
        with self._lock:
            dropped = self._factors.set_link(seconds_per_byte)
        if dropped:
            self.link_dropped = True
        elif "link" in self.seen:
            self.link_dropped = False
        return dropped

    def describe(self, key: str) -> str:
        """One key's factor and where it comes from."""
        if key == "link" and self.link_dropped and key not in self.seen:
            return (
                "link x1.00 (dropped: the reading moved over 2x from the one it was seen against)"
            )
        if key == "link" or key in self.seen:
            return f"{key} x{self.factors[key]:.2f}" + ("" if key in self.seen else " (not seen)")
        source = self.inherited_from(key)
        if source is None:
            return f"{key} x1.00 (never run; uncorrected, no compressed method has run)"
        # The least factor of the compressed methods that ran.
        return f"{key} x{self.factors[source]:.2f} (never run; corrected by {source}'s)"

    def explain(self) -> str:
        seen = ", ".join(self.describe(k) for k in self.keys)
        return f"observed/predicted (applied to the model): {seen}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "factors": dict(self.factors),
            "seen": sorted(self.seen),
            "link_seen_at": self._factors.link_seen_at,
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        if "factors" not in d:
            # Before never-run methods were corrected the factors alone were
            # kept: one that moved off 1 was seen.
            d = {"factors": d, "seen": [k for k, v in d.items() if float(v) != 1.0]}
        factors, seen = d["factors"], set(d["seen"])
        for i, k in enumerate(self.keys):
            self._factors.restore(i, float(factors.get(k, self._factors.stored(i))), k in seen)
        # 0 (a checkpoint from before it was kept): the next reading is taken as it.
        self._factors.restore_link_seen_at(float(d.get("link_seen_at", 0.0)))


def future_failed(fut: torch.futures.Future) -> bool:
    """Whether a completed future holds an error (its waiter raises it)."""
    try:
        fut.value()
    except Exception:  # noqa: BLE001 - the waiter raises it
        return True
    return False


class UncompressedCheck:
    """Whether compressing pays in whole steps, measured by trying without it.

    The per-reduction model and its observed corrections time each
    reduction from issue to completion, which is not what it costs the step:
    on a host whose cores also run the backward pass, an uncompressed
    reduction overlaps that pass, while a codec takes cores from it. On a
    byte-level LM at 10 Gbit/s on 2 cores the model (corrected) predicted
    int8 2.7x faster than ``none`` per bucket, and whole steps with int8 took
    109 ms against 102 ms. So ``auto`` checks: some steps after compression
    starts, and again at growing intervals, a trial runs ``none`` and the
    compressed methods on alternate steps, :attr:`TRIAL_PAIRS` timed steps
    each, and the median step time of each side (agreed, the slowest
    rank's) is compared. Alternating, not a block of one after a block of
    the other: a slow spell of the host (seconds, tens of steps, on a shared
    machine) falls on both sides alike. Six uncompressed steps compared with
    the five compressed ones before them read, on the LM at 1 Gbit/s during
    such a spell, 216 ms compressed against 206 ms uncompressed where
    uncompressed steps are about 1.2x slower, and left every bucket
    uncompressed until the next check. A difference of the medians within
    :attr:`NOISE_Z` standard errors (each side's from the spread of its
    steps, the largest of any rank's) extends the trial by another
    :attr:`TRIAL_PAIRS` pairs, up to :attr:`MAX_EXTENSIONS` times, and
    decides on all its steps: on the CNN at 10 Gbit/s, whose steps spread
    +-13% on a shared host, five steps a side read 34.1 ms compressed
    against 34.7 ms uncompressed where top-k's steps are 1.21x faster, and
    the verdict sent every bucket uncompressed (1.12 of top-k over the run).
    Compression is kept only while its
    steps are at least ``margin`` faster: within the margin the measurement
    cannot tell them apart, and uncompressed steps lose nothing. The margin
    is 2%: the most a wrong verdict between two sides that close can cost.
    With 5%, on the LM at 10 Gbit/s, where int8's steps were 2% and 6%
    faster than uncompressed ones in two pairs of separate 240-step runs,
    one run's trials measured 5.2%, 7.1% and 14.5%, and the first verdict
    left its steps uncompressed. After a
    check finds it does not pay, buckets stay on ``none``, and the next
    trial alternates the same way.

    A check is skipped where uncompressed reductions are predicted to take
    longer than a whole compressed step (the link then holds the step back
    whatever overlaps it: a slow link, where a trial would cost most). Where
    steps under the verdict become slower, by the margin, than the other
    side's were at the last check (the link or the load changed), the next
    check comes at once. A timed trial step longer than :attr:`PAUSE_FACTOR`
    times the steps before the trial is left out: a pause between steps
    (an evaluation, a checkpoint, a program that trains several models in
    turn) falls into one step's time, and three such steps on one side
    once made a median of 2.2 s against 0.1 s, which held every bucket
    uncompressed for the next 12,000 steps. A side that is really that much
    slower loses every timed step, and a side with none keeps the verdict,
    which is then the faster side anyway. The first check is :attr:`FIRST_AFTER` steps after
    compression starts; each next one at least :attr:`FIRST_BACKOFF` steps
    after the last, doubling, and far enough that its trial's steps on the
    slower side, if the verdict holds, cost at most :attr:`TRIAL_FRACTION`
    of the steps between. Every input is agreed and the sides are a
    function of the step, so every rank runs and decides alike.

    Example::

        >>> c = UncompressedCheck()
        >>> c.at_round(2, 0.0, compressing=True, none_can_win=True)  # compression starts
        >>> c.at_round(12, 0.109, compressing=True, none_can_win=True)  # a trial starts
        23
        >>> [c.runs_none(s) for s in (12, 13, 14, 15)]  # the round's step, then alternating
        [True, True, False, True]
        >>> for s in range(13, 23):
        ...     c.record(s, 0.102 if c.runs_none(s) else 0.109)
        >>> c.local_trial_seconds(23)  # medians and their errors, agreed (MAX) at step 23
        [0.102, 0.109, 0.0, 0.0]
        >>> c.at_round(23, 0.1, compressing=True, none_can_win=True, trial_s=(0.102, 0.109, 0, 0))
        >>> c.verdict, c.runs_none(24)
        ('none', True)
    """

    #: Timed steps of each side in a trial. A trial's first step (its
    #: round's) runs the side on trial untimed; then the sides alternate.
    TRIAL_PAIRS = 5
    #: Steps a trial runs, its round's step included.
    TRIAL_STEPS = 2 * TRIAL_PAIRS + 1
    #: Compressed steps before the first check.
    FIRST_AFTER = 10
    #: Steps from the first check to the next; doubled after each.
    FIRST_BACKOFF = 40
    #: The most of the training time trials may cost (run slower than the verdict).
    TRIAL_FRACTION = 0.01
    #: A timed trial step this many times the steps before the trial is a
    #: pause between steps, not a measurement of either side.
    PAUSE_FACTOR = 3.0
    #: A difference of the sides' medians under this many standard errors
    #: (of the difference) is within the noise: the trial goes on.
    NOISE_Z = 2.0
    #: How many times a trial within the noise is extended by TRIAL_PAIRS pairs.
    MAX_EXTENSIONS = 3

    def __init__(self, margin: float = 0.02, unit: str = "bucket") -> None:
        self.margin = margin
        #: What the group's reductions are called in explain() ("bucket", "module").
        self.unit = unit
        #: ``"compress"`` (the model chooses) or ``"none"`` (every bucket uncompressed).
        self.verdict = "compress"
        #: The side on trial (the verdict's other side), or None between trials.
        self.trial: str | None = None
        self.trial_start = -1
        self.trial_end = -1
        #: The agreed median step before the trial (seconds; 0: unknown).
        self.trial_reference = 0.0
        #: This rank's timed trial steps, seconds, by side ("none", "compress").
        self.trial_times: dict[str, list[float]] = {"none": [], "compress": []}
        #: Times the current trial was extended (its sides within the noise).
        self.extensions = 0
        self.next_check: int | None = None
        self.backoff = self.FIRST_BACKOFF
        #: Checks completed.
        self.checks = 0
        #: The last check: ``(step, compressed seconds, uncompressed seconds)``.
        self.last: tuple[int, float, float] | None = None
        #: Why the last check was skipped or a verdict ended (explain()).
        self.note = ""

    @property
    def forces_none(self) -> bool:
        """Whether the verdict holds every bucket uncompressed (between
        trials; during one, :meth:`runs_none` says which steps run ``none``).
        The model's choices are kept meanwhile: a trial's compressed steps
        run them."""
        return self.trial is None and self.verdict == "none"

    def settled(self, step: int) -> bool:
        """Whether ``step`` and the :attr:`TRIAL_PAIRS` steps before it all
        ran the verdict's side: no trial in progress or just ended, so
        their times compare (what a round step took beyond the others)."""
        return self.trial is None and step - self.trial_end > self.TRIAL_PAIRS

    def side(self, step: int) -> str:
        """``"none"`` or ``"compress"``: what ``step`` runs."""
        if self.trial is None or not self.trial_start <= step < self.trial_end:
            return self.verdict
        offset = step - self.trial_start
        on_trial = offset == 0 or offset % 2 == 1
        return self.trial if on_trial else ("none" if self.trial == "compress" else "compress")

    def runs_none(self, step: int) -> bool:
        """Whether every bucket runs uncompressed at ``step``."""
        return self.side(step) == "none"

    def record(self, step: int, seconds: float) -> None:
        """``step`` took ``seconds`` (start to start, without a round in it):
        kept for its side if it is a timed step of the trial."""
        if self.trial is not None and self.trial_start < step < self.trial_end:
            self.trial_times[self.side(step)].append(seconds)

    def local_trial_seconds(self, step: int) -> list[float]:
        """At the round that ends a trial: this rank's median step of each
        side and the standard error of each median, ``[none, compress,
        none's error, compress's error]`` (0 for a side with no timed
        step), to agree with the round (the MAX of each over ranks);
        otherwise nothing (every rank alike). Steps longer than
        :attr:`PAUSE_FACTOR` times the steps before the trial are left out
        (pauses). The error is the normal approximation from the median
        absolute deviation, ``1.253 * 1.483 * MAD / sqrt(n)``: robust to the
        one slow step that a mean and its deviation are not."""
        if self.trial is None or step < self.trial_end:
            return []
        bound = self.PAUSE_FACTOR * self.trial_reference if self.trial_reference > 0 else math.inf
        medians, errors = [], []
        for side in ("none", "compress"):
            times = sorted(t for t in self.trial_times[side] if t <= bound)
            if not times:
                medians.append(0.0)
                errors.append(0.0)
                continue
            median = times[(len(times) - 1) // 2]
            deviations = sorted(abs(t - median) for t in times)
            mad = deviations[(len(deviations) - 1) // 2]
            medians.append(median)
            errors.append(1.253 * 1.483 * mad / math.sqrt(len(times)))
        return medians + errors

    def at_round(
        self,
        step: int,
        step_s: float,
        *,
        compressing: bool,
        none_can_win: bool,
        trial_s: Sequence[float] = (),
    ) -> int | None:
        """At a round at ``step``, with ``step_s`` the agreed median of the
        recent steps and, at the round that ends a trial, ``trial_s`` its
        agreed ``[none, compress]`` medians and, optionally, their standard
        errors (:meth:`local_trial_seconds`, agreed as the round agrees it;
        empty at any other round): ends a trial that is over, extends one
        whose sides are within the noise, or starts one that is due.
        Returns the step the next round must come by (a trial's end), or
        None."""
        if self.trial is not None:
            if step < self.trial_end:
                return self.trial_end
            if (
                len(trial_s) == 4
                and min(trial_s[:2]) > 0
                and self.extensions < self.MAX_EXTENSIONS
                and abs(trial_s[0] - trial_s[1]) < self.NOISE_Z * math.hypot(*trial_s[2:])
            ):
                # This round's step (an odd offset) runs the side on trial
                # untimed, as the trial's first step did; then the pairs go on.
                self.extensions += 1
                self.trial_end = step + self.TRIAL_STEPS
                self.note = (
                    f"step {step}: {trial_s[1] * 1e3:.1f} ms compressed against "
                    f"{trial_s[0] * 1e3:.1f} ms uncompressed, within the noise "
                    f"(+-{self.NOISE_Z * math.hypot(*trial_s[2:]) * 1e3:.1f} ms): trial "
                    f"extended to step {self.trial_end - 1}"
                )
                return self.trial_end
            pairs = (self.extensions + 1) * self.TRIAL_PAIRS
            self.trial, self.extensions = None, 0
            self.trial_times = {"none": [], "compress": []}
            if len(trial_s) not in (2, 4) or min(trial_s[:2]) <= 0:
                # Rounds (or pauses) took every timed step of a side: nothing to compare.
                self.next_check = step + self.backoff
                self.note = (
                    f"step {step}: the trial timed no step of a side (each ran a round, or "
                    f"took over {self.PAUSE_FACTOR:g}x the steps before it); verdict kept"
                )
                return None
            none_s, compressed_s = trial_s[:2]  # what local_trial_seconds() gives, agreed
            pays = compressed_s < (1.0 - self.margin) * none_s
            self.verdict = "compress" if pays else "none"
            self.checks, self.last = self.checks + 1, (step, compressed_s, none_s)
            # The next trial's steps on the slower side (if this verdict
            # holds) are spaced to cost at most TRIAL_FRACTION of the steps
            # between, and at least the back-off, which doubles.
            gap = abs(none_s - compressed_s) / max(min(none_s, compressed_s), 1e-9)
            slow_steps = pairs + 1
            self.next_check = step + max(
                self.backoff, math.ceil(slow_steps * gap / self.TRIAL_FRACTION)
            )
            self.backoff *= 2
            self.note = ""
            return None
        if self.next_check is None:
            if compressing:
                self.next_check = step + self.FIRST_AFTER
            return None
        if step_s <= 0:
            return None
        if self.last is not None and step < self.next_check:
            # The verdict's own steps now slower, by the margin, than the
            # other side's at the last check: something changed (the link,
            # the load): check again now rather than at the back-off.
            _, compressed_s, none_s = self.last
            other = compressed_s if self.verdict == "none" else none_s
            if step_s <= (1.0 + self.margin) * other:
                return None
            self.note = (
                f"step {step}: steps took {step_s * 1e3:.1f} ms, slower than the other side's "
                f"{other * 1e3:.1f} ms at the last check: checked again"
            )
        elif step < self.next_check:
            return None
        if not compressing or (self.verdict == "compress" and not none_can_win):
            # Nothing to compare (the model itself chose none everywhere), or
            # uncompressed reductions cannot fit a step.
            self.next_check = step + self.backoff
            self.note = (
                f"step {step}: not checked ("
                + (
                    "nothing is compressed"
                    if not compressing
                    else "uncompressed reductions predicted longer than a step"
                )
                + ")"
            )
            return None
        self.trial = "none" if self.verdict == "compress" else "compress"
        self.trial_start, self.trial_end = step, step + self.TRIAL_STEPS
        self.trial_reference = step_s
        self.trial_times = {"none": [], "compress": []}
        return self.trial_end

    def explain(self) -> str:
        margin = f"{100 * self.margin:.3g}%"
        if self.trial is not None:
            line = (
                f"uncompressed check: a trial of {self.trial}, alternating with "
                f"{self.verdict}, steps {self.trial_start} to {self.trial_end - 1}"
            )
        elif self.last is None:
            line = "uncompressed check: not run yet" + (
                f" (first at step {self.next_check})" if self.next_check is not None else ""
            )
        else:
            step, compressed_s, none_s = self.last
            line = (
                f"uncompressed check at step {step}: steps took {compressed_s * 1e3:.1f} ms "
                f"compressed, {none_s * 1e3:.1f} ms uncompressed: "
                + (
                    "compressing"
                    if self.verdict == "compress"
                    else f"every {self.unit} uncompressed"
                )
                + f" (compression is kept only when {margin} faster); next check at step "
                f"{self.next_check}"
            )
        return line + (f"; {self.note}" if self.note else "")

    def state_dict(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in (
                "verdict",
                "trial",
                "trial_start",
                "trial_end",
                "trial_reference",
                "trial_times",
                "extensions",
                "next_check",
                "backoff",
                "checks",
                "last",
                "note",
            )
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        for k, v in d.items():
            if hasattr(self, k):
                setattr(self, k, tuple(v) if k == "last" and v is not None else v)
