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
The bucketer picks one of these three paths at construction
(``xcomm._bucket_paths``); a comm hook receives each bucket as a
:class:`BucketerGradBucket`, a stand-in for ``dist.GradBucket``.

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
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import trace
from ._bucket_paths import (  # noqa: F401 (the TRACK_* stay readable here)
    TRACK_DECODE,
    TRACK_ENCODE,
    TRACK_OPTIM,
    TRACK_TRANSFER,
    Bucket,
    BucketerGradBucket,
    BucketPath,
    CompressionHook,
    choose_path,
)

__all__ = ["BucketerGradBucket", "GradientBucketer"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# Modules with a live bucketer; a module may have only one.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
_ATTACHED_LOCK = threading.Lock()


def __getattr__(name: str) -> Any:
    # Deprecated alias: the bucketer's GradBucket stand-in was called
    # BucketView, like the unrelated codec view in xcomm.hooks._common.
    if name == "BucketView":
        warnings.warn(
            "xcomm.bucketer.BucketView is deprecated; it is now xcomm.bucketer.BucketerGradBucket",
            DeprecationWarning,
            stacklevel=2,
        )
        return BucketerGradBucket
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        self.buckets: list[Bucket] = self._layout(params, optimizer_factory)
        self._slot: dict[int, tuple[Bucket, int]] = {}
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
        self._lock = threading.Lock()
        # How full buckets are reduced: in C++ (the plain path), through a
        # hook from Python, or in chunks by the scheduler (xcomm._bucket_paths).
        self._path: BucketPath = choose_path(
            self.buckets,
            params,
            process_group,
            self._world,
            self._lock,
            compression,
            schedule,
            int(chunk_mb * 1024 * 1024),
        )
        self._sync = True
        self._reset_iteration()
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    # ---------------------------------------------------------------- layout

    def _layout(
        self, params: Sequence[nn.Parameter], optimizer_factory: OptimizerFactory | None
    ) -> list[Bucket]:
        buckets: list[Bucket] = []
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
            buckets.append(Bucket(len(buckets), list(group), offsets, buffer, opt))

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
        self._grads_seen = 0
        self._backward_end_us = 0
        for b in self.buckets:
            b.pending = len(b.params)
            b.ready_us = 0
            b.landed_us = 0
            b.ready_params = set()
        self._path.reset_iteration()

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
        self._path.grad_ready(p, bucket, offset)

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
            self._path.abandon()
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
            expected = self._path.landing_order()
            while expected:
                b = next((x for x in expected if x.future.done()), expected[0])
                expected.remove(b)
                self._path.wait(b)
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
            self._path.end_iteration()
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
