"""Options of an xcomm process group.

``Options`` is the typed Python face of the C++ ``XcommOptions``
(csrc/backend/XcommOptions.hpp), where every default and every check lives:
the defaults below are read from it, and constructing an ``Options`` converts
it to the C++ object, which raises ``TypeError``/``ValueError`` naming the
option.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from . import _C

__all__ = ["COMPRESSIONS", "Options"]

#: Values of ``Options.compression``.
COMPRESSIONS: tuple[str | None, ...] = (
    None,
    *(name for name in _C.compression_names() if name != "none"),
)

_DEFAULTS = _C.XcommOptions()


@dataclass(frozen=True)
class Options:
    """Settings of one xcomm process group, passed as ``pg_options``.

    Attributes:
        timeout: How long a collective may wait for its peers before it fails.
            ``None`` uses the ``timeout`` given to ``init_process_group`` /
            ``new_group`` (30 minutes unless set). When both are given, this
            one wins.
        compression: Compress ``all_reduce`` inside the backend, so code that
            only calls ``all_reduce`` sends fewer bytes: ``"fp16"`` or
            ``"bf16"`` (cast, reduce in low precision, cast back: 2x fewer
            bytes), ``"int8"`` (per-chunk scales, a compressed reduce-scatter
            then allgather: about 4x fewer bytes than float32), ``"auto"``
            (per allreduce, whichever of none, bf16 and int8 a cost model
            with measured inputs predicts fastest: the codecs timed once on
            this machine, the link probed by the group's own collectives
            every 64 compressible allreduces, or further apart where a
            round would take more than about 1% of the time between, every
            input agreed by all ranks so they choose alike; each method's observed time corrects
            its prediction, so one slower than predicted, and than none, is
            left at the next probe; ``compression_stats["auto"]`` on the
            group's backend says what it chose and why; its
            reduce-scatters go uncompressed), or ``None``.
            Lossy and stateless; it applies to a lone float32/float64 CPU
            tensor under SUM or AVG of at least ``compression_min_bytes``,
            and everything else is reduced exactly. Every rank gets bitwise
            the same result. For error feedback, use :mod:`xcomm.hooks`.
            In a group whose ranks span hosts with several ranks per host
            (the hierarchical shared-memory allreduce), only the step
            between hosts is compressed: sums inside a host stay exact and
            only the bytes that cross hosts shrink. ``reduce_scatter_tensor``
            (FSDP2's gradient reduce-scatter) on a group that is not
            hierarchical is compressed too: rows cast or quantized, one
            all-to-all, an exact sum of the decoded rows on each shard's owner.
        auto_methods: With ``compression="auto"``, the methods it may
            choose, e.g. ``("none", "bf16")`` (default: none, bf16 and
            int8). The environment variable ``XCOMM_AUTO_METHODS=none,bf16``
            overrides it.
        auto_link: With ``compression="auto"``, the link as ``(latency
            seconds, bytes per second)`` instead of probing it (a known
            network); the codecs are still timed. ``XCOMM_AUTO_LINK=
            <latency>,<bytes/s>`` overrides it. Like every setting that
            changes a group's collectives, both are agreed by the group's
            ranks when it is made: ranks that differ get a ``ValueError``.
        compression_min_bytes: Smaller tensors are reduced uncompressed
            (latency, not bandwidth, bounds them).
        int8_chunk_elems: Elements per int8 scale; smaller is more precise
            and costs ``4 / int8_chunk_elems`` bytes per element more.
        shm: Run CPU collectives through shared memory when every rank of
            the group is on one host (see ``xcomm.shm``). ``False``, or the
            environment variable ``XCOMM_SHM=0``, keeps them on Gloo.
        shm_hierarchical: A group whose ranks span hosts, with several ranks
            on some host, reduces hierarchically: over shared memory inside
            each host, between the hosts' leaders over Gloo. ``False``, or
            ``XCOMM_SHM_HIERARCHICAL=0``, keeps such a group plain.
        shm_slot_bytes: Bytes per rank per shared-memory buffer (default,
            ``None``: 1 MiB); larger tensors go through in pieces of this
            size. ``XCOMM_SHM_SLOT_BYTES`` overrides it.
        shm_small_bytes: The largest shared-memory ``all_reduce`` taking the
            one-barrier path (``None``: 256 KiB).
            ``XCOMM_SHM_SMALL_BYTES`` overrides it.
        fusion_threshold_bytes: When > 0, small async CPU allreduces issued
            back to back are held and sent as one flat allreduce of up to this
            many bytes (Horovod-style tensor fusion; identical results). Which
            ops travel together is agreed with the other ranks (an allreduce of
            one counter over a Gloo group of its own), so it never depends on
            when each rank waits. With ``fusion_cycle_ms=0`` (on demand) held
            ops go out when the next would pass the threshold, when any other
            op is issued, or as soon as any rank asks for a held op's result
            (``wait()``, ``get_future()``, ``is_completed()``); a rank that
            asks nothing joins within 2 ms. 0 (default): off.
        fusion_cycle_ms: With fusion on, > 0 sends held ops from a background
            thread at most this long after the first of them was issued, as
            Horovod's cycle time, so they travel while the caller computes
            instead of waiting for it to ask. Each cycle first agrees with
            the other ranks (an allreduce of one counter over a Gloo group of
            its own) on how many ops all of them have issued, so every rank
            fuses the same ops. Held ops also leave at once when the threshold
            fills, another op is issued, or ``wait()`` is called;
            ``get_future()`` and ``is_completed()`` do not hurry them. 0
            (default): no cycle, held ops leave only at those points.
        check_collectives: In a group whose CPU collectives run on Gloo
            (ranks on different hosts, or ``shm=False``), first check that
            every rank called the same collective: each op exchanges a
            small descriptor (op, dtype, reduce op, root, bytes; an
            all-to-all's per-pair sizes) with every other rank, point to
            point over a Gloo group of its own, from a worker thread, so the
            caller never waits on it; a rank that skips the op fails the
            others' check at the timeout, named. A mismatch is
            the same ``ValueError`` on every rank, naming both calls, and
            the group stays usable; plain Gloo aborts the process, waits
            for the timeout, or returns a wrong result instead. It costs one
            small round trip per op (see docs/benchmarks.md). Groups on one
            host check over shared memory whatever this says. ``True``
            (default).
        carry_small_ops: With ``check_collectives``, a collective whose
            bytes from one rank to another are at most 128 KiB (256 KiB
            over the other ranks beyond 3 ranks;
            ``xcomm.group_plan(g)["carry_bytes"]``) travels inside the
            check's own exchange instead of a Gloo op after it:
            ``all_reduce``, ``broadcast``, ``all_gather(_into_tensor)``,
            ``all_to_all(_single)``, ``reduce_scatter(_tensor)``,
            ``gather``, ``scatter``, and ``barrier`` (not ``reduce``). An
            all_reduce is then one exchange and a local reduction in rank
            order, the same bits on every rank. Ops are carried only when
            every rank can carry them (dense CPU tensors of a dtype Gloo
            takes, shapes Gloo accepts); otherwise Gloo runs them. ``True``
            (default).
        direct_exchange: With ``check_collectives``, a large
            ``all_to_all(_single)`` or ``all_gather(_into_tensor)`` goes as one
            send and one receive per pair of ranks, all posted at once,
            instead of Gloo's collective (1.1-1.9x its speed on a rate-limited
            link, docs/benchmarks.md). ``False``, or
            ``XCOMM_DIRECT_EXCHANGE=0``, keeps Gloo's. ``True`` (default).

        Like every setting that changes a group's collectives, these are
        agreed by the group's ranks when it is made (ranks that differ get a
        ``ValueError`` naming the setting), and ``xcomm.group_plan(group)
        ["settings"]`` shows what the group took.

    Example::

        >>> import datetime, xcomm
        >>> import torch.distributed as dist
        >>> dist.init_process_group(  # doctest: +SKIP
        ...     "xcomm", pg_options=xcomm.Options(timeout=datetime.timedelta(seconds=30)))
        >>> dist.init_process_group(  # doctest: +SKIP
        ...     "xcomm", pg_options=xcomm.Options(compression="int8"))
        >>> fused = xcomm.Options(fusion_threshold_bytes=1 << 20, fusion_cycle_ms=2.0)
        >>> bounded = xcomm.Options(compression="auto", auto_methods=("none", "bf16"))
    """

    timeout: datetime.timedelta | None = None
    compression: str | None = None
    compression_min_bytes: int = _DEFAULTS.compression_min_bytes
    int8_chunk_elems: int = _DEFAULTS.int8_chunk_elems
    shm: bool = _DEFAULTS.shm
    fusion_threshold_bytes: int = _DEFAULTS.fusion_threshold_bytes
    fusion_cycle_ms: float = _DEFAULTS.fusion_cycle_ms
    check_collectives: bool = _DEFAULTS.check_collectives
    carry_small_ops: bool = _DEFAULTS.carry_small_ops
    auto_methods: tuple[str, ...] | None = None
    auto_link: tuple[float, float] | None = None
    shm_hierarchical: bool = _DEFAULTS.shm_hierarchical
    shm_slot_bytes: int | None = None
    shm_small_bytes: int | None = None
    direct_exchange: bool = _DEFAULTS.direct_exchange

    def __post_init__(self) -> None:
        self.to_cpp()  # checks every field (TypeError/ValueError naming it)

    @property
    def _timeout(self) -> datetime.timedelta | None:
        """c10d's name for ``timeout``: ``init_device_mesh`` reads it from the
        options of a ``backend_override``."""
        return self.timeout

    def to_cpp(self, timeout: datetime.timedelta | None = None) -> _C.XcommOptions:
        """The C++ options, with ``timeout`` standing in when ``self.timeout`` is None."""
        return _C.XcommOptions(
            timeout=self.timeout if self.timeout is not None else timeout,
            compression=self.compression,
            compression_min_bytes=self.compression_min_bytes,
            int8_chunk_elems=self.int8_chunk_elems,
            shm=self.shm,
            fusion_threshold_bytes=self.fusion_threshold_bytes,
            fusion_cycle_ms=self.fusion_cycle_ms,
            check_collectives=self.check_collectives,
            carry_small_ops=self.carry_small_ops,
            auto_methods=self.auto_methods,
            auto_link=self.auto_link,
            shm_hierarchical=self.shm_hierarchical,
            shm_slot_bytes=self.shm_slot_bytes,
            shm_small_bytes=self.shm_small_bytes,
            direct_exchange=self.direct_exchange,
        )
