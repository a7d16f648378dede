"""Local SGD with a compressed outer step: DiLoCo and Streaming DiLoCo.

Every rank trains its own copy of the model with its own (inner) optimizer
and talks to the others only every ``H = sync_every`` inner steps. At an outer
step each rank sends its *pseudo-gradient*, how far its parameters moved from
the last agreed ones, ``delta_r = theta_g - theta_r``; the ranks average it,
``delta = mean_r delta_r``, and an outer optimizer (SGD with Nesterov momentum,
``lr=0.7``, ``momentum=0.9`` by default, as in DiLoCo) steps the agreed
parameters with ``delta`` as their gradient: ``theta_g <- OuterOpt(theta_g, delta)``.
Every rank then continues from ``theta_g``. Traffic is one allreduce per ``H``
steps instead of one per step.

**Compression.** ``method`` says how ``delta`` travels:

* ``"none"``: a float32 allreduce (sum, then divided by the group size).
* ``"bf16"`` / ``"fp16"``: each rank casts ``a_r = delta_r + e_r`` down, an
  all-to-all sends row ``j`` to rank ``j``, which sums the rows in float32 in
  rank order, divides, casts the mean down again, and an all-gather returns
  it to everyone. 2x fewer bytes.
* ``"int8"``: the same two steps with rows quantized to int8 with one float32
  scale per ``chunk_elems`` elements (``q = round(a / s)``, ``s = max|a| / 127``),
  as INTELLECT-1 sent its pseudo-gradients. About 4x fewer bytes than
  ``none``, so about ``4 H`` times fewer than DDP's allreduce of every step.

**Error feedback** (on by default for the lossy methods): each rank keeps what
its message did not carry, ``e_r' = a_r - decode(encode(a_r))``, and adds it
to its next pseudo-gradient, so over the run nothing a rank computed is lost.
The mean every rank receives is the same bits on every rank, so ``theta_g``
is identical everywhere.

**Streaming** (Streaming DiLoCo): ``fragments=F`` cuts the parameters, laid
end to end, into ``F`` runs of equal size, synced in turn: fragment ``f`` at inner
steps ``t = (f + 1) H / F + k H``, so the link carries ``1/F`` of the model at
a time. ``overlap_steps=tau`` lets a fragment's exchange run in the background
while ``tau`` more inner steps run (``0 <= tau < H``); when it lands, the
fragment's local parameters become ``mix * theta_local + (1 - mix) * theta_g``
(``mix`` defaults to 0.5 with overlap, 0 without: without overlap every rank
simply continues from ``theta_g``).

Exchanges run on one background thread, in the same order on every rank, on
their own process group (a new group over all ranks when ``group`` is None;
a group you pass must not carry other collectives while an exchange
overlaps inner steps).

**FSDP2.** Parameters that are ``DTensor`` shards are handled by their local
shard: with ``fully_shard(model, mesh=mesh["shard"])`` and
``group=mesh.get_group("replicate")``, each replica of a shard averages with
its peers holding the same shard.

**Checkpoints.** :meth:`DiLoCo.state_dict` holds the agreed parameters, the
outer optimizer's state, this rank's residuals, the step count, and the
result of any exchange still in flight (it waits for it), so a run resumed
from it (with the model's and inner optimizer's own state dicts) continues bit
for bit. Residuals differ between ranks: save one per rank.

Example::

    >>> import torch
    >>> from xcomm.diloco import DiLoCo
    >>> model = torch.nn.Linear(64, 10)
    >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> diloco = DiLoCo(model, sync_every=32, method="int8")  # doctest: +SKIP
    >>> for x, y in batches:  # doctest: +SKIP
    ...     inner.zero_grad()
    ...     torch.nn.functional.cross_entropy(model(x), y).backward()
    ...     inner.step()
    ...     diloco.step()  # every 32 calls: a compressed outer step
    >>> diloco.stats.link_bytes_sent  # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _C
from .hooks._common import all_gather_single
from .hooks._methods import method_names
from .hooks.stats import CompressionStats, allgather_bytes, allreduce_bytes, alltoall_bytes

__all__ = ["DILOCO_METHODS", "DiLoCo"]

#: Values of ``method``.
DILOCO_METHODS: tuple[str, ...] = method_names("diloco")

#: The version :meth:`DiLoCo.state_dict` writes.
DILOCO_STATE_VERSION = 1

_CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds for parameter ``p`` (a DTensor's local shard)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p


@dataclass
class _Pending:
    """An exchange whose mean lands at inner step ``apply_at``; ``overlapped``
    when inner steps ran meanwhile (the landing then mixes)."""

    apply_at: int
    future: concurrent.futures.Future
    overlapped: bool


class _Fragment:
    """A run of elements synced together, with its agreed values and outer optimizer.

    The fragment is the elements ``[start, end)`` of all parameters' local
    tensors laid end to end, so fragments balance whatever the layer sizes."""

    def __init__(
        self,
        index: int,
        params: list[torch.Tensor],
        start: int,
        end: int,
        offset: int,
        outer: OuterOptimizerFactory,
    ) -> None:
        self.index = index
        self.start, self.end = start, end
        self.offset = offset
        # (parameter, first, last) for each parameter the run touches.
        self.pieces: list[tuple[torch.Tensor, int, int]] = []
        at = 0
        for p in params:
            n = _local(p).numel()
            lo, hi = max(start, at), min(end, at + n)
            if lo < hi:
                self.pieces.append((p, lo - at, hi - at))
            at += n
        with torch.no_grad():
            self.agreed = torch.nn.Parameter(self.gather_local())
        self.outer = outer([self.agreed])
        self.pending: _Pending | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    def gather_local(self) -> torch.Tensor:
        """This rank's elements of the fragment as one float32 vector (a copy)."""
        return torch.cat([_local(p).detach().view(-1)[lo:hi].float() for p, lo, hi in self.pieces])

    def scatter_local(self, flat: torch.Tensor) -> None:
        """Writes ``flat`` into this rank's elements of the fragment."""
        with torch.no_grad():
            at = 0
            for p, lo, hi in self.pieces:
                _local(p).view(-1)[lo:hi].copy_(flat[at : at + hi - lo])
                at += hi - lo


def nesterov_sgd(lr: float = 0.7, momentum: float = 0.9) -> OuterOptimizerFactory:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (plain SGD when
    ``momentum`` is 0; ``lr=1, momentum=0`` averages the models, FedAvg).

    Example::

        >>> from xcomm.diloco import nesterov_sgd
        >>> opt = nesterov_sgd(lr=0.5)([torch.nn.Parameter(torch.zeros(3))])
        >>> opt.defaults["nesterov"]
        True
    """

    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    return make


class DiLoCo:
    """Outer steps of local SGD for ``model`` (see the module docstring).

    Call :meth:`step` once after every inner optimizer step.

    Args:
        model: the model (or its parameters) every rank trains locally.
        sync_every: ``H``, inner steps between two outer steps of a fragment.
        method: one of :data:`DILOCO_METHODS`.
        outer_optimizer: builds the outer optimizer from a list of tensors
            (default :func:`nesterov_sgd`; one optimizer per fragment).
        fragments: ``F``, parameter fragments synced in turn (1: plain DiLoCo).
        overlap_steps: ``tau``, inner steps an exchange may overlap (< ``H``).
        mix: weight of the local parameters when an overlapped exchange lands.
        error_feedback: keep what a lossy method did not send (default: on).
        chunk_elems: elements per int8 scale.
        group: the ranks that average (default: all); the exchanges run on a
            new group over them when None.
        timeout: that new group's timeout (default: torch's default for the
            backend); an exchange a peer never joins fails after it.
        sync_initial: broadcast the first rank's parameters so every rank starts
            from the same point.

    Example::

        >>> diloco = DiLoCo(model, sync_every=16, method="int8", fragments=4,
        ...                 overlap_steps=2)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: torch.nn.Module | Iterable[torch.Tensor],
        *,
        sync_every: int = 32,
        method: str = "int8",
        outer_optimizer: OuterOptimizerFactory | None = None,
        fragments: int = 1,
        overlap_steps: int = 0,
        mix: float | None = None,
        error_feedback: bool = True,
        chunk_elems: int = _C.Int8Codec.DEFAULT_CHUNK_ELEMS,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
        sync_initial: bool = True,
    ) -> None:
        params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
        if not params:
            raise ValueError("xcomm.diloco.DiLoCo: the model has no parameters")
        if method not in DILOCO_METHODS:
            raise ValueError(
                f"xcomm.diloco.DiLoCo: method must be one of {DILOCO_METHODS}, got {method!r}"
            )
        if sync_every < 1:
            raise ValueError(f"xcomm.diloco.DiLoCo: sync_every must be >= 1, got {sync_every}")
        total = sum(_local(p).numel() for p in params)
        if not 1 <= fragments <= min(sync_every, total):
            raise ValueError(
                f"xcomm.diloco.DiLoCo: fragments must be in [1, min(sync_every, elements)] = "
                f"[1, {min(sync_every, total)}], got {fragments}"
            )
        if not 0 <= overlap_steps < sync_every:
            raise ValueError(
                f"xcomm.diloco.DiLoCo: overlap_steps must be in [0, sync_every) = "
                f"[0, {sync_every}), got {overlap_steps}"
            )
        if mix is None:
            mix = 0.5 if overlap_steps else 0.0
        if not 0.0 <= mix < 1.0:
            raise ValueError(f"xcomm.diloco.DiLoCo: mix must be in [0, 1), got {mix}")
        if chunk_elems <= 0:
            raise ValueError(f"xcomm.diloco.DiLoCo: chunk_elems must be > 0, got {chunk_elems}")
        for p in params:
            if not p.is_floating_point():
                raise TypeError(
                    f"xcomm.diloco.DiLoCo: parameters must be floating point, got {p.dtype}"
                )
            if not _local(p).is_contiguous():
                raise ValueError(
                    "xcomm.diloco.DiLoCo: parameters must be contiguous; got one of shape "
                    f"{tuple(p.shape)} with strides {_local(p).stride()}"
                )
            if method == "int8" and _local(p).device.type != "cpu":
                raise TypeError(
                    "xcomm.diloco.DiLoCo: int8 runs on CPU tensors; got a "
                    f"{_local(p).device.type} parameter (use method='bf16' or 'fp16' there)"
                )
        self.sync_every = sync_every
        self.method = method
        self.overlap_steps = overlap_steps
        self.mix = mix
        self.error_feedback = error_feedback and method != "none"
        self.group = group if group is not None else dist.new_group(timeout=timeout)
        self.world = dist.get_world_size(self.group)
        self.stats = CompressionStats()
        self.inner_steps = 0
        self.codec = _C.Int8Codec(chunk_elems)
        self._int8_chain = _C.Int8Allreduce()
        self.feedback = _C.ErrorFeedback()
        make_outer = outer_optimizer or nesterov_sgd()
        bounds = [total * i // fragments for i in range(fragments + 1)]
        self.fragments = [
            _Fragment(
                i, params, bounds[i], bounds[i + 1], (i + 1) * sync_every // fragments, make_outer
            )
            for i in range(fragments)
        ]
        self._check_agreement()
        if sync_initial:
            self._broadcast_initial()
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="xcomm-diloco"
        )

    # ---- the training loop's side -------------------------------------------------

    def step(self) -> None:
        """Counts one inner step; runs the outer steps due after it."""
        self.inner_steps += 1
        t = self.inner_steps
        for f in self.fragments:
            if f.pending is not None and f.pending.apply_at == t:
                self._land(f)
        for f in self.fragments:
            if t >= f.offset and (t - f.offset) % self.sync_every == 0:
                self._send(f, t)

    def sync(self) -> None:
        """Lands every exchange in flight, then runs an outer step of every
        fragment now, after which every rank holds the agreed parameters
        (e.g. before evaluating or saving the final model)."""
        for f in self.fragments:
            if f.pending is not None:
                self._land(f)
        for f in self.fragments:
            self._send(f, self.inner_steps, overlap=0)

    def close(self) -> None:
        """Waits for the background exchanges and stops their thread."""
        self._worker.shutdown(wait=True)

    def use_group(self, group: dist.ProcessGroup) -> None:
        """Goes on over ``group`` after a membership change: the survivors'
        group from ``dist.shrink_group``, a group reconfigured in place, or one
        a replacement rank joined. Every member calls it, at the same inner
        step, with the same settings. The outer state then, the same on every
        member:

        * exchanges still in flight on the old group are dropped (wait for
          them first if they may still succeed: an exchange the old group
          failed raised from :meth:`step` already);
        * the error-feedback residuals start afresh: their shards were cut for
          the old group's size, and a failed exchange had folded part of them
          into what it never sent;
        * each outer optimizer keeps its state (momentum), which every
          survivor holds the same;
        * the agreed parameters are broadcast from the new group's rank 0 and
          every member's parameters restart from them (inner steps since the
          last outer step are dropped): a rank that joined gets the model
          here, and the outer optimizers' state by :meth:`load_state_dict` of a
          survivor's :meth:`state_dict` before this call.

        Example::

            >>> try:
            ...     diloco.step()  # doctest: +SKIP
            ... except dist.DistBackendError:
            ...     survivors = dist.shrink_group([dead], group=diloco.group,
            ...                                   shrink_flags=SHRINK_ABORT)
            ...     diloco.use_group(survivors)
        """
        for f in self.fragments:
            if f.pending is not None:
                with contextlib.suppress(Exception):  # the old group's failure, expected
                    f.pending.future.result()
                f.pending = None
        self.group = group
        self.world = dist.get_world_size(group)
        self.feedback = _C.ErrorFeedback()
        self._int8_chain = _C.Int8Allreduce()
        self._check_agreement()
        self._broadcast_initial()

    # ---- outer steps ------------------------------------------------------------------

    def _send(self, f: _Fragment, t: int, overlap: int | None = None) -> None:
        overlap = self.overlap_steps if overlap is None else overlap
        delta = f.agreed.detach() - f.gather_local()
        f.pending = _Pending(
            t + overlap, self._worker.submit(self._mean, f.index, delta), overlap > 0
        )
        if overlap == 0:
            self._land(f)

    def _land(self, f: _Fragment) -> None:
        assert f.pending is not None
        mean = f.pending.future.result()  # raises what the exchange raised
        mixed = self.mix > 0 and f.pending.overlapped
        f.pending = None
        f.agreed.grad = mean
        f.outer.step()
        f.outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            if mixed:
                f.scatter_local(torch.lerp(f.agreed.detach(), f.gather_local(), self.mix))
            else:
                f.scatter_local(f.agreed.detach())

    def _mean(self, key: int, delta: torch.Tensor) -> torch.Tensor:
        """The group's mean of ``delta`` as ``method`` sends it (on the worker thread)."""
        before = allreduce_bytes(delta.nbytes, self.world)
        if self.method == "none":
            dist.all_reduce(delta, group=self.group)
            self.stats.record(before, before)
            return delta.div_(self.world)
        if self.method == "int8":
            return self._mean_int8(key, delta, before)
        return self._mean_cast(key, delta, before, _CAST_DTYPES[self.method])

    def _mean_int8(self, key: int, delta: torch.Tensor, before: int) -> torch.Tensor:
        # The int8 hook's own collectives (csrc/collectives/chains/Int8Allreduce):
        # the alltoall of the shards, each rank's shard mean, the allgather.
        codec, world = self.codec, self.world
        if self.error_feedback:
            packed = codec.pack_shards_with_feedback(delta, world, self.feedback, key)
        else:
            packed = codec.pack_shards(delta, world)
        started = self._int8_chain.start(codec, self.group, delta, delta, None, packed)
        mean = started[0].wait()  # raises what a collective raised
        self.stats.record(
            before, alltoall_bytes(packed.numel(), world) + allgather_bytes(packed.shape[1], world)
        )
        return mean

    def _mean_cast(
        self, key: int, delta: torch.Tensor, before: int, dtype: torch.dtype
    ) -> torch.Tensor:
        # The reduce-scatter half is the backend's and FSDP2's own
        # (_C.CompressedRows: rows cast with the residual, an all-to-all, the
        # sum in float32 in rank order); the mean shard then goes to every
        # rank in the low precision.
        world, n = self.world, delta.numel()
        rows = -(-n // world)
        a = torch.zeros(rows * world, dtype=torch.float32, device=delta.device)
        a[:n] = delta
        codec = _C.CompressedRows(self.method, world)
        low = codec.encode(a, self.feedback if self.error_feedback else None, key)
        received = torch.empty_like(low)
        dist.all_to_all_single(received, low, group=self.group)
        mean = torch.empty(rows, dtype=torch.float32, device=delta.device)
        codec.reduce_into(received, mean, True)
        mean_low = mean.to(dtype)
        gathered = torch.empty(rows * world, dtype=dtype, device=delta.device)
        all_gather_single(gathered, mean_low, group=self.group)
        self.stats.record(
            before, alltoall_bytes(low.nbytes, world) + allgather_bytes(mean_low.nbytes, world)
        )
        return gathered[:n].float()

    # ---- setup ------------------------------------------------------------------------

    def _check_agreement(self) -> None:
        """Every rank of the group must run the same schedule on the same sizes."""
        mine = torch.tensor(
            [
                self.sync_every,
                len(self.fragments),
                self.overlap_steps,
                DILOCO_METHODS.index(self.method),
                int(self.error_feedback),
                self.codec.chunk_elems,
                *(f.numel for f in self.fragments),
            ],
            dtype=torch.int64,
        )
        size = torch.tensor([mine.numel()], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.world)]
        dist.all_gather(sizes, size, group=self.group)
        if any(int(s) != mine.numel() for s in sizes):
            raise ValueError(
                "xcomm.diloco.DiLoCo: ranks disagree on the number of fragments "
                f"({[int(s) - 6 for s in sizes]} by rank)"
            )
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.group)
        names = [
            "sync_every",
            "fragments",
            "overlap_steps",
            "method",
            "error_feedback",
            "chunk_elems",
        ]
        for i, name in enumerate(
            names + [f"fragment {k} size" for k in range(len(self.fragments))]
        ):
            values = [int(e[i]) for e in everyone]
            if len(set(values)) > 1:
                if name == "method":
                    values = [DILOCO_METHODS[v] for v in values]  # type: ignore[misc]
                raise ValueError(
                    f"xcomm.diloco.DiLoCo: ranks disagree on {name}: {values} by rank in the group"
                )

    def _broadcast_initial(self) -> None:
        src = dist.get_global_rank(self.group, 0) if self.group is not dist.group.WORLD else 0
        for f in self.fragments:
            with torch.no_grad():
                dist.broadcast(f.agreed.data, src=src, group=self.group)
            f.scatter_local(f.agreed.detach())

    # ---- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The outer state of this rank (waits for exchanges in flight).

        Save one per rank, beside the model's and the inner optimizer's."""
        fragments = []
        for f in self.fragments:
            pending = None
            if f.pending is not None:
                pending = {
                    "apply_at": f.pending.apply_at,
                    "mean": f.pending.future.result().clone(),
                    "overlapped": f.pending.overlapped,
                }
            residual = self.feedback.get(f.index)
            fragments.append(
                {
                    "agreed": f.agreed.detach().clone(),
                    "outer": copy.deepcopy(f.outer.state_dict()),
                    "residual": None if residual is None else residual.clone(),
                    "pending": pending,
                }
            )
        return {
            "version": DILOCO_STATE_VERSION,
            "method": self.method,
            "sync_every": self.sync_every,
            "inner_steps": self.inner_steps,
            "fragments": fragments,
            "stats": self.stats.as_dict(),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Loads :meth:`state_dict`'s output into a DiLoCo built with the same settings."""
        if d.get("version") != DILOCO_STATE_VERSION:
            raise ValueError(
                f"xcomm.diloco.DiLoCo: checkpoint version {d.get('version')!r} is not "
                f"{DILOCO_STATE_VERSION}"
            )
        saved = d["fragments"]
        sizes = [s["agreed"].numel() for s in saved]
        if (d["method"], d["sync_every"], sizes) != (
            self.method,
            self.sync_every,
            [f.numel for f in self.fragments],
        ):
            raise ValueError(
                "xcomm.diloco.DiLoCo: the checkpoint was made with different settings: "
                f"method {d['method']!r}, sync_every {d['sync_every']}, fragment sizes {sizes}; "
                f"this one has {self.method!r}, {self.sync_every}, "
                f"{[f.numel for f in self.fragments]}"
            )
        for f, s in zip(self.fragments, saved, strict=True):
            if f.pending is not None:
                f.pending.future.result()
            with torch.no_grad():
                f.agreed.copy_(s["agreed"])
            f.outer.load_state_dict(copy.deepcopy(s["outer"]))
            self.feedback.erase(f.index)
            if s["residual"] is not None:
                self.feedback.store(f.index, s["residual"].clone())
            f.pending = None
            if s["pending"] is not None:
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(s["pending"]["mean"].clone())
                f.pending = _Pending(
                    int(s["pending"]["apply_at"]), done, bool(s["pending"]["overlapped"])
                )
        self.inner_steps = int(d["inner_steps"])
        self.stats.load_dict(d["stats"])
