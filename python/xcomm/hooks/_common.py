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


class ResidualCheckpoint:
    """Saves error-feedback residuals by parameter name instead of by bucket.

    DDP lays its buckets out one way in its first iteration and another after
    it rebuilds them, so a residual saved by bucket index can land on other
    parameters when a fresh DDP resumes. Given the model, residuals are saved
    per parameter and re-assembled for whatever bucket layout comes next.
    Without the model, they are saved by bucket (exact only when the resumed
    run's buckets match the saved ones).
    """

    def __init__(self, model: torch.nn.Module | None) -> None:
        self._names: dict[int, str] = {}
        if model is not None:
            self._names = {id(p): n for n, p in model.named_parameters()}
        self._layouts: dict[int, list[tuple[str, int, int]]] = {}  # bucket -> (name, offset, numel)
        self._pending: dict[str, torch.Tensor] = {}

    @property
    def by_parameter(self) -> bool:
        return bool(self._names)

    def observe(self, bucket: dist.GradBucket) -> list[tuple[str, int, int]] | None:
        """Records the bucket's layout; returns it (None without a model)."""
        if not self._names:
            return None
        base = bucket.buffer().storage_offset()
        layout = [
            (self._names[id(p)], g.storage_offset() - base, g.numel())
            for p, g in zip(bucket.parameters(), bucket.gradients())
        ]
        self._layouts[bucket.index()] = layout
        return layout

    def restore_into(self, bucket: dist.GradBucket, set_residual: Callable[[int, torch.Tensor], None]) -> None:
        """After a load: builds this bucket's residual from the saved pieces."""
        layout = self.observe(bucket)
        if not self._pending or layout is None:
            return
        buffer = bucket.buffer()
        residual = torch.zeros_like(buffer)
        found = False
        for name, offset, numel in layout:
            piece = self._pending.pop(name, None)
            if piece is not None:
                residual.narrow(0, offset, numel).copy_(piece.reshape(-1))
                found = True
        if found:
            set_residual(bucket.index(), residual)

    def save(self, residuals: dict[int, torch.Tensor]) -> dict[str, Any]:
        if not self._names:
            return {"by": "bucket", "residuals": residuals}
        per_param = dict(self._pending)
        for key, residual in residuals.items():
            for name, offset, numel in self._layouts.get(key, []):
                per_param[name] = residual.narrow(0, offset, numel).clone()
        return {"by": "parameter", "residuals": per_param}

    def load(self, saved: dict[str, Any], load_by_bucket: Callable[[dict], None]) -> None:
        if saved["by"] == "bucket":
            load_by_bucket(saved["residuals"])
            return
        if not self._names:
            raise ValueError(
                "xcomm.hooks: this checkpoint saved residuals by parameter; pass model= to the "
                "state that loads it"
            )
        load_by_bucket({})
        self._pending = {n: t.clone() for n, t in saved["residuals"].items()}
