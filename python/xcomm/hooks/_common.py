"""Pieces shared by xcomm's hook states."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import _C
from ._pickling import pack_state, pickled_state
from .feedback import FeedbackStore
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


def feedback_store(state: Any) -> FeedbackStore:
    """The state's error-feedback store: the one it was given (shared with
    other states), or a fresh one keyed by its model's parameter names."""
    if state.feedback is None:
        return FeedbackStore(state.model)
    if state.model is not None:
        state.feedback.bind(state.model)
    return state.feedback


_warned_host_codec: set[str] = set()


def warn_host_codec(name: str, tensor: torch.Tensor) -> None:
    """Warns once per hook that a GPU bucket goes through the host: in a build
    without xcomm's CUDA kernels (``xcomm._C.cuda_codecs`` false: no CUDA
    toolkit at build time), the int8, top-k and random-k codecs are CPU code.
    On an H200 that cost 80-630 ms per step of a 25M-parameter model
    (docs/benchmarks.md, "GPU")."""
    if tensor.device.type == "cpu" or _C.cuda_codecs or name in _warned_host_codec:
        return
    _warned_host_codec.add(name)
    logger.warning(
        "xcomm.hooks.%s: this bucket is on %s, and this build of xcomm has no CUDA kernels "
        "(no CUDA toolkit when it was built), so its %s codec runs on the CPU: every step "
        "copies the bucket to the host and back, which costs more than most links save. "
        "Rebuild xcomm where nvcc is found, or use bf16_cast_hook / fp16_cast_hook",
        name,
        tensor.device,
        name.removesuffix("_hook").removesuffix("_compress"),
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
    Transfers still overlap the rest of the backward pass. The hooks' own
    chains take such turns in C++ (``BucketTurns``,
    csrc/collectives/chains/BucketChain.hpp); this Python order is the one
    ``auto_hook`` shares between its methods.

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


def start_in_shared_turn(
    order: IssueOrder,
    start: Callable[[torch.futures.Future], tuple[torch.futures.Future, torch.futures.Future]],
) -> torch.futures.Future:
    """Starts a chain of C++ (``_C.PowerSgdAllreduce``, ``_C.Int8Allreduce``)
    in the next turn of a Python :class:`IssueOrder` shared with other
    methods, and passes the turn on once the chain issued its last collective.

    ``start(turn)`` starts the chain once ``turn`` completes and returns its
    ``(result, issued)`` futures; the result is returned.
    """
    ready, issued = order.next_turn()
    # A Python future failed by set_exception holds the exception as its
    # value; through `then` it becomes an error C++ sees.
    result, done = start(ready.then(lambda f: f.value()))

    def pass_turn(f: torch.futures.Future) -> None:
        try:
            f.value()
        except BaseException as exc:  # noqa: BLE001 - the next bucket fails with it
            mark_issued(issued, exc)
            return
        mark_issued(issued)

    done.add_done_callback(pass_turn)
    return result


class PicklableState:
    """Pickling for the dataclass hook states, so Lightning's ``ddp_spawn``,
    ``mp.spawn(args=(state,))``, ``copy.deepcopy`` and ``torch.save(state)``
    work: the configuration and :meth:`state_dict` travel (the state dict as
    ``torch.save`` bytes, so no tensor goes through ``torch.multiprocessing``'s
    shared memory); the process group and the model do not (as torch's
    ``PowerSGDState`` drops its group). A
    state made with ``model=`` gets it back with ``bind_model(model)``; until
    then a hook refuses to run on residuals saved by parameter.

    Example::

        >>> import copy
        >>> from xcomm.hooks import Int8State
        >>> copy.deepcopy(Int8State(chunk_elems=256)).chunk_elems
        256
    """

    _NOT_PICKLED = ("process_group", "model", "stats", "feedback")

    def __getstate__(self) -> dict[str, Any]:
        config = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if f.init and f.name not in self._NOT_PICKLED
        }
        return {"config": config, "state_bytes": pack_state(self.state_dict())}  # type: ignore[attr-defined]

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self.__init__(**pickled["config"])  # type: ignore[misc]
        self.load_state_dict(pickled_state(pickled))  # type: ignore[attr-defined]

    def bind_model(self, model: torch.nn.Module) -> None:
        """Gives the state its DDP model after unpickling or loading, so
        residuals follow parameters again."""
        self.model = model
        feedback = getattr(self, "feedback", None)
        if feedback is not None:
            feedback.bind(model)


class ResidualHookState(PicklableState):
    """What the states of the hooks with error feedback (int8, top-k,
    random-k) share: the step counter, the residual store, the group and one
    checkpoint format.

    A subclass is a dataclass with the fields ``process_group``,
    ``error_feedback``, ``start_iter``, ``model``, ``stats`` and ``feedback``;
    its ``__post_init__`` calls :meth:`_init_residuals`. What it checkpoints
    besides comes from :meth:`_extra_state`.

    Example::

        >>> from xcomm.hooks import Int8State
        >>> sorted(Int8State().state_dict())
        ['feedback', 'iter', 'stats']
    """

    process_group: dist.ProcessGroup | None
    error_feedback: bool
    start_iter: int
    stats: CompressionStats
    feedback: FeedbackStore | None

    def _init_residuals(self, name: str) -> None:
        check_start_iter(name, self.start_iter, self.error_feedback)
        self.feedback = feedback_store(self)
        self.steps = StepCounter()

    def group(self) -> dist.ProcessGroup:
        """The group the hook reduces over (the default group when none was given)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def begin_bucket(self, hook: str, bucket: dist.GradBucket) -> int:
        """Checks ``bucket`` for ``hook`` (named in errors), counts it, and
        returns the iteration it belongs to."""
        buffer = bucket.buffer()
        check_floating(hook, buffer)
        warn_host_codec(hook, buffer)
        step = self.steps.iter
        self.steps.after_bucket(bucket)
        return step

    def codec_view(self, bucket: dist.GradBucket) -> Any:
        """What the codec works on for ``bucket`` (a :class:`~.feedback.BucketView`);
        without error feedback the residual owed from earlier steps is added
        in and dropped, so the codec sees the gradient alone."""
        assert self.feedback is not None  # set by _init_residuals
        view = self.feedback.view(bucket)
        if not self.error_feedback:
            self.feedback.flush(view)
        return view

    def _extra_state(self) -> dict[str, Any]:
        """What a subclass checkpoints besides the common fields."""
        return {}

    def _load_extra_state(self, saved: dict[str, Any]) -> None:
        """Restores :meth:`_extra_state`'s output."""

    def state_dict(self) -> dict[str, Any]:
        """``{"iter", "feedback", "stats"}`` and the subclass's own entries."""
        assert self.feedback is not None
        return {
            "iter": self.steps.iter,
            "feedback": self.feedback.state_dict(),
            "stats": self.stats.as_dict(),
            **self._extra_state(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output."""
        assert self.feedback is not None
        self.steps.iter = int(saved["iter"])
        self.feedback.load_state_dict(saved["feedback"])
        self.stats.load_dict(saved["stats"])
        self._load_extra_state(saved)
