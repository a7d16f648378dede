"""Pieces shared by xcomm's hook states."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from .stats import CompressionStats, allreduce_bytes


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
        raise TypeError(
            f"xcomm.hooks.{name}: gradients must be floating point, got {tensor.dtype}"
        )


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
