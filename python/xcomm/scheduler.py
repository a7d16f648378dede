"""Chunked, priority-ordered reduction of gradient buckets (ByteScheduler-style).

Backward produces the last layers' gradients first, so a FIFO engine sends
the first layers' gradients last, although the next forward pass needs them
first. When the link falls behind backward, a backlog builds up and the next
forward waits for the whole backlog. :class:`ChunkScheduler` instead

- splits every bucket into chunks of at most ``chunk_bytes``, so a
  large bucket cannot hold the link for long;
- sends, from its own thread and with at most ``max_in_flight`` chunks on the
  wire (packing the next while the previous is in transfer), the ready chunk of highest
  priority: the highest bucket index, i.e. the layers closest to the input,
  which the next forward needs first (``priority=True``), or the lowest
  chunk index (``priority=False``: FIFO, the baseline).

All ranks must issue the same chunks in the same order, yet each rank sees
its gradients become ready at slightly different times. So the choice is made
from information every rank shares: each chunk travels with a small
*readiness vector* (1 for every chunk this rank has ready, 0 otherwise),
summed by the same allreduce. After chunk ``k`` lands, every rank knows
exactly which chunks were ready on **all** ranks, and picks the next chunk
from those; when none is, it takes the lowest unsent chunk (waiting for it
locally). Completions are consumed at fixed points of the loop (when
``max_in_flight`` chunks are out), so the information behind each choice, and
hence the choice, is identical everywhere; the data itself is reduced exactly
as one allreduce would.

The engine itself is C++ (``csrc/schedule/ChunkScheduler``): its thread
chooses, packs and issues the chunks on the group's backend directly and
records the transfer spans in xcomm's timeline; the landed/error callbacks
are the only Python it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from . import _C

__all__ = ["ChunkScheduler"]


class ChunkScheduler:
    """Sends the chunks of ``buffers`` (one flat tensor per bucket) in priority order.

    Args:
        buffers: each bucket's flat buffer, in bucket index order.
        chunk_bytes: most bytes per chunk (> 0).
        priority: highest bucket index first among the chunks ready on all
            ranks; ``False`` for FIFO.
        process_group: the group of the allreduces (default: the default group).
        on_bucket_landed: ``f(bucket_index, first_issue_us)`` once all of a
            bucket's chunks are reduced (runs on the scheduler's thread);
            ``first_issue_us`` is when its first chunk went on the wire.
        on_error: ``f(exception)`` when a transfer fails (the thread then stops).
        max_in_flight: chunks on the wire at once (>= 1). With 2, chunk ``i+1``
            is chosen and packed while chunk ``i`` is still in transfer, so the
            link never idles between chunks; the choice then uses the
            readiness known one chunk earlier.

    Example::

        >>> sched = ChunkScheduler([buf0, buf1], 1 << 20, True, None,  # doctest: +SKIP
        ...                        lambda b, t: print("bucket", b, "landed"), print)
        >>> sched.mark_ready(0); sched.mark_ready(1); sched.join()  # doctest: +SKIP
    """

    def __init__(
        self,
        buffers: Sequence[torch.Tensor],
        chunk_bytes: int,
        priority: bool,
        process_group: dist.ProcessGroup | None,
        on_bucket_landed: Callable[[int, int], None],
        on_error: Callable[[BaseException], None],
        max_in_flight: int = 2,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"xcomm.ChunkScheduler: chunk_bytes must be > 0, got {chunk_bytes}")
        if max_in_flight < 1:
            raise ValueError(
                f"xcomm.ChunkScheduler: max_in_flight must be >= 1, got {max_in_flight}"
            )
        if not buffers:
            raise ValueError("xcomm.ChunkScheduler: no buffers")
        self.buffers = list(buffers)
        self.priority = priority
        self.max_in_flight = max_in_flight
        self.process_group = process_group
        pg = process_group if process_group is not None else dist.group.WORLD
        backend = pg._get_backend(self.buffers[0].device)
        self._impl = _C.ChunkScheduler(
            self.buffers,
            int(chunk_bytes),
            bool(priority),
            backend,
            on_bucket_landed,
            on_error,
            int(max_in_flight),
        )

    @property
    def chunks(self) -> list[tuple[int, int, int]]:
        """``(bucket, start, length)`` per chunk, in bucket order."""
        return list(self._impl.chunks)

    @property
    def order(self) -> list[int]:
        """The chunks in the order last sent (for tests and the timeline)."""
        return list(self._impl.order)

    def mark_ready(self, bucket: int | Sequence[int]) -> None:
        """Bucket(s) complete (a sequence is marked at once); starts this
        iteration's thread on first use."""
        buckets = [bucket] if isinstance(bucket, int) else list(bucket)
        self._impl.mark_ready(buckets)

    def join(self) -> None:
        """Waits for this iteration's thread, then resets for the next iteration."""
        self._impl.join()

    def abort(self) -> None:
        """Stops the thread at its next choice and joins it."""
        self._impl.abort()
