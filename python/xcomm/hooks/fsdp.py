"""Compressed gradient reduce-scatter for FSDP2 (``fully_shard``).

FSDP2 reduces each module's gradients with one reduce-scatter: rank ``r``'s
input ``g_r`` is its whole gradient laid out as ``n`` equal rows (row ``j`` is
the part rank ``j`` owns), and rank ``j`` keeps ``sum_r g_r[j]`` (divided by
``n`` under AVG). :func:`compress_reduce_scatter` replaces that reduce-scatter
on every ``fully_shard`` module (through FSDP2's ``set_custom_reduce_scatter``)
with one that moves fewer bytes:

* ``"bf16"`` / ``"fp16"``: each rank casts ``a_r = g_r + e_r`` down and an
  all-to-all delivers row ``j`` of every rank to rank ``j``, which sums them in
  float32 in rank order. 2x fewer bytes than float32; the sum itself loses
  nothing (unlike a reduce-scatter run in the low precision).
* ``"int8"``: rows quantized with one float32 scale per chunk of
  ``chunk_elems`` elements (``q = round(a / s)``, ``s = max|a_chunk| / 127``),
  the same all-to-all, a float32 sum in rank order. About 4x fewer bytes.
* ``"none"``: FSDP2's own reduce-scatter (for A/B runs).
* ``"auto"``: per module, the fastest of ``methods`` (default none, bf16,
  int8) on this link and machine, re-decided every ``interval`` steps. The
  cost of reducing a module's ``n`` float32 elements is predicted as

      ``T(none) = L + 4n / b_rs``,
      ``T(m) = c_m n + L + B_m n / b_a2a``  (``B`` = 2 for the casts,
      ``1 + 4 / chunk_elems`` for int8)

  with the latency ``L``, the reduce-scatter's and the all-to-all's
  throughput ``b_rs`` / ``b_a2a`` measured by probing them on the group
  (whatever route the group's backend takes), and each codec's CPU seconds
  per element ``c_m`` timed once on this machine; an allreduce MAX makes
  every input the same on every rank, so every rank picks the same method
  (their collectives match). The loop is closed (``observe=True``, the
  default; CPU inputs): every reduce-scatter auto runs is timed and compared
  with its prediction, and :class:`~xcomm.hooks._measure.ObservedCosts`
  (the DDP hook's, the same rules) turns the ratios, agreed as the MAX over
  ranks at each re-evaluation, into factors on the model: uncompressed
  reduce-scatters correct the link, a compressed one its method, a method
  never run takes the least factor of the compressed methods that ran, and
  a method observed slower than ``none`` is not kept. Whole steps are
  checked as the DDP hook's auto checks them (CPU inputs, a measured link,
  ``none`` allowed; :class:`~xcomm.hooks._measure.UncompressedCheck`): a
  trial now and then runs every module ``none`` on alternate steps, and
  compression is kept only where its steps were at least 2% faster. A module keeps its
  method unless another is ``switch_margin`` faster. A module leaving int8
  sends its residual with its next reduce-scatter.
  :meth:`FsdpCompressionState.explain` says what each module uses and why,
  with the factors; ``xcomm.stats()`` counts ``AUTO:<method>``; with the
  timeline on, each decision is a span on the track "xcomm auto".

**Error feedback** (on for int8 by default; ``error_feedback=True`` turns it
on for the casts too, which torch's cast hooks go without): each rank keeps
what its rows did not carry, ``e_r' = a_r - decode(encode(a_r))``, and adds it to the next step's
input, so ``sent + residual = g + old residual`` holds element by element.
The residual is float32 and the size of the module's *unsharded* gradient on
every rank (the error is made at the sender, before sharding), the memory of
one unsharded float32 gradient per module; ``error_feedback=False`` avoids it.

Every shard is reduced on the one rank that owns it, so the parameters FSDP2
all-gathers from the shards are the same on every rank. A reduction FSDP2 asks
for that is not SUM or AVG (``set_gradient_divide_factor`` makes it
PREMUL_SUM), or an input under ``min_bytes``, goes through the uncompressed
reduce-scatter (counted in ``state.stats`` as sent uncompressed).

**Without a hook.** FSDP2 on a group made with
``xcomm.Options(compression=...)`` has its reduce-scatters compressed by the
backend (same all-to-all and exact sum, no error feedback); this hook adds
the error feedback and per-model control.

**HSDP.** FSDP2 all-reduces the shards between replicas itself, with
``dist.all_reduce`` on the replicate dimension's group; give that group
``xcomm.Options(compression=...)`` (``init_device_mesh``'s
``backend_override``) and the backend compresses it.

Example::

    >>> from torch.distributed.fsdp import fully_shard
    >>> from xcomm.hooks import compress_reduce_scatter
    >>> for layer in model.layers:  # doctest: +SKIP
    ...     fully_shard(layer)
    >>> fully_shard(model)  # doctest: +SKIP
    >>> state = compress_reduce_scatter(model, method="int8")  # doctest: +SKIP
    >>> # train as usual; state.stats counts the bytes saved,
    >>> # state.state_dict() checkpoints the residuals (one per rank)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import _C
from ..opstats import record_op
from ..trace import add_span, now_us, timeline_enabled
from ._measure import (
    LinkModel,
    MeasuredLink,
    MethodChoices,
    ObservedCosts,
    UncompressedCheck,
)
from ._methods import method_names
from ._pickling import pack_state, pickled_state
from .stats import CompressionStats, alltoall_bytes

__all__ = [
    "FSDP_METHODS",
    "CompressedReduceScatter",
    "FsdpCompressionState",
    "compress_reduce_scatter",
    "predict_reduce_scatter_parts",
    "predict_reduce_scatter_seconds",
]

#: What ``auto`` can choose from, cheapest codec first (ties go to the earlier).
FSDP_AUTO_METHODS: tuple[str, ...] = method_names("fsdp")

#: Values of ``method``.
FSDP_METHODS: tuple[str, ...] = (*FSDP_AUTO_METHODS, "auto")

#: The version :meth:`FsdpCompressionState.state_dict` writes (1: before auto).
FSDP_STATE_VERSION = 2

#: The collectives ``auto`` probes: FSDP2's own reduce-scatter ("none") and
#: the all-to-all every compressed method uses.
_PROBES = ("reduce_scatter", "all_to_all")


#: ``reduce_scatter_tensor`` under its newer name where torch has it (2.13+
#: warns that the old name is deprecated).
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def predict_reduce_scatter_parts(
    method: str,
    numel: int,
    links: dict[str, LinkModel],
    costs: dict[str, float],
    *,
    chunk_elems: int,
    itemsize: int = 4,
) -> tuple[float, float]:
    """``auto``'s cost model (module docstring), split as the closed loop
    corrects it: predicted (codec seconds, link seconds) to reduce-scatter
    ``numel`` elements with ``method``. ``links`` gives the
    ``"reduce_scatter"`` and ``"all_to_all"`` links in bytes of input per
    second. The formulas are C++'s (``csrc/collectives/compressed/CostModel``,
    bound as ``_C.predict_reduce_scatter``), beside the allreduce's that the
    DDP hook and the backend predict with.

    Example::

        >>> links = {k: LinkModel(1e-4, 125e6) for k in ("reduce_scatter", "all_to_all")}
        >>> codec_s, wire_s = predict_reduce_scatter_parts(
        ...     "int8", 1 << 20, links, {"int8": 1e-9}, chunk_elems=1024)
        >>> round(codec_s, 6), round(wire_s, 4)
        (0.001049, 0.0085)
    """
    rs, a2a = links["reduce_scatter"], links["all_to_all"]
    codec_s, wire_s = _C.predict_reduce_scatter(
        method,
        numel,
        itemsize,
        rs.latency_s,
        rs.bandwidth_bytes_per_s,
        a2a.latency_s,
        a2a.bandwidth_bytes_per_s,
        costs,
        int8_chunk_elems=chunk_elems,
    )
    return codec_s, wire_s


def predict_reduce_scatter_seconds(
    method: str,
    numel: int,
    links: dict[str, LinkModel],
    costs: dict[str, float],
    *,
    chunk_elems: int,
    itemsize: int = 4,
) -> float:
    """``auto``'s cost model: predicted seconds to reduce-scatter ``numel``
    elements with ``method`` (:func:`predict_reduce_scatter_parts`, summed).

    Example::

        >>> links = {k: LinkModel(1e-4, 125e6) for k in ("reduce_scatter", "all_to_all")}
        >>> round(predict_reduce_scatter_seconds("none", 1 << 20, links, {}, chunk_elems=1024), 4)
        0.0337
    """
    codec_s, wire_s = predict_reduce_scatter_parts(
        method, numel, links, costs, chunk_elems=chunk_elems, itemsize=itemsize
    )
    return codec_s + wire_s


def calibrate_reduce_scatter_codecs(
    world: int, chunk_elems: int, numel: int = 1 << 22
) -> dict[str, float]:
    """Each compressed method's CPU seconds per element on this machine
    (float32: encode, then decode and sum the ``world`` received rows; int8
    with error feedback), best of 3, on ``numel`` elements (16 MiB: out of
    cache, as gradients are)."""
    numel -= numel % world
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    # The one calibration every auto times with (C++'s, CodecCalibration).
    return dict(_C.calibrate_reduce_scatter_codecs(x, world, chunk_elems))


@dataclass
class FsdpCompressionState:
    """Settings, error-feedback residuals and byte counts shared by the
    compressed reduce-scatters of one model (see the module docstring).

    Args:
        method: one of :data:`FSDP_METHODS`.
        chunk_elems: elements per int8 scale; smaller is more precise and
            costs ``4 / chunk_elems`` bytes per element more.
        error_feedback: carry what a lossy method did not send into the next
            step (per module, per rank). ``None`` (default): for int8, whose
            codec does it in the same pass; not for the casts, where it would
            cost three more passes over the gradient for an error of 2^-8.
        min_bytes: inputs smaller than this go uncompressed (latency, not
            bandwidth, bounds them).
        methods: with ``method="auto"``, what it may choose from (a subset
            of ``("none", "bf16", "fp16", "int8")``).
        lossless_only: with ``method="auto"``, choose only ``"none"``.
        interval: with ``method="auto"``, steps between re-evaluations.
        switch_margin: with ``method="auto"``, a module changes method only
            when another is predicted this fraction faster.
        probe_fraction: with ``method="auto"``, the share of the steps
            between re-evaluations the link probes may take.
        link: with ``method="auto"``, a fixed :class:`~xcomm.hooks.LinkModel`
            (bytes on one rank's link per second) instead of probing; the
            reduce-scatter is then assumed to move ``(w-1)/w`` of its input,
            as an all-to-all does.
        codec_costs: with ``method="auto"``, fixed codec costs (seconds per
            element, keys ``bf16``, ``fp16``, ``int8``) instead of timing them.
        observe: with ``method="auto"``, correct the model by what each
            method is seen to take (module docstring); ``False`` trusts the
            model alone (with a fixed ``link`` and ``codec_costs``: a
            hypothetical machine, as tests use).

    Example::

        >>> from xcomm.hooks import FsdpCompressionState
        >>> FsdpCompressionState(method="bf16").method
        'bf16'
    """

    method: str = "int8"
    chunk_elems: int = _C.Int8Codec.DEFAULT_CHUNK_ELEMS
    error_feedback: bool | None = None
    min_bytes: int = 64 * 1024
    methods: tuple[str, ...] = method_names("fsdp", default_only=True)
    lossless_only: bool = False
    interval: int = 5
    switch_margin: float = 0.1
    probe_fraction: float = 0.01
    link: LinkModel | None = None
    codec_costs: dict[str, float] | None = None
    observe: bool = True
    stats: CompressionStats = field(default_factory=CompressionStats)

    def __post_init__(self) -> None:
        name = "xcomm.hooks.FsdpCompressionState"
        if self.method not in FSDP_METHODS:
            raise ValueError(f"{name}: method must be one of {FSDP_METHODS}, got {self.method!r}")
        self.methods = tuple(self.methods)
        if not self.methods or any(m not in FSDP_AUTO_METHODS for m in self.methods):
            raise ValueError(
                f"{name}: methods must be a non-empty subset of {FSDP_AUTO_METHODS}, "
                f"got {self.methods}"
            )
        allowed = [m for m in FSDP_AUTO_METHODS if m in self.methods]
        if self.lossless_only:
            allowed = [m for m in allowed if m == "none"]
            if not allowed:
                raise ValueError(f"{name}: lossless_only leaves no method: add 'none' to methods")
        #: What ``auto`` chooses from.
        self.allowed: tuple[str, ...] = tuple(allowed)
        if self.interval < 1:
            raise ValueError(f"{name}: interval must be >= 1, got {self.interval}")
        if self.chunk_elems <= 0:
            raise ValueError(
                f"xcomm.hooks.FsdpCompressionState: chunk_elems must be > 0, got {self.chunk_elems}"
            )
        if self.min_bytes < 0:
            raise ValueError(
                f"xcomm.hooks.FsdpCompressionState: min_bytes must be >= 0, got {self.min_bytes}"
            )
        # The casts carry feedback only when asked to; int8 (alone or under
        # auto) unless told not to.
        self._error_feedback_arg = self.error_feedback  # as given, for pickling
        self._cast_feedback = bool(self.error_feedback)
        if self.error_feedback is None:
            self.error_feedback = self.method in ("int8", "auto")
        self.codec = _C.Int8Codec(self.chunk_elems)
        self.feedback = _C.ErrorFeedback()
        self.keys: dict[str, int] = {}
        # auto: steps are counted at the first module's reduce-scatter.
        self.iter = 0
        self._first_module: str | None = None
        self._measure = MeasuredLink(
            _PROBES, FSDP_AUTO_METHODS[1:], self.probe_fraction, self.interval
        )
        self._choices = MethodChoices(self.switch_margin)
        self._observed = ObservedCosts(self.allowed)
        #: Whether compressing pays in whole steps (as the DDP hook's auto:
        #: :class:`~xcomm.hooks._measure.UncompressedCheck`).
        self.check = UncompressedCheck(unit="module")
        #: What each module ran at its last step: its decision, or ``none``
        #: on the uncompressed steps of a check's trial.
        self.ran: dict[str, str] = {}
        self._fresh_round = False
        # Each module's (numel, on CPU), to ask whether a new reading of the
        # link would change its method.
        self._module_inputs: dict[str, tuple[int, bool]] = {}

    @property
    def decisions(self) -> dict[str, dict[str, Any]]:
        """``auto``: each module's method, the step it started and the
        predicted seconds of every allowed method that chose it."""
        return self._choices.decisions

    @property
    def link_estimate(self) -> dict[str, LinkModel] | None:
        """``auto``: the links (input bytes per second of a reduce-scatter and
        of an all-to-all) every rank agreed on last (None before)."""
        return self._measure.agreed[0] if self._measure.agreed else None

    def explain(self) -> str:
        """``auto``: each module's method and the predicted milliseconds of
        every allowed method that chose it, and the corrections applied
        (each method's observed/predicted; for a method not run yet, whose
        correction it takes)."""
        line = None
        if (links := self.link_estimate) is not None:
            line = f"latency {links['all_to_all'].latency_s * 1e3:.3f} ms; " + ", ".join(
                f"{k} {link.bandwidth_bytes_per_s * 8 / 1e9:.3f} Gbit/s of input"
                for k, link in links.items()
            )
            line += " (agreed by all ranks)"
            if self.observe:
                line += "\n" + self._observed.explain()
            if self._checking:
                line += "\n" + self.check.explain()
        return self._choices.explain("module", line)

    def choose(
        self, name: str, numel: int, group: dist.ProcessGroup, world: int, cpu: bool = True
    ) -> str:
        """``auto``: the method for module ``name``'s reduce-scatter of
        ``numel`` elements (int8 only for CPU gradients). Counts steps (one per
        call of the first module), and at a re-evaluation step's first call
        probes and agrees the inputs."""
        if self._first_module is None:
            self._first_module = name
        elif name == self._first_module:
            self.iter += 1
        if name == self._first_module:
            took = self._measure.step_started(
                comparable=not self._checking or self.check.settled(self.iter - 1)
            )
            if took is not None and self._checking:
                self.check.record(self.iter - 1, took)
            self._fresh_round = False
            if self.iter >= self._measure.next_round or self._measure.agreed is None:
                self._agree(group, world)
        method = self._choices.current(name, numel, self.iter, self._fresh_round)
        if method is None:
            links, costs = self._measure.agreed  # type: ignore[misc]
            self._module_inputs[name] = (numel, cpu)
            predicted = self._predict(numel, cpu, links, costs)
            if not predicted:
                raise TypeError(
                    "xcomm.hooks.FsdpCompressionState: auto may only choose int8, which runs "
                    "on CPU gradients; add 'bf16' or 'none' to methods for other devices"
                )
            method = self._choices.choose(name, numel, self.iter, predicted)
        if self._checking and self.check.runs_none(self.iter):
            # The check's verdict or a trial's uncompressed step; decisions
            # keep the model's choice (AutoState's hook says why).
            method = "none"
        self.ran[name] = method
        return method

    @property
    def _checking(self) -> bool:
        """Whether the uncompressed check runs: with ``observe`` on a
        measured link (a fixed one is not what the steps see), where
        ``none`` is allowed."""
        return self.observe and self.link is None and "none" in self.allowed

    def _predict(
        self, numel: int, cpu: bool, links: dict[str, LinkModel], costs: dict[str, float]
    ) -> dict[str, float]:
        """Every allowed method's predicted seconds for one module's
        reduce-scatter (corrected by what the methods were seen to take)."""
        return {
            m: self._observed.predict(m, *self._parts(m, numel, links, costs))
            for m in self.allowed
            if cpu or m != "int8"
        }

    def _parts(
        self, method: str, numel: int, links: dict[str, LinkModel], costs: dict[str, float]
    ) -> tuple[float, float]:
        """The model's (codec seconds, link seconds) for one reduce-scatter."""
        return predict_reduce_scatter_parts(
            method, numel, links, costs, chunk_elems=self.chunk_elems
        )

    def _took(self, method: str, numel: int, seconds: float) -> None:
        """``auto``: records that a reduce-scatter of ``numel`` elements with
        ``method`` took ``seconds`` (the closed loop); from step 1 (step 0
        pays first-touch costs)."""
        if not self.observe or self._measure.agreed is None or self.iter < 1:
            return
        links, costs = self._measure.agreed
        base = self._observed.base(method, *self._parts(method, numel, links, costs))
        self._observed.record(self._observed.key(method), seconds, base)

    def _agree(self, group: dist.ProcessGroup, world: int) -> None:
        def reduce_scatter(nbytes: int) -> float:
            n = max(world, nbytes // 4 // world * world)
            out = torch.empty(n // world)
            _reduce_scatter_single(out, torch.zeros(n), group=group)
            return n * 4.0

        def all_to_all(nbytes: int) -> float:
            n = max(world, nbytes // 4 // world * world)
            dist.all_to_all_single(torch.empty(n), torch.zeros(n), group=group)
            return n * 4.0

        fixed = None
        if self.link is not None:  # NIC bytes -> bytes of input, for an all-to-all
            per_input = LinkModel(
                self.link.latency_s, self.link.bandwidth_bytes_per_s * world / max(world - 1, 1)
            )
            fixed = dict.fromkeys(_PROBES, per_input)
        observed = self._observed.local() if self.observe else []
        trial = self.check.local_trial_seconds(self.iter) if self._checking else []
        self._measure.agree(
            group,
            {"reduce_scatter": reduce_scatter, "all_to_all": all_to_all},
            lambda: self.codec_costs or calibrate_reduce_scatter_codecs(world, self.chunk_elems),
            step=self.iter,
            fixed=fixed,
            matters=lambda links, costs: any(
                self._choices.would_switch(name, self._predict(numel, cpu, links, costs))
                for name, (numel, cpu) in self._module_inputs.items()
            ),
            extra={"observed": observed, "trial": trial},
        )
        agreed_extra = self._measure.agreed_extra
        if self.observe:
            self._observed.update(agreed_extra["observed"])
            links, _ = self._measure.agreed  # type: ignore[misc]
            # Uncompressed reduce-scatters are predicted on this kind's link.
            self._observed.set_link(1.0 / links["reduce_scatter"].bandwidth_bytes_per_s)
        self._fresh_round = True
        agreed_trial = agreed_extra["trial"]
        inputs = self._module_inputs.values()
        if self._checking and inputs and all(cpu for _, cpu in inputs):
            links, costs = self._measure.agreed  # type: ignore[misc]
            uncompressed = sum(
                self._observed.predict("none", *self._parts("none", numel, links, costs))
                for numel, _ in inputs
            )
            step_s = self._measure.agreed_step_seconds
            due = self.check.at_round(
                self.iter,
                step_s,
                compressing=any(d["method"] != "none" for d in self.decisions.values()),
                none_can_win=uncompressed < step_s,
                trial_s=agreed_trial,
            )
            if due is not None:  # no round within a trial (AutoState._round says why)
                self._measure.next_round = due

    def key(self, name: str) -> int:
        """The error-feedback key of the module named ``name``."""
        return self.keys.setdefault(name, len(self.keys))

    def residual(self, name: str) -> torch.Tensor | None:
        """The live residual of module ``name`` (not a copy), or None."""
        if name not in self.keys:
            return None
        return self.feedback.get(self.keys[name])

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals by module name, and the byte counts.

        Residuals differ between ranks: save one per rank."""
        agreed = self._measure.agreed
        return {
            "version": FSDP_STATE_VERSION,
            "method": self.method,
            "residuals": {
                name: r.clone() for name in self.keys if (r := self.residual(name)) is not None
            },
            "stats": self.stats.as_dict(),
            "auto": {
                "iter": self.iter,
                "next_round": self._measure.next_round,
                "first_module": self._first_module,
                "decisions": {k: dict(v) for k, v in self.decisions.items()},
                "observed": self._observed.state_dict(),
                "check": self.check.state_dict(),
                "agreed": None
                if agreed is None
                else (
                    {k: [v.latency_s, v.bandwidth_bytes_per_s] for k, v in agreed[0].items()},
                    dict(agreed[1]),
                ),
            },
        }

    def __getstate__(self) -> dict[str, Any]:
        """The configuration as constructed and :meth:`state_dict` as bytes,
        so the state pickles (``mp.spawn``, ``copy.deepcopy``, ``torch.save``)."""
        config = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "stats"}
        config["error_feedback"] = self._error_feedback_arg
        return {"config": config, "state_bytes": pack_state(self.state_dict())}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self.__init__(**pickled["config"])  # type: ignore[misc]
        self.load_state_dict(pickled_state(pickled))

    def load_state_dict(self, d: dict[str, Any]) -> None:
        version = d.get("version")
        if version not in (1, FSDP_STATE_VERSION):
            raise ValueError(
                f"xcomm.hooks.FsdpCompressionState: checkpoint version {version!r} is not "
                f"1 or {FSDP_STATE_VERSION}"
            )
        self.feedback.clear()
        for name, r in d["residuals"].items():
            self.feedback.store(self.key(name), r.clone())
        self.stats.load_dict(d["stats"])
        auto = d.get("auto")  # version 1 has none
        if auto is not None:
            self.iter = int(auto["iter"])
            self._measure.next_round = int(auto["next_round"])
            self._first_module = auto["first_module"]
            self._choices.decisions = {k: dict(v) for k, v in auto["decisions"].items()}
            # None before the closed loop.
            self._observed.load_state_dict(auto.get("observed", {}))
            self.check.load_state_dict(auto.get("check", {}))  # None before the check
            if auto["agreed"] is not None:
                links, costs = auto["agreed"]
                self._measure.agreed = (
                    {k: LinkModel(*v) for k, v in links.items()},
                    dict(costs),
                )


class CompressedReduceScatter:
    """FSDP2's reduce-scatter for one module, compressed as ``state`` says.

    Implements FSDP2's ``ReduceScatter`` interface (``allocate`` and
    ``__call__``; FSDP2 checks nothing else) without subclassing it: importing
    FSDP2 costs half a second, which every user of :mod:`xcomm.hooks` would
    pay. Runs synchronously (FSDP2 calls it so, on its reduce-scatter stream).
    """

    def __init__(self, state: FsdpCompressionState, name: str) -> None:
        self.state = state
        self.name = name
        self.key = state.key(name)

    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> dist.Work | None:
        state = self.state
        world = group.size()
        mean = op == dist.ReduceOp.AVG
        if input_tensor.numel() != world * output_tensor.numel():
            raise ValueError(
                f"xcomm.hooks.CompressedReduceScatter: input has {input_tensor.numel()} elements, "
                f"expected {world} x output ({output_tensor.numel()})"
            )
        rs_bytes = alltoall_bytes(input_tensor.nbytes, world)
        if (
            state.method == "none"
            or not (mean or op == dist.ReduceOp.SUM)
            or input_tensor.nbytes < state.min_bytes
            or not input_tensor.is_floating_point()
        ):
            state.stats.record(rs_bytes, rs_bytes)
            return _reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        method = state.method
        if method == "auto":
            t0 = now_us() if timeline_enabled() else 0
            method = state.choose(
                self.name, input_tensor.numel(), group, world, input_tensor.device.type == "cpu"
            )
            record_op(f"AUTO:{method}", input_tensor.nbytes, 0)
            if t0:
                predicted = state.decisions[self.name]["predicted_s"]
                add_span(
                    f"auto: {method}",
                    "auto",
                    "xcomm auto",
                    t0,
                    now_us(),
                    {
                        "module": self.name,
                        "step": state.iter,
                        **{f"predicted_ms_{m}": round(t * 1e3, 3) for m, t in predicted.items()},
                    },
                )
            if method != "int8" and not (method != "none" and state._cast_feedback):
                # What int8 left unsent goes with this reduce-scatter.
                residual = state.feedback.get(self.key)
                if residual is not None:
                    input_tensor = input_tensor + residual.view_as(input_tensor)
                    state.feedback.erase(self.key)
            started = time.perf_counter()
            if method == "none":
                state.stats.record(rs_bytes, rs_bytes)
                work = _reduce_scatter_single(
                    output_tensor, input_tensor, op=op, group=group, async_op=async_op
                )
                # Timed where the call is the reduction: synchronous, on the
                # CPU (a GPU collective returns once queued).
                if work is None and input_tensor.device.type == "cpu":
                    state._took("none", input_tensor.numel(), time.perf_counter() - started)
                return work
            self._compressed(output_tensor, input_tensor, group, world, method, mean)
            if input_tensor.device.type == "cpu":
                state._took(method, input_tensor.numel(), time.perf_counter() - started)
            return None
        self._compressed(output_tensor, input_tensor, group, world, method, mean)
        return None

    def _compressed(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        world: int,
        method: str,
        mean: bool,
    ) -> None:
        # The arithmetic is the backend's own compressed reduce-scatter
        # (_C.CompressedRows); this state adds error feedback and the group.
        state = self.state
        if method == "int8":
            if input_tensor.device.type != "cpu":
                raise TypeError(
                    "xcomm.hooks.CompressedReduceScatter: int8 runs on CPU tensors; "
                    f"got a {input_tensor.device.type} gradient (use method='bf16' or 'fp16' there)"
                )
            with_feedback = bool(state.error_feedback)
        else:
            with_feedback = state._cast_feedback
        rows = _C.CompressedRows(method, world, state.codec)
        wire = rows.encode(input_tensor, state.feedback if with_feedback else None, self.key)
        received = torch.empty_like(wire)
        dist.all_to_all_single(received, wire, group=group)
        state.stats.record(
            alltoall_bytes(input_tensor.nbytes, world), alltoall_bytes(wire.nbytes, world)
        )
        rows.reduce_into(received, output_tensor, mean)


def compress_reduce_scatter(
    model: torch.nn.Module,
    method: str = "int8",
    *,
    state: FsdpCompressionState | None = None,
    **settings: Any,
) -> FsdpCompressionState:
    """Compresses the gradient reduce-scatter of every ``fully_shard`` module
    in ``model`` (see the module docstring) and returns the shared state.

    Args:
        model: a model whose modules ``fully_shard`` wrapped.
        method: one of :data:`FSDP_METHODS`.
        state: a state to reuse (e.g. one loaded from a checkpoint); otherwise
            a new one from ``method`` and ``settings``.
        settings: :class:`FsdpCompressionState`'s other fields.

    Example::

        >>> state = compress_reduce_scatter(model, "bf16")  # doctest: +SKIP
    """
    from torch.distributed.fsdp import FSDPModule

    if state is None:
        state = FsdpCompressionState(method=method, **settings)
    elif settings:
        raise ValueError(
            "xcomm.hooks.compress_reduce_scatter: pass settings or a state, not both "
            f"(got {sorted(settings)})"
        )
    found = 0
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(CompressedReduceScatter(state, name or "<root>"))
            found += 1
    if found == 0:
        raise ValueError(
            "xcomm.hooks.compress_reduce_scatter: no module of the model is wrapped by "
            "fully_shard; call it after fully_shard"
        )
    return state
