"""How a :class:`xcomm.GradientBucketer` reduces its buckets: one class per path.

The bucketer keeps what every path shares (the layout, the per-iteration
bookkeeping of which gradients are in, the landing loop of ``synchronize``/
``step``, the errors) and hands the rest to one :class:`BucketPath`, chosen
once at construction by :func:`choose_path`:

- :class:`LauncherPath`, the plain path (CPU buckets, no comm hook,
  ``schedule="immediate"``): copy-in, launch in index order, copy-back, stats
  and spans all run in C++ (``csrc/schedule/BucketLauncher``), without the GIL;
- :class:`HookPath` (a comm hook, or buckets on another device): copy-in here,
  each full bucket is launched in index order, through the hook or a plain
  asynchronous allreduce, and copied back by a callback on its future;
- :class:`ChunkedPath` (``schedule="fifo"|"priority"``): copy-in here, full
  buckets are handed to the C++ chunk scheduler
  (:class:`xcomm.scheduler.ChunkScheduler`), whose thread copies each bucket
  back once all of its chunks are reduced.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _C, trace
from .opstats import record_op
from .scheduler import ChunkScheduler

CompressionHook = Callable[[Any, Any], torch.futures.Future]

TRACK_ENCODE = "engine 1: encode (backward thread)"
TRACK_TRANSFER = "engine 2: transfer"
TRACK_DECODE = "engine 3: decode (completion thread)"
TRACK_OPTIM = "engine 4: optimizer step"


class BucketerGradBucket:
    """One bucket of a :class:`xcomm.GradientBucketer` presented like DDP's
    ``dist.GradBucket``: what the bucketer hands to a DDP comm hook."""

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        params: list[nn.Parameter],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._params = params
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer.narrow(0, offset, p.numel()).view_as(p))
            offset += p.numel()
        return out

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    optimizer: torch.optim.Optimizer | None = None
    # Per-iteration state, reset by GradientBucketer._reset_iteration.
    pending: int = 0
    ready_us: int = 0
    landed_us: int = 0
    future: Any = None  # torch.futures.Future, or _LaunchedFuture on the plain path
    ready_params: set[int] = field(default_factory=set)


class BucketPath(ABC):
    """The reduction of a bucketer's buckets, one iteration at a time.

    Per iteration the bucketer calls :meth:`reset_iteration`, then
    :meth:`grad_ready` for every gradient backward produces (it has already
    checked and counted it), then either :meth:`wait` on every bucket in
    :meth:`landing_order` and :meth:`end_iteration`, or, when gradients are
    missing, :meth:`abandon` (then :meth:`reset_iteration` again).
    """

    def __init__(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets

    @abstractmethod
    def reset_iteration(self) -> None:
        """Gives every bucket this iteration's future and resets the path's own state."""

    @abstractmethod
    def grad_ready(self, p: nn.Parameter, bucket: Bucket, offset: int) -> None:
        """``p.grad`` is final: put it at ``offset`` of ``bucket`` and launch what is full."""

    @abstractmethod
    def abandon(self) -> None:
        """Gradients are missing: lets launched reductions finish, launches nothing more."""

    def landing_order(self) -> list[Bucket]:
        """The buckets in the order they are expected to land (a fresh list)."""
        return list(self.buckets)

    def wait(self, bucket: Bucket) -> None:
        """Waits until ``bucket`` is reduced and copied back (raises its error)."""
        bucket.future.wait()

    def end_iteration(self) -> None:
        """After every bucket was waited for (or one failed)."""


class _LaunchedFuture:
    """A bucket's reduction in the C++ launcher, seen as a future (``done``/``wait``)."""

    def __init__(self, launcher: Any, index: int) -> None:
        self._launcher = launcher
        self._index = index

    def done(self) -> bool:
        return bool(self._launcher.done(self._index))

    def wait(self) -> None:
        self._launcher.wait(self._index)


class LauncherPath(BucketPath):
    """CPU buckets, no hook, immediate: all in C++ (``csrc/schedule/BucketLauncher``)."""

    def __init__(
        self,
        buckets: list[Bucket],
        params: list[nn.Parameter],
        process_group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__(buckets)
        self._param_index = {id(p): i for i, p in enumerate(params)}
        pg = process_group if process_group is not None else dist.group.WORLD
        slots = [None] * len(params)
        for b in buckets:
            for p, off in zip(b.params, b.offsets, strict=True):
                slots[self._param_index[id(p)]] = (b.index, off, p.numel())
        self.launcher = _C.BucketLauncher(
            [b.buffer for b in buckets], slots, pg._get_backend(torch.device("cpu"))
        )

    def reset_iteration(self) -> None:
        for b in self.buckets:
            b.future = _LaunchedFuture(self.launcher, b.index)
        self.launcher.reset()

    def grad_ready(self, p: nn.Parameter, bucket: Bucket, offset: int) -> None:
        self.launcher.grad_ready(self._param_index[id(p)], p.grad)

    def abandon(self) -> None:
        for b in self.buckets[: self.launcher.launched]:  # the rest never launched
            with contextlib.suppress(Exception):
                b.future.wait()

    def wait(self, bucket: Bucket) -> None:
        bucket.future.wait()
        bucket.landed_us = self.launcher.landed_us(bucket.index)


class _CopyInPath(BucketPath):
    """The Python paths: copy each gradient into its bucket, act on full buckets."""

    def __init__(self, buckets: list[Bucket], world: int, scale: bool, lock: threading.Lock):
        super().__init__(buckets)
        self._world = world
        self._scale = scale
        self._lock = lock

    def grad_ready(self, p: nn.Parameter, bucket: Bucket, offset: int) -> None:
        grad = p.grad
        view = bucket.buffer.narrow(0, offset, p.numel())
        with torch.autograd.profiler.record_function("xcomm::bucketer::copy_in"):
            if self._scale:
                # DDP's reducer also scales by 1/n while copying, then sums.
                torch.mul(grad.reshape(-1), 1.0 / self._world, out=view)
            else:
                view.copy_(grad.reshape(-1))
        # Acting under the lock keeps the index order even if gradients
        # arrive on several autograd threads (one per device).
        with self._lock:
            bucket.pending -= 1
            if bucket.pending == 0:
                bucket.ready_us = trace.now_us()
                self._bucket_full(bucket)

    @abstractmethod
    def _bucket_full(self, bucket: Bucket) -> None:
        """All of ``bucket``'s gradients are in (called under the lock)."""


class HookPath(_CopyInPath):
    """A comm hook (or a plain allreduce of non-CPU buckets), launched from Python."""

    def __init__(
        self,
        buckets: list[Bucket],
        world: int,
        lock: threading.Lock,
        process_group: dist.ProcessGroup | None,
        compression: tuple[CompressionHook, Any] | None,
    ) -> None:
        # The hook gets the bucket unscaled and averages it itself.
        super().__init__(buckets, world, compression is None, lock)
        self._process_group = process_group
        self._compression = compression
        self._next_launch = 0

    def reset_iteration(self) -> None:
        self._next_launch = 0
        for b in self.buckets:
            b.future = None  # set when the bucket is launched

    def abandon(self) -> None:
        for b in self.buckets:
            if b.future is not None:
                with contextlib.suppress(Exception):
                    b.future.wait()

    def _bucket_full(self, bucket: Bucket) -> None:
        while (
            self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0
        ):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        i = bucket.index
        start_us = trace.now_us()
        queued_s = (start_us - bucket.ready_us) * 1e-6
        wire_ratio = 1.0
        with torch.autograd.profiler.record_function(f"xcomm::bucket{i}::encode"):
            if self._compression is None:
                work = dist.all_reduce(bucket.buffer, group=self._process_group, async_op=True)
                fut = work.get_future()
                op = "bucket_allreduce"
            else:
                hook, state = self._compression
                stats = getattr(state, "stats", None)
                before = (
                    (stats.link_bytes_before, stats.link_bytes_sent)
                    if hasattr(stats, "link_bytes_before")
                    else None
                )
                view = BucketerGradBucket(
                    i, bucket.buffer, bucket.params, i == len(self.buckets) - 1
                )
                fut = hook(state, view)
                if before is not None and stats.link_bytes_before > before[0]:
                    wire_ratio = (stats.link_bytes_sent - before[1]) / (
                        stats.link_bytes_before - before[0]
                    )
                op = f"bucket_allreduce[{getattr(hook, '__name__', 'hook')}]"
        launched_us = trace.now_us()
        nbytes = bucket.buffer.nbytes
        trace.add_span(
            f"bucket {i} encode",
            "encode",
            TRACK_ENCODE,
            start_us,
            launched_us,
            {"bytes": nbytes},
        )

        def land(f: torch.futures.Future) -> None:
            landed_us = trace.now_us()
            bucket.landed_us = landed_us
            failed = True
            device = bucket.buffer.device
            landed = None  # on a GPU: an event where the transfer ends on the stream
            try:
                value = f.value()
                result = value[0] if isinstance(value, (list, tuple)) else value
                if device.type == "cuda":
                    landed = torch.cuda.Event(enable_timing=True)
                    landed.record()
                with torch.autograd.profiler.record_function(f"xcomm::bucket{i}::decode"):
                    for p, off in zip(bucket.params, bucket.offsets):
                        p.grad.copy_(result.narrow(0, off, p.numel()).view_as(p))
                failed = False
            finally:

                def spans(landed_at: int, done_us: int) -> None:
                    bucket.landed_us = landed_at
                    trace.add_span(
                        f"bucket {i} transfer",
                        "transfer",
                        TRACK_TRANSFER,
                        launched_us,
                        landed_at,
                        {"bytes": nbytes, "queued_us": int(queued_s * 1e6)},
                    )
                    trace.add_span(f"bucket {i} decode", "decode", TRACK_DECODE, landed_at, done_us)
                    record_op(
                        op,
                        nbytes,
                        round(nbytes * wire_ratio),
                        queued_s,
                        (landed_at - launched_us) * 1e-6,
                        failed,
                    )

                if landed is None:
                    spans(landed_us, trace.now_us())
                else:
                    # A CUDA future completes when its op is queued: end the
                    # spans when the stream has run the transfer and the
                    # copy-back (the copy's length from the two events).
                    copied = torch.cuda.Event(enable_timing=True)
                    copied.record()

                    def at_completion(done_us: int) -> None:
                        copy_us = int(landed.elapsed_time(copied) * 1000)
                        spans(max(launched_us, done_us - copy_us), done_us)

                    trace.when_stream_done(device, at_completion)

        # The transfer as an async torch.profiler range: it ends when the future completes.
        with torch.autograd.profiler.record_function(f"xcomm::bucket{i}::transfer") as rf:
            fut = rf._call_end_callbacks_on_future(fut)
        bucket.future = fut.then(land)


class ChunkedPath(_CopyInPath):
    """``schedule="fifo"|"priority"``: full buckets go to the C++ chunk scheduler."""

    def __init__(
        self,
        buckets: list[Bucket],
        world: int,
        lock: threading.Lock,
        process_group: dist.ProcessGroup | None,
        schedule: str,
        chunk_bytes: int,
    ) -> None:
        super().__init__(buckets, world, True, lock)  # no hook here: always averaged
        self._schedule = schedule
        self.scheduler = ChunkScheduler(
            [b.buffer for b in buckets],
            chunk_bytes,
            schedule == "priority",
            process_group,
            self._on_chunks_landed,
            self._on_scheduler_error,
        )

    def reset_iteration(self) -> None:
        for b in self.buckets:
            b.future = torch.futures.Future()  # completed by the chunk scheduler

    def _bucket_full(self, bucket: Bucket) -> None:
        self.scheduler.mark_ready(bucket.index)  # the scheduler picks the order

    def abandon(self) -> None:
        self.scheduler.abort()

    def landing_order(self) -> list[Bucket]:
        # Priority scheduling sends the last buckets (the first layers) first.
        if self.scheduler.priority:
            return list(reversed(self.buckets))
        return list(self.buckets)

    def end_iteration(self) -> None:
        self.scheduler.join()

    def _on_chunks_landed(self, index: int, first_issue_us: int) -> None:
        """Scheduler thread: all chunks of bucket ``index`` are reduced in its buffer."""
        bucket = self.buckets[index]
        bucket.landed_us = trace.now_us()
        try:
            with torch.autograd.profiler.record_function(f"xcomm::bucket{index}::decode"):
                for p, off in zip(bucket.params, bucket.offsets):
                    p.grad.copy_(bucket.buffer.narrow(0, off, p.numel()).view_as(p))
            trace.add_span(
                f"bucket {index} decode",
                "decode",
                TRACK_DECODE,
                bucket.landed_us,
                trace.now_us(),
            )
            nbytes = bucket.buffer.nbytes
            record_op(
                f"bucket_allreduce[{self._schedule}]",
                nbytes,
                nbytes,
                max(0, first_issue_us - bucket.ready_us) * 1e-6,
                (bucket.landed_us - first_issue_us) * 1e-6,
            )
            bucket.future.set_result(bucket.buffer)
        except BaseException as e:  # noqa: BLE001
            bucket.future.set_exception(e)

    def _on_scheduler_error(self, error: BaseException) -> None:
        for b in self.buckets:
            if b.future is not None and not b.future.done():
                b.future.set_exception(error)


def choose_path(
    buckets: list[Bucket],
    params: list[nn.Parameter],
    process_group: dist.ProcessGroup | None,
    world: int,
    lock: threading.Lock,
    compression: tuple[CompressionHook, Any] | None,
    schedule: str,
    chunk_bytes: int,
) -> BucketPath:
    """The path for these arguments (already validated by the bucketer)."""
    if schedule != "immediate":
        return ChunkedPath(buckets, world, lock, process_group, schedule, chunk_bytes)
    if compression is None and all(b.buffer.device.type == "cpu" for b in buckets):
        return LauncherPath(buckets, params, process_group)
    return HookPath(buckets, world, lock, process_group, compression)
