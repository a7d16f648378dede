"""Compression statistics kept by every xcomm hook state.

Bytes are counted as the traffic a bandwidth-optimal algorithm puts on this
rank's link, so ratios compare like with like across collectives:

- an allreduce of ``b`` bytes sends ``2 (n-1)/n * b`` (ring: reduce-scatter + allgather);
- an allgather where each rank contributes ``b`` bytes sends ``(n-1) * b``;
- an alltoall of a ``b``-byte send buffer sends ``(n-1)/n * b``.

``bytes_before`` is what the uncompressed gradient would cost (an allreduce of
it), ``bytes_on_wire`` what the hook's collectives cost.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["CompressionStats", "allgather_bytes", "allreduce_bytes", "alltoall_bytes"]


def allreduce_bytes(nbytes: int, world: int) -> int:
    """Link traffic of a ring allreduce of ``nbytes`` on ``world`` ranks."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


def allgather_bytes(own_nbytes: int, world: int) -> int:
    """Link traffic of an allgather where each rank contributes ``own_nbytes``."""
    return (world - 1) * own_nbytes


def alltoall_bytes(send_nbytes: int, world: int) -> int:
    """Link traffic of an alltoall of a ``send_nbytes`` send buffer."""
    return (world - 1) * send_nbytes // world if world > 1 else 0


@dataclass
class CompressionStats:
    """Bytes a hook was given and bytes it put on the wire (thread-safe).

    Example::

        >>> stats = CompressionStats()
        >>> stats.record(bytes_before=4000, bytes_on_wire=1000)
        >>> stats.ratio
        4.0
    """

    calls: int = 0
    bytes_before: int = 0
    bytes_on_wire: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, bytes_before: int, bytes_on_wire: int) -> None:
        with self._lock:
            self.calls += 1
            self.bytes_before += int(bytes_before)
            self.bytes_on_wire += int(bytes_on_wire)

    @property
    def ratio(self) -> float:
        """bytes_before / bytes_on_wire (1.0 when nothing was sent)."""
        return self.bytes_before / self.bytes_on_wire if self.bytes_on_wire else 1.0

    def reset(self) -> None:
        with self._lock:
            self.calls = self.bytes_before = self.bytes_on_wire = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "bytes_before": self.bytes_before,
            "bytes_on_wire": self.bytes_on_wire,
            "ratio": self.ratio,
        }

    def load_dict(self, d: dict[str, float]) -> None:
        with self._lock:
            self.calls = int(d["calls"])
            self.bytes_before = int(d["bytes_before"])
            self.bytes_on_wire = int(d["bytes_on_wire"])
