"""Gradient bucketing with communication/computation overlap, for any training loop.

DDP buckets gradients and overlaps their allreduce with the backward pass,
but custom loops (parameter averaging, RL learners, hand-written data
parallelism) usually reduce every gradient after ``backward()``. A
:class:`GradientBucketer` gives them DDP's overlap without DDP:

1. at construction, the trainable parameters are laid out, in reverse
   registration order (the order backward usually produces them), into flat
   buckets of at most ``bucket_cap_mb`` (a larger parameter gets a bucket of
   its own); one bucket holds one dtype on one device;
2. during ``backward()``, a post-accumulate-grad hook copies each finished
   gradient into its bucket; the moment a bucket is full its allreduce starts
   asynchronously. Buckets start in index order on every rank, so all ranks
   issue the same collectives in the same order (a full bucket waits for the
   earlier ones: that wait is the bucket's "queued" time);
3. when a reduction lands, a completion callback copies the mean back into
   each parameter's ``.grad``;
4. :meth:`synchronize` waits for all buckets; :meth:`step` does the same but
   runs each bucket's own optimizer as soon as that bucket has landed, while
   later buckets are still on the wire (optimizer overlap).

Steps 2 and 3 run in C++ for CPU buckets without a hook
(``csrc/schedule/BucketLauncher``: no Python and no GIL on the backward or
completion threads); with a hook, the hook's Python runs as DDP's would, and
``schedule="fifo"|"priority"`` hands full buckets to the C++ chunk scheduler.

The math, without compression: every rank's ``p.grad`` becomes
``sum_r (g_r * (1/n))`` over the ``n`` ranks, exactly what DDP's built-in
reduction computes (it also scales by ``1/n`` while copying into the bucket
and sums), so parameters match DDP's bit for bit where the sum of ``n``
values is order-independent (``n = 2``). With ``compression=(hook, state)``
the bucket is handed unscaled to ``hook(state, bucket)`` (any DDP comm hook,
e.g. :func:`xcomm.hooks.fp16_cast_hook`), whose future's tensor (the mean)
is copied back.

Every bucket's encode (scale and launch, or the hook's encoding), transfer
and decode (copy-back) is a span on xcomm's timeline (:mod:`xcomm.trace`)
and a ``torch.profiler`` record (``xcomm::bucket<i>::...``), and each
reduction is counted in :func:`xcomm.stats` as ``bucket_allreduce``.

Example::

    >>> bucketer = xcomm.GradientBucketer(model, bucket_cap_mb=4,  # doctest: +SKIP
    ...     optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> for x, y in data:  # doctest: +SKIP
    ...     loss_fn(model(x), y).backward()   # buckets reduce during backward
    ...     bucketer.step()                   # wait, per-bucket optimizer steps
    ...     bucketer.zero_grad()
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _C, trace
from .opstats import record_op
from .scheduler import ChunkScheduler

__all__ = ["BucketView", "GradientBucketer"]

CompressionHook = Callable[[Any, Any], torch.futures.Future]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

TRACK_ENCODE = "engine 1: encode (backward thread)"
TRACK_TRANSFER = "engine 2: transfer"
TRACK_DECODE = "engine 3: decode (completion thread)"
TRACK_OPTIM = "engine 4: optimizer step"

# Modules with a live bucketer; a module may have only one.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
_ATTACHED_LOCK = threading.Lock()


class BucketView:
    """One bucket presented like DDP's ``dist.GradBucket``, so DDP comm hooks run on it."""

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


class _LaunchedFuture:
    """A bucket's reduction in the C++ launcher, seen as a future (``done``/``wait``)."""

    def __init__(self, launcher: Any, index: int) -> None:
        self._launcher = launcher
        self._index = index

    def done(self) -> bool:
        return bool(self._launcher.done(self._index))

    def wait(self) -> None:
        self._launcher.wait(self._index)


@dataclass
class _Bucket:
    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    optimizer: torch.optim.Optimizer | None = None
    # Per-iteration state, reset by _reset_iteration.
    pending: int = 0
    ready_us: int = 0
    landed_us: int = 0
    future: torch.futures.Future | None = None
    ready_params: set[int] = field(default_factory=set)


class GradientBucketer:
    """Reduces a module's gradients in flat buckets, overlapped with backward.

    Args:
        module: the model; all of its parameters with ``requires_grad`` are reduced.
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: bucket capacity in MiB (> 0); a bucket is launched as soon
            as all of its gradients are in.
        compression: ``(hook, state)``: a DDP comm hook ``hook(state, bucket) ->
            Future[Tensor]`` that averages a bucket (e.g. xcomm's fp16/int8/top-k
            hooks); ``None`` for a plain averaging allreduce.
        optimizer_factory: builds one optimizer per bucket from its parameters;
            needed by :meth:`step` (optimizer overlap).
        sync_module_states: broadcast the module's parameters and buffers from
            the group's rank 0 at attach time, as DDP does, so all ranks start equal.
        schedule: ``"immediate"``: each bucket's allreduce starts, asynchronously,
            as soon as it and all earlier buckets are full. ``"fifo"`` /
            ``"priority"``: buckets are cut into chunks of ``chunk_mb`` and sent
            one at a time by a :class:`xcomm.scheduler.ChunkScheduler`, in
            bucket order or with the layers nearest the input first (which
            shortens the wait before the next forward can start when the link
            lags behind backward). Not combinable with ``compression`` (a hook's
            per-bucket state and parameter layout do not map onto chunks); to
            compress chunks, give ``process_group`` backend-level compression,
            ``xcomm.Options(compression="fp16" | "bf16" | "int8")``: each chunk
            is then encoded on the scheduler's thread while the previous one
            is on the wire (fp16/bf16; int8 encodes on the backend's worker).
        chunk_mb: chunk size of ``"fifo"``/``"priority"`` (default: ``bucket_cap_mb``).

    Raises:
        ValueError: a non-positive or non-finite ``bucket_cap_mb``; a module
            without trainable parameters; ``compression`` not a ``(hook, state)`` pair.
        RuntimeError: ``module`` already has a bucketer attached.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        compression: tuple[CompressionHook, Any] | None = None,
        optimizer_factory: OptimizerFactory | None = None,
        sync_module_states: bool = True,
        schedule: str = "immediate",
        chunk_mb: float | None = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"xcomm.GradientBucketer: module must be a torch.nn.Module, got {type(module).__name__}"
            )
        if (
            isinstance(bucket_cap_mb, bool)
            or not isinstance(bucket_cap_mb, (int, float))
            or not math.isfinite(bucket_cap_mb)
            or bucket_cap_mb <= 0
        ):
            raise ValueError(
                f"xcomm.GradientBucketer: bucket_cap_mb must be a finite number > 0, got {bucket_cap_mb!r}"
            )
        if compression is not None and (
            not isinstance(compression, tuple)
            or len(compression) != 2
            or not callable(compression[0])
        ):
            raise ValueError(
                "xcomm.GradientBucketer: compression must be a (hook, state) pair, e.g. "
                "(xcomm.hooks.fp16_cast_hook, xcomm.hooks.CastState())"
            )
        if schedule not in ("immediate", "fifo", "priority"):
            raise ValueError(
                f"xcomm.GradientBucketer: schedule must be 'immediate', 'fifo' or 'priority', got {schedule!r}"
            )
        if schedule != "immediate" and compression is not None:
            raise ValueError(
                f"xcomm.GradientBucketer: schedule={schedule!r} sends chunks, which a comm "
                "hook cannot compress (use schedule='immediate', or compress every chunk in "
                "the backend: a process_group made with "
                "pg_options=xcomm.Options(compression='fp16'))"
            )
        if chunk_mb is None:
            chunk_mb = bucket_cap_mb
        if (
            isinstance(chunk_mb, bool)
            or not isinstance(chunk_mb, (int, float))
            or not math.isfinite(chunk_mb)
            or chunk_mb <= 0
        ):
            raise ValueError(
                f"xcomm.GradientBucketer: chunk_mb must be a finite number > 0, got {chunk_mb!r}"
            )
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(
                f"xcomm.GradientBucketer: {type(module).__name__} has no parameters with "
                "requires_grad=True; there is nothing to reduce"
            )
        for p in params:
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(
                    "xcomm.GradientBucketer: only dense (strided) parameters are supported"
                )
        with _ATTACHED_LOCK:
            if module in _ATTACHED:
                raise RuntimeError(
                    f"xcomm.GradientBucketer: this {type(module).__name__} already has a "
                    "GradientBucketer attached; call .detach() on it before attaching another"
                )
            _ATTACHED[module] = self

        self._module_ref = weakref.ref(module)
        self.process_group = process_group
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.compression = compression
        self._world = dist.get_world_size(process_group)
        self._names = {id(p): n for n, p in module.named_parameters()}
        self.buckets: list[_Bucket] = self._layout(params, optimizer_factory)
        self._slot: dict[int, tuple[_Bucket, int]] = {}
        for b in self.buckets:
            for p, off in zip(b.params, b.offsets):
                self._slot[id(p)] = (b, off)
        if sync_module_states:
            src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(t.data, src=src, group=process_group)
        self._has_optimizers = optimizer_factory is not None
        self.schedule = schedule
        self._first_param_bucket = self._slot[id(params[0])][0]
        self._n_params = len(params)
        self.last_timing: dict[str, float] = {}
        self._scheduler: ChunkScheduler | None = None
        # The plain path (no hook, no chunks) runs in C++ (csrc/schedule/
        # BucketLauncher): copy-in, launch in index order, copy-back, stats
        # and spans, all without the GIL. Hooks and CUDA buckets stay here.
        self._launcher: Any = None
        self._param_index = {id(p): i for i, p in enumerate(params)}
        if (
            schedule == "immediate"
            and compression is None
            and all(b.buffer.device.type == "cpu" for b in self.buckets)
        ):
            pg = process_group if process_group is not None else dist.group.WORLD
            slots = [None] * len(params)
            for b in self.buckets:
                for p, off in zip(b.params, b.offsets, strict=True):
                    slots[self._param_index[id(p)]] = (b.index, off, p.numel())
            self._launcher = _C.BucketLauncher(
                [b.buffer for b in self.buckets], slots, pg._get_backend(torch.device("cpu"))
            )
        if schedule != "immediate":
            self._scheduler = ChunkScheduler(
                [b.buffer for b in self.buckets],
                int(chunk_mb * 1024 * 1024),
                schedule == "priority",
                process_group,
                self._on_chunks_landed,
                self._on_scheduler_error,
            )
        self._sync = True
        self._lock = threading.Lock()
        self._reset_iteration()
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    # ---------------------------------------------------------------- layout

    def _layout(
        self, params: Sequence[nn.Parameter], optimizer_factory: OptimizerFactory | None
    ) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        open_by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}

        def close(kind: tuple[torch.dtype, torch.device]) -> None:
            group = open_by_kind.pop(kind, None)
            if not group:
                return
            offsets, total = [], 0
            for p in group:
                offsets.append(total)
                total += p.numel()
            buffer = torch.zeros(total, dtype=kind[0], device=kind[1])
            opt = optimizer_factory(list(group)) if optimizer_factory else None
            buckets.append(_Bucket(len(buckets), list(group), offsets, buffer, opt))

        for p in reversed(list(params)):
            kind = (p.dtype, p.device)
            group = open_by_kind.setdefault(kind, [])
            size = sum(q.numel() * q.element_size() for q in group)
            if group and size + p.numel() * p.element_size() > self.bucket_cap_bytes:
                close(kind)
                group = open_by_kind.setdefault(kind, [])
            group.append(p)
        for kind in list(open_by_kind):
            close(kind)
        return buckets

    # ------------------------------------------------------------ iteration

    def _reset_iteration(self) -> None:
        self._next_launch = 0
        self._grads_seen = 0
        self._callback_error: BaseException | None = None
        self._backward_end_us = 0
        for b in self.buckets:
            b.pending = len(b.params)
            b.ready_us = 0
            b.landed_us = 0
            if self._launcher is not None:
                b.future = _LaunchedFuture(self._launcher, b.index)
            elif self.schedule != "immediate":
                b.future = torch.futures.Future()  # completed by the chunk scheduler
            else:
                b.future = None  # set when the bucket is launched
            b.ready_params = set()
        if self._launcher is not None:
            self._launcher.reset()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally (no communication)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        bucket, offset = self._slot[id(p)]
        with self._lock:
            if id(p) in bucket.ready_params:
                raise RuntimeError(
                    f"xcomm.GradientBucketer: the gradient of {self._names.get(id(p), 'a parameter')!r} "
                    "became ready twice before synchronize()/step(); call one of them after every "
                    "backward, or accumulate inside bucketer.no_sync()"
                )
            bucket.ready_params.add(id(p))
            self._grads_seen += 1
            if self._grads_seen == self._n_params:
                self._backward_end_us = trace.now_us()
        if self._launcher is not None:
            self._launcher.grad_ready(self._param_index[id(p)], p.grad)
            return
        grad = p.grad
        view = bucket.buffer.narrow(0, offset, p.numel())
        with torch.autograd.profiler.record_function("xcomm::bucketer::copy_in"):
            if self.compression is None:
                # DDP's reducer also scales by 1/n while copying, then sums.
                torch.mul(grad.reshape(-1), 1.0 / self._world, out=view)
            else:
                view.copy_(grad.reshape(-1))
        # Launching under the lock keeps the index order even if gradients
        # arrive on several autograd threads (one per device).
        with self._lock:
            bucket.pending -= 1
            if bucket.pending == 0:
                bucket.ready_us = trace.now_us()
                if self._scheduler is not None:
                    self._scheduler.mark_ready(bucket.index)
            if self._scheduler is not None:
                return  # the scheduler picks the order
            while (
                self._next_launch < len(self.buckets)
                and self.buckets[self._next_launch].pending == 0
            ):
                self._launch(self.buckets[self._next_launch])
                self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        i = bucket.index
        start_us = trace.now_us()
        queued_s = (start_us - bucket.ready_us) * 1e-6
        wire_ratio = 1.0
        with torch.autograd.profiler.record_function(f"xcomm::bucket{i}::encode"):
            if self.compression is None:
                work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
                fut = work.get_future()
                op = "bucket_allreduce"
            else:
                hook, state = self.compression
                stats = getattr(state, "stats", None)
                before = (
                    (stats.bytes_before, stats.bytes_on_wire)
                    if hasattr(stats, "bytes_before")
                    else None
                )
                view = BucketView(i, bucket.buffer, bucket.params, i == len(self.buckets) - 1)
                fut = hook(state, view)
                if before is not None and stats.bytes_before > before[0]:
                    wire_ratio = (stats.bytes_on_wire - before[1]) / (
                        stats.bytes_before - before[0]
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
            try:
                value = f.value()
                result = value[0] if isinstance(value, (list, tuple)) else value
                with torch.autograd.profiler.record_function(f"xcomm::bucket{i}::decode"):
                    for p, off in zip(bucket.params, bucket.offsets):
                        p.grad.copy_(result.narrow(0, off, p.numel()).view_as(p))
                failed = False
            finally:
                done_us = trace.now_us()
                trace.add_span(
                    f"bucket {i} transfer",
                    "transfer",
                    TRACK_TRANSFER,
                    launched_us,
                    landed_us,
                    {"bytes": nbytes, "queued_us": int(queued_s * 1e6)},
                )
                trace.add_span(f"bucket {i} decode", "decode", TRACK_DECODE, landed_us, done_us)
                record_op(
                    op,
                    nbytes,
                    round(nbytes * wire_ratio),
                    queued_s,
                    (landed_us - launched_us) * 1e-6,
                    failed,
                )

        # The transfer as an async torch.profiler range: it ends when the future completes.
        with torch.autograd.profiler.record_function(f"xcomm::bucket{i}::transfer") as rf:
            fut = rf._call_end_callbacks_on_future(fut)
        bucket.future = fut.then(land)

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
                f"bucket_allreduce[{self.schedule}]",
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

    # ---------------------------------------------------------------- finish

    def _check_complete(self, what: str) -> None:
        if self._grads_seen == 0:
            raise RuntimeError(
                f"xcomm.GradientBucketer.{what}() was called before backward(): no gradient has "
                "been produced since the last synchronize()/step(); run loss.backward() first"
            )
        missing = [
            self._names.get(id(p), "?")
            for b in self.buckets
            for p in b.params
            if id(p) not in b.ready_params
        ]
        if missing:
            # Let launched reductions finish, so no collective is left half-issued here.
            if self._scheduler is not None:
                self._scheduler.abort()
            for b in self.buckets:
                if self._scheduler is not None:
                    continue
                if self._launcher is not None and b.index >= self._launcher.launched:
                    continue  # never launched: nothing to wait for
                if b.future is not None:
                    with contextlib.suppress(Exception):
                        b.future.wait()
            self._reset_iteration()
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise RuntimeError(
                f"xcomm.GradientBucketer.{what}(): {len(missing)} parameter(s) received no gradient in "
                f"this backward ({shown}); every trainable parameter must take part in the loss "
                "(or set requires_grad=False on the unused ones before attaching)"
            )

    def synchronize(self) -> None:
        """Waits until every bucket is reduced and copied back into ``.grad``.

        Raises:
            RuntimeError: no backward ran since the last call, or some
                parameters got no gradient; a failed reduction's error.
        """
        self._finish("synchronize", step=False)

    def step(self) -> None:
        """:meth:`synchronize`, stepping each bucket's optimizer as soon as that bucket lands.

        Raises:
            RuntimeError: as :meth:`synchronize`, or no ``optimizer_factory`` was given.
        """
        if not self._has_optimizers:
            raise RuntimeError(
                "xcomm.GradientBucketer.step() needs optimizer_factory=...; without it call "
                "synchronize() and then your optimizer's step()"
            )
        self._finish("step", step=True)

    def _finish(self, what: str, step: bool) -> None:
        self._check_complete(what)
        try:
            # Buckets are handled in the order they land: whichever is done
            # first, else the one expected next (index order; reversed under
            # priority scheduling, which sends the last buckets first).
            expected = list(self.buckets)
            if self.schedule == "priority":
                expected.reverse()
            while expected:
                b = next((x for x in expected if x.future.done()), expected[0])
                expected.remove(b)
                b.future.wait()
                if self._launcher is not None:
                    b.landed_us = self._launcher.landed_us(b.index)
                if step and b.optimizer is not None:
                    t0 = trace.now_us()
                    with torch.autograd.profiler.record_function(
                        f"xcomm::bucket{b.index}::optimizer_step"
                    ):
                        b.optimizer.step()
                    trace.add_span(
                        f"bucket {b.index} step",
                        "optimizer",
                        TRACK_OPTIM,
                        t0,
                        trace.now_us(),
                    )
            first = self._first_param_bucket
            self.last_timing = {
                "backward_end_us": self._backward_end_us,
                "first_layer_landed_us": first.landed_us,
                "all_landed_us": max(b.landed_us for b in self.buckets),
                # How long the next forward's first layer waits after backward ended.
                "forward_wait_s": max(0, first.landed_us - self._backward_end_us) * 1e-6,
            }
        finally:
            if self._scheduler is not None:
                self._scheduler.join()
            self._reset_iteration()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradients of every bucketed parameter."""
        for b in self.buckets:
            if b.optimizer is not None:
                b.optimizer.zero_grad(set_to_none=set_to_none)
            else:
                for p in b.params:
                    if set_to_none:
                        p.grad = None
                    elif p.grad is not None:
                        p.grad.zero_()

    # ------------------------------------------------------------- lifecycle

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The per-bucket optimizers (empty without ``optimizer_factory``)."""
        return [b.optimizer for b in self.buckets if b.optimizer is not None]

    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._names.get(id(p), "?") for p in b.params] for b in self.buckets]

    def detach(self) -> None:
        """Removes the hooks; the module can then get another bucketer. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        module = self._module_ref()
        with _ATTACHED_LOCK:
            if module is not None and _ATTACHED.get(module) is self:
                del _ATTACHED[module]
