"""Compression statistics kept by every xcomm hook state.

Bytes are counted as the traffic a bandwidth-optimal algorithm puts on this
rank's link, so ratios compare like with like across collectives:

- an allreduce of ``b`` bytes sends ``2 (n-1)/n * b`` (ring: reduce-scatter + allgather);
- an allgather where each rank contributes ``b`` bytes sends ``(n-1) * b``;
- an alltoall of a ``b``-byte send buffer sends ``(n-1)/n * b``.

``link_bytes_before`` is what the uncompressed gradient would cost (an
allreduce of it), ``link_bytes_sent`` what the hook's collectives cost. (These
are per-rank link bytes; ``xcomm.stats()``'s ``bytes_in``/``bytes_on_wire``
count payloads, the bytes handed to and sent by each op.)
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
    """Link bytes a hook's gradients would have cost uncompressed, and link
    bytes its collectives cost (thread-safe).

    Example::

        >>> stats = CompressionStats()
        >>> stats.record(link_bytes_before=4000, link_bytes_sent=1000)
        >>> stats.ratio
        4.0
    """

    calls: int = 0
    link_bytes_before: int = 0
    link_bytes_sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, link_bytes_before: int, link_bytes_sent: int) -> None:
        with self._lock:
            self.calls += 1
            self.link_bytes_before += int(link_bytes_before)
            self.link_bytes_sent += int(link_bytes_sent)

    @property
    def ratio(self) -> float:
        """link_bytes_before / link_bytes_sent (1.0 when nothing was sent)."""
        return self.link_bytes_before / self.link_bytes_sent if self.link_bytes_sent else 1.0

    def reset(self) -> None:
        with self._lock:
            self.calls = self.link_bytes_before = self.link_bytes_sent = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "link_bytes_before": self.link_bytes_before,
            "link_bytes_sent": self.link_bytes_sent,
            "ratio": self.ratio,
        }

    def __getstate__(self) -> dict[str, float]:
        return self.as_dict()  # without the lock

    def __setstate__(self, d: dict[str, float]) -> None:
        self._lock = threading.Lock()
        self.load_dict(d)

    def load_dict(self, d: dict[str, float]) -> None:
        """Loads ``as_dict()``'s output; checkpoints from before the rename
        (``bytes_before``/``bytes_on_wire``) load too."""
        with self._lock:
            self.calls = int(d["calls"])
            self.link_bytes_before = int(d.get("link_bytes_before", d.get("bytes_before", 0)))
            self.link_bytes_sent = int(d.get("link_bytes_sent", d.get("bytes_on_wire", 0)))
