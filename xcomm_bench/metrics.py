"""Bandwidth arithmetic of the benchmarks, following nccl-tests (doc/PERFORMANCE.md).

* ``algbw = S / t`` where ``S`` is the op's buffer size in bytes: the tensor
  for allreduce and broadcast, the *total* (gathered / scattered / exchanged)
  buffer for allgather, reduce_scatter and alltoall. GB are 1e9 bytes.
* ``busbw = algbw * factor(op, n)``, which makes ops and world sizes
  comparable with a single link's peak:

  ==============  ===========
  op              factor
  ==============  ===========
  allreduce       2(n-1)/n
  allgather       (n-1)/n
  reduce_scatter  (n-1)/n
  alltoall        (n-1)/n
  broadcast       1
  ==============  ===========

Example::

    >>> busbw_factor("allreduce", 4)
    1.5
    >>> round(busbw(1 << 20, 1e-3, "allgather", 2), 4)   # 1 MiB in 1 ms, 2 ranks
    0.5243
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["OPS", "algbw", "busbw", "busbw_factor", "percentile"]

#: The collectives the sweep knows, in report order.
OPS: tuple[str, ...] = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall")


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` at ``world_size`` ranks.

    Raises:
        ValueError: unknown op or world size < 1.
    """
    n = world_size
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("allgather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes): ``nbytes / seconds``."""
    if seconds <= 0:
        return math.inf
    return nbytes / seconds / 1e9


def busbw(nbytes: int, seconds: float, op: str, world_size: int) -> float:
    """Bus bandwidth in GB/s: ``algbw * busbw_factor(op, world_size)``."""
    return algbw(nbytes, seconds) * busbw_factor(op, world_size)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation, like numpy's default."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0-100, got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
