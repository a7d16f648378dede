"""Pieces shared by xcomm's hook states."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .stats import CompressionStats, allreduce_bytes

logger = logging.getLogger(__name__)


#: ``all_gather_into_tensor`` under its newer name where torch has it (2.13+
#: warns that the old name is deprecated).
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def group_size(process_group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(process_group)


def check_density(name: str, density: float) -> None:
    if not (0.0 < density <= 1.0):
        raise ValueError(f"xcomm.hooks.{name}: density must be in (0, 1], got {density}")


def check_start_iter(name: str, start_iter: int, error_feedback: bool) -> None:
    if error_feedback and start_iter < 2:
        raise ValueError(
            f"xcomm.hooks.{name}: start_iter must be >= 2 with error feedback, got {start_iter}; "
            "DDP rebuilds its buckets after the first iteration, which would invalidate "
            "the per-bucket residuals"
        )


def check_floating(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise TypeError(f"xcomm.hooks.{name}: gradients must be floating point, got {tensor.dtype}")


def allreduce_mean(
    state: Any, bucket: dist.GradBucket, stats: CompressionStats
) -> torch.futures.Future[torch.Tensor]:
    """The uncompressed path: average the bucket with one allreduce."""
    buffer = bucket.buffer()
    world = group_size(state.process_group)
    buffer.div_(world)
    stats.record(allreduce_bytes(buffer.nbytes, world), allreduce_bytes(buffer.nbytes, world))
    fut = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class StepCounter:
    """Counts DDP iterations: one step ends with the bucket marked last."""

    def __init__(self) -> None:
        self.iter = 0

    def after_bucket(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1


def ddp_result(fut: torch.futures.Future) -> torch.futures.Future:
    """``fut`` as DDP can read it. A Python future failed with
    ``set_exception`` holds the exception as its *value* (Python's ``wait()``
    raises it; DDP's C++ reducer does not, and fails with "Unable to cast ...
    to Tensor"); chained through ``then``, the failure becomes the returned
    future's error and DDP raises the hook's own message."""
    return fut.then(lambda f: f.value())


def then_collective(
    fut: torch.futures.Future,
    issue: Callable[[torch.futures.Future], torch.futures.Future],
    device: torch.device,
) -> torch.futures.Future:
    """Runs ``issue`` when ``fut`` completes and returns a future of its result.

    ``issue`` starts the next collective and returns that collective's future;
    the returned future completes with that future's value. Nothing blocks:
    no ``wait()`` runs inside a callback, so DDP's other buckets proceed.
    Errors from either step reach the returned future.
    """
    out = torch.futures.Future(devices=[device] if device.type == "cuda" else None)

    def on_first(f: torch.futures.Future) -> None:
        try:
            f.value()  # re-raises a failure of the first step
            inner = issue(f)
        except Exception as e:  # noqa: BLE001 - handed to the future
            out.set_exception(e)
            return

        def on_inner(g: torch.futures.Future) -> None:
            try:
                out.set_result(g.value())
            except Exception as e:  # noqa: BLE001
                out.set_exception(e)

        inner.add_done_callback(on_inner)

    fut.add_done_callback(on_first)
    return out


class IssueOrder:
    """Keeps the order of a hook's collectives the same on every rank.

    A hook that issues its second collective from a future callback (int8's
    allgather after the alltoall, PowerSGD's Q after P) would otherwise race
    with the next bucket's first collective issued by DDP's thread, and ranks
    could issue them in different orders: a collective mismatch that Gloo
    answers by aborting the process. DDP calls the hook for buckets in the
    same order on every rank, so each bucket takes a turn here: its first
    collective starts once the previous bucket has issued its last one.
    Transfers still overlap the rest of the backward pass.

    Example::

        ready, issued = state.order.next_turn()
        # start the bucket's first collective when `ready` completes, and
        # call issued.set_result(None) right after issuing its last one.
    """

    def __init__(self) -> None:
        self._tail: torch.futures.Future | None = None

    def next_turn(self) -> tuple[torch.futures.Future, torch.futures.Future]:
        """(ready, issued) for the next bucket, in hook-call order."""
        ready = self._tail
        if ready is None:
            ready = torch.futures.Future()
            ready.set_result(None)
        issued: torch.futures.Future = torch.futures.Future()
        self._tail = issued
        return ready, issued


def mark_issued(issued: torch.futures.Future, exc: BaseException | None = None) -> None:
    """Completes a turn of :class:`IssueOrder` (once; later calls are ignored)."""
    if issued.done():
        return
    if exc is None:
        issued.set_result(None)
    else:
        issued.set_exception(exc)


class BucketView:
    """What a codec works on for one bucket: a key and a flat tensor.

    Usually the bucket's own buffer under the bucket's index. After a resume
    it may be a copy in the saved run's parameter order (see
    :class:`ResidualCheckpoint`); :meth:`write_back` then copies the result
    into the bucket.
    """

    def __init__(
        self,
        key: int,
        tensor: torch.Tensor,
        index: torch.Tensor | None,
        buffer: torch.Tensor,
    ) -> None:
        self.key = key
        self.tensor = tensor
        self._index = index
        self._buffer = buffer

    def write_back(self) -> torch.Tensor:
        """Puts the view's values into the bucket's buffer and returns the buffer."""
        if self._index is not None:
            self._buffer.index_copy_(0, self._index, self.tensor)
        return self._buffer


class ResidualCheckpoint:
    """Checkpoints error-feedback residuals by parameter name, not by bucket.

    DDP lays its buckets out one way in its first iteration and another after
    it rebuilds them, and the codecs' output depends on the layout (int8
    chunk boundaries, top-k over the whole bucket, random-k positions). Given
    the model, a checkpoint records the residual of every parameter and the
    parameter order of every bucket. A resumed run whose fresh DDP holds the
    same parameters in a bucket in another order compresses a copy laid out
    in the saved order (:meth:`view`), so it continues bit for bit; once DDP
    has rebuilt its buckets the layouts agree again and no copy is made.
    When the resumed buckets group parameters differently, the residuals
    still follow their parameters, but the result is no longer bitwise that
    of an uninterrupted run (a warning says so once).

    Without the model, residuals are saved by bucket index (exact only when
    the resumed run's buckets match the saved ones).
    """

    def __init__(self, model: torch.nn.Module | None) -> None:
        self._names: dict[int, str] = {}
        if model is not None:
            self._names = {id(p): n for n, p in model.named_parameters()}
        # key -> [(name, numel)] in the order the codec saw them.
        self._layouts: dict[int, list[tuple[str, int]]] = {}
        # From a loaded checkpoint: key -> [(name, numel)], and residual pieces.
        self._saved_layouts: dict[int, list[tuple[str, int]]] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._warned = False

    @property
    def by_parameter(self) -> bool:
        return bool(self._names)

    def bind(self, model: torch.nn.Module) -> None:
        """Keys residuals by ``model``'s parameter names from now on (a state
        unpickled or loaded without its model gets it back this way)."""
        self._names = {id(p): n for n, p in model.named_parameters()}

    def _current(self, bucket: dist.GradBucket) -> list[tuple[str, int, int]]:
        base = bucket.buffer().storage_offset()
        return [
            (self._names[id(p)], g.storage_offset() - base, g.numel())
            for p, g in zip(bucket.parameters(), bucket.gradients())
        ]

    def view(
        self,
        bucket: dist.GradBucket,
        set_residual: Callable[[int, torch.Tensor], None] | None,
    ) -> BucketView:
        """The codec's view of ``bucket``; restores pending residuals into
        ``set_residual(key, residual)`` (``None``: no error feedback)."""
        buffer = bucket.buffer()
        if not self._names:
            if self._pending:
                raise ValueError(
                    "xcomm.hooks: this state holds residuals saved by parameter (a checkpoint, "
                    "or a pickled state made with model=); give it the model before training: "
                    "state.bind_model(ddp_model)"
                )
            return BucketView(bucket.index(), buffer, None, buffer)
        current = self._current(bucket)
        key, order, index = bucket.index(), [(n, k) for n, _, k in current], None
        if self._saved_layouts:
            names = {n for n, _, _ in current}
            match = [k for k, lay in self._saved_layouts.items() if {n for n, _ in lay} == names]
            if match:
                key, order = match[0], self._saved_layouts[match[0]]
                if order != [(n, k) for n, _, k in current]:
                    offsets = {n: off for n, off, _ in current}
                    index = (
                        torch.cat(
                            [
                                torch.arange(offsets[n], offsets[n] + k, device=buffer.device)
                                for n, k in order
                            ]
                        )
                        if order
                        else torch.empty(0, dtype=torch.long, device=buffer.device)
                    )
            elif not self._warned:
                self._warned = True
                logger.warning(
                    "xcomm.hooks: the resumed DDP groups parameters into buckets differently "
                    "from the checkpoint; residuals follow their parameters, but the run is "
                    "not bitwise that of an uninterrupted one"
                )
        self._layouts[key] = order
        tensor = buffer if index is None else buffer.index_select(0, index)
        view = BucketView(key, tensor, index, buffer)
        if set_residual is not None and self._pending:
            residual = torch.zeros_like(tensor)
            found, offset = False, 0
            for name, numel in order:
                piece = self._pending.pop(name, None)
                if piece is not None:
                    residual.narrow(0, offset, numel).copy_(piece.reshape(-1))
                    found = True
                offset += numel
            if found:
                set_residual(key, residual)
        return view

    def save(self, residuals: dict[int, torch.Tensor]) -> dict[str, Any]:
        if not self._names:
            return {"by": "bucket", "residuals": residuals}
        per_param = dict(self._pending)
        for key, residual in residuals.items():
            offset = 0
            for name, numel in self._layouts.get(key, []):
                per_param[name] = residual.narrow(0, offset, numel).clone()
                offset += numel
        layouts = {k: [list(e) for e in lay] for k, lay in self._layouts.items()}
        return {"by": "parameter", "residuals": per_param, "layouts": layouts}

    def load(self, saved: dict[str, Any], load_by_bucket: Callable[[dict], None]) -> None:
        if saved["by"] == "bucket":
            load_by_bucket(saved["residuals"])
            return
        # Without the model yet, the residuals wait (view() asks for the model).
        load_by_bucket({})
        self._pending = {n: t.clone() for n, t in saved["residuals"].items()}
        self._saved_layouts = {
            int(k): [(str(n), int(c)) for n, c in lay]
            for k, lay in saved.get("layouts", {}).items()
        }


class PicklableState:
    """Pickling for the dataclass hook states, so Lightning's ``ddp_spawn``,
    ``mp.spawn(args=(state,))``, ``copy.deepcopy`` and ``torch.save(state)``
    work: the configuration and :meth:`state_dict` travel; the process group
    and the model do not (as torch's ``PowerSGDState`` drops its group). A
    state made with ``model=`` gets it back with ``bind_model(model)``; until
    then a hook refuses to run on residuals saved by parameter.

    Example::

        >>> import copy
        >>> from xcomm.hooks import Int8State
        >>> copy.deepcopy(Int8State(chunk_elems=256)).chunk_elems
        256
    """

    _NOT_PICKLED = ("process_group", "model", "stats")

    def __getstate__(self) -> dict[str, Any]:
        config = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if f.init and f.name not in self._NOT_PICKLED
        }
        return {"config": config, "state": self.state_dict()}  # type: ignore[attr-defined]

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self.__init__(**pickled["config"])  # type: ignore[misc]
        self.load_state_dict(pickled["state"])  # type: ignore[attr-defined]

    def bind_model(self, model: torch.nn.Module) -> None:
        """Gives the state its DDP model after unpickling or loading, so
        residuals follow parameters again."""
        self.model = model
        residuals = getattr(self, "residuals", None)
        if residuals is not None:
            residuals.bind(model)
