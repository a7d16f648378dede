"""Per-operation communication statistics: ``xcomm.stats()``.

Every collective an xcomm process group runs is recorded when it completes,
and so is every bucket reduction of :class:`xcomm.GradientBucketer`. For each
op name the table holds

- ``calls`` and ``failures``;
- ``bytes_in``: the payload the caller handed over;
- ``bytes_on_wire``: the payload actually communicated (smaller under
  compression);
- ``compression_ratio`` = ``bytes_in / bytes_on_wire`` (1.0 when nothing was sent);
- ``time_queued_s``: total time spent waiting inside xcomm before the transfer
  started (a full bucket waiting for an earlier bucket to be launched; 0 for
  ops handed to the transport at once);
- ``time_on_wire_s``: total time from the start of the transfer to its completion.

Op names: the backend's op types (``ALLREDUCE``, ``BROADCAST``, ...; one call
per collective), ``ALLREDUCE_FUSED`` (one call per fused transfer when
``Options(fusion_threshold_bytes=...)`` is on; the held ops are counted only
there), and the bucketer's ``bucket_allreduce``,
``bucket_allreduce[<hook name>]`` and ``bucket_allreduce[fifo|priority]``.

The registry is process-wide and thread-safe (a C++ mutex); :func:`reset_stats`
clears it.

Example::

    >>> import xcomm
    >>> xcomm.reset_stats()
    >>> # ... dist.all_reduce(t) on an xcomm group ...
    >>> xcomm.stats().get("ALLREDUCE", {}).get("calls", 0) >= 0
    True
"""

from __future__ import annotations

from typing import TypedDict

from . import _C

__all__ = ["OpStats", "record_op", "reset_stats", "stats"]


class OpStats(TypedDict):
    calls: int
    failures: int
    bytes_in: int
    bytes_on_wire: int
    compression_ratio: float
    time_queued_s: float
    time_on_wire_s: float


def stats() -> dict[str, OpStats]:
    """A snapshot (a copy) of the statistics, keyed by op name (e.g. ``"ALLREDUCE"``)."""
    out: dict[str, OpStats] = {}
    for op, d in _C.stats_snapshot().items():
        wire = d["bytes_on_wire"]
        out[op] = OpStats(
            calls=d["calls"],
            failures=d["failures"],
            bytes_in=d["bytes_in"],
            bytes_on_wire=wire,
            compression_ratio=d["bytes_in"] / wire if wire else 1.0,
            time_queued_s=d["time_queued_s"],
            time_on_wire_s=d["time_on_wire_s"],
        )
    return out


def reset_stats() -> None:
    """Clears every op's statistics."""
    _C.stats_reset()


def record_op(
    op: str,
    bytes_in: int,
    bytes_on_wire: int,
    time_queued_s: float = 0.0,
    time_on_wire_s: float = 0.0,
    failed: bool = False,
) -> None:
    """Adds one call of ``op`` to the statistics (for engines built on xcomm)."""
    if bytes_in < 0 or bytes_on_wire < 0:
        raise ValueError(
            f"xcomm.record_op: byte counts must be >= 0, got {bytes_in}, {bytes_on_wire}"
        )
    _C.stats_record(
        op,
        int(bytes_in),
        int(bytes_on_wire),
        float(time_queued_s),
        float(time_on_wire_s),
        failed,
    )
