"""Options of an xcomm process group."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

__all__ = ["COMPRESSIONS", "Options"]

#: Values of ``Options.compression``.
COMPRESSIONS: tuple[str | None, ...] = (None, "fp16", "bf16", "int8")


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
            then allgather: about 4x fewer bytes than float32), or ``None``.
            Lossy and stateless; it applies to a lone float32/float64 CPU
            tensor under SUM or AVG of at least ``compression_min_bytes``,
            and everything else is reduced exactly. Every rank gets bitwise
            the same result. For error feedback, use :mod:`xcomm.hooks`.
            In a group whose ranks span hosts with several ranks per host
            (the hierarchical shared-memory allreduce), only the step
            between hosts is compressed: sums inside a host stay exact and
            only the bytes that cross hosts shrink.
        compression_min_bytes: Smaller tensors are reduced uncompressed
            (latency, not bandwidth, bounds them).
        int8_chunk_elems: Elements per int8 scale; smaller is more precise
            and costs ``4 / int8_chunk_elems`` bytes per element more.
        shm: Run CPU collectives through shared memory when every rank of
            the group is on one host (see ``xcomm.shm``). ``False``, or the
            environment variable ``XCOMM_SHM=0``, keeps them on Gloo.
        fusion_threshold_bytes: When > 0, small async CPU allreduces issued
            back to back are held and sent as one flat allreduce of up to this
            many bytes (Horovod-style tensor fusion; identical results). Held
            ops go out when the next would pass the threshold, when any other
            op is issued, or as soon as any held op's result is asked for
            (``wait()``, ``get_future()``, ``is_completed()``). 0 (default): off.
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

    Example::

        >>> import datetime, xcomm
        >>> import torch.distributed as dist
        >>> dist.init_process_group(  # doctest: +SKIP
        ...     "xcomm", pg_options=xcomm.Options(timeout=datetime.timedelta(seconds=30)))
        >>> dist.init_process_group(  # doctest: +SKIP
        ...     "xcomm", pg_options=xcomm.Options(compression="int8"))
        >>> fused = xcomm.Options(fusion_threshold_bytes=1 << 20, fusion_cycle_ms=2.0)
    """

    timeout: datetime.timedelta | None = None
    compression: str | None = None
    compression_min_bytes: int = 64 * 1024
    int8_chunk_elems: int = 1024
    shm: bool = True
    fusion_threshold_bytes: int = 0
    fusion_cycle_ms: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.fusion_threshold_bytes, bool) or not isinstance(
            self.fusion_threshold_bytes, int
        ):
            raise TypeError(
                "xcomm.Options: fusion_threshold_bytes must be an int, got "
                f"{type(self.fusion_threshold_bytes).__name__}"
            )
        if self.fusion_threshold_bytes < 0:
            raise ValueError(
                f"xcomm.Options: fusion_threshold_bytes must be >= 0, got {self.fusion_threshold_bytes}"
            )
        if isinstance(self.fusion_cycle_ms, bool) or not isinstance(
            self.fusion_cycle_ms, (int, float)
        ):
            raise TypeError(
                "xcomm.Options: fusion_cycle_ms must be a number, got "
                f"{type(self.fusion_cycle_ms).__name__}"
            )
        if not self.fusion_cycle_ms >= 0 or self.fusion_cycle_ms == float("inf"):
            raise ValueError(
                f"xcomm.Options: fusion_cycle_ms must be >= 0 and finite, got {self.fusion_cycle_ms}"
            )
        if self.fusion_cycle_ms > 0 and self.fusion_threshold_bytes == 0:
            raise ValueError(
                "xcomm.Options: fusion_cycle_ms needs fusion on: set fusion_threshold_bytes > 0 too"
            )
        if not isinstance(self.shm, bool):
            raise TypeError(f"xcomm.Options: shm must be a bool, got {type(self.shm).__name__}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"xcomm.Options: compression must be one of {', '.join(map(repr, COMPRESSIONS))}, "
                f"got {self.compression!r}"
            )
        for name in ("compression_min_bytes", "int8_chunk_elems"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"xcomm.Options: {name} must be an int, got {type(value).__name__}")
        if self.compression_min_bytes < 0:
            raise ValueError(
                f"xcomm.Options: compression_min_bytes must be >= 0, got {self.compression_min_bytes}"
            )
        if self.int8_chunk_elems <= 0:
            raise ValueError(
                f"xcomm.Options: int8_chunk_elems must be > 0, got {self.int8_chunk_elems}"
            )
        if self.timeout is not None:
            if not isinstance(self.timeout, datetime.timedelta):
                raise TypeError(
                    f"xcomm.Options: timeout must be a datetime.timedelta, got {type(self.timeout).__name__}"
                )
            if self.timeout <= datetime.timedelta(0):
                raise ValueError(f"xcomm.Options: timeout must be positive, got {self.timeout}")
