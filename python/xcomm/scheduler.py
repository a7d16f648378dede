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
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import trace

__all__ = ["ChunkScheduler"]

TRACK_CHUNKS = "engine 2: transfer"


class ChunkScheduler:
    """Sends the chunks of ``buffers`` (one flat tensor per bucket) in priority order.

    Args:
        buffers: each bucket's flat buffer, in bucket index order.
        chunk_bytes: most bytes per chunk (> 0).
        priority: highest bucket index first among the chunks ready on all
            ranks; ``False`` for FIFO.
        process_group: the group of the allreduces.
        on_bucket_landed: ``f(bucket_index, first_issue_us)`` once all of a
            bucket's chunks are reduced (runs on the scheduler's thread);
            ``first_issue_us`` is when its first chunk went on the wire.
        on_error: ``f(exception)`` when a transfer fails (the thread then stops).
        max_in_flight: chunks on the wire at once (>= 1). With 2, chunk ``i+1``
            is chosen and packed while chunk ``i`` is still in transfer, so the
            link never idles between chunks; the choice then uses the
            readiness known one chunk earlier.
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
            raise ValueError(
                f"xcomm.ChunkScheduler: chunk_bytes must be > 0, got {chunk_bytes}"
            )
        if max_in_flight < 1:
            raise ValueError(
                f"xcomm.ChunkScheduler: max_in_flight must be >= 1, got {max_in_flight}"
            )
        self.max_in_flight = max_in_flight
        self.buffers = list(buffers)
        self.priority = priority
        self.process_group = process_group
        self.world = dist.get_world_size(process_group)
        self._on_bucket_landed = on_bucket_landed
        self._on_error = on_error
        # (bucket, start, length) per chunk, in bucket order.
        self.chunks: list[tuple[int, int, int]] = []
        for b, buf in enumerate(self.buffers):
            chunk_elems = max(1, chunk_bytes // buf.element_size())
            for start in range(0, buf.numel(), chunk_elems):
                self.chunks.append((b, start, min(chunk_elems, buf.numel() - start)))
        self._cv = threading.Condition()
        self._ready: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.order: list[
            int
        ] = []  # chunks in the order last sent (for tests and the timeline)

    def mark_ready(self, bucket: int) -> None:
        """Bucket ``bucket`` is complete; starts this iteration's thread on first use."""
        with self._cv:
            self._ready.add(bucket)
            self._cv.notify_all()
            if self._thread is None:
                self.order = []
                self._thread = threading.Thread(
                    target=self._run, name="xcomm-chunk-scheduler", daemon=True
                )
                self._thread.start()

    def join(self) -> None:
        """Waits for this iteration's thread, then resets for the next iteration."""
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._cv:
            self._thread = None
            self._ready = set()

    def abort(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self.join()
        self._stop = False

    def _next_chunk(self, sent: list[bool], everywhere: list[bool]) -> int:
        unsent = [c for c in range(len(self.chunks)) if not sent[c]]
        if self.priority:
            candidates = [c for c in unsent if everywhere[c]]
            if candidates:
                # Highest bucket first (the layers nearest the input); in a bucket, in order.
                return max(candidates, key=lambda c: (self.chunks[c][0], -c))
        return unsent[0]

    def _run(self) -> None:
        n = len(self.chunks)
        sent = [False] * n
        everywhere = [False] * n
        left = [0] * len(self.buffers)
        first_issue_us = [0] * len(self.buffers)
        for b, _, _ in self.chunks:
            left[b] += 1
        # (chunk, work, message, issued_us); at most max_in_flight of them.
        in_flight: collections.deque[tuple[int, Any, torch.Tensor, int]] = (
            collections.deque()
        )

        def complete_oldest() -> None:
            nonlocal everywhere
            c, work, message, t1 = in_flight.popleft()
            work.wait()
            t2 = trace.now_us()
            b, start, length = self.chunks[c]
            self.buffers[b].narrow(0, start, length).copy_(message.narrow(0, 0, length))
            counts = message.narrow(0, length, n).tolist()
            everywhere = [count > self.world - 0.5 for count in counts]
            trace.add_span(
                f"bucket {b} chunk {c}",
                "transfer",
                TRACK_CHUNKS,
                t1,
                t2,
                {"bytes": length * message.element_size(), "priority": self.priority},
            )
            left[b] -= 1
            if left[b] == 0:
                self._on_bucket_landed(b, first_issue_us[b])

        try:
            for _ in range(n):
                # The choice depends only on results completed so far, and the
                # loop completes them at the same points on every rank.
                c = self._next_chunk(sent, everywhere)
                b, start, length = self.chunks[c]
                with self._cv:
                    while b not in self._ready and not self._stop:
                        self._cv.wait()
                    if self._stop:
                        return
                    ready_here = [
                        1.0 if self.chunks[j][0] in self._ready else 0.0
                        for j in range(n)
                    ]
                src = self.buffers[b].narrow(0, start, length)
                # Packing this chunk overlaps the transfer of the one in flight.
                message = torch.cat(
                    [src, torch.tensor(ready_here, dtype=src.dtype, device=src.device)]
                )
                t1 = trace.now_us()
                if not first_issue_us[b]:
                    first_issue_us[b] = t1
                work = dist.all_reduce(message, group=self.process_group, async_op=True)
                in_flight.append((c, work, message, t1))
                sent[c] = True
                self.order.append(c)
                if len(in_flight) >= self.max_in_flight:
                    complete_oldest()
            while in_flight:
                complete_oldest()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting step
            self._on_error(e)
