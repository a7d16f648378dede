"""Compressed gradient reduce-scatter for FSDP2 (``fully_shard``).

FSDP2 reduces each module's gradients with one reduce-scatter: rank ``r``'s
input ``g_r`` is its whole gradient laid out as ``n`` equal rows (row ``j`` is
the part rank ``j`` owns), and rank ``j`` keeps ``sum_r g_r[j]`` (divided by
``n`` under AVG). :func:`compress_reduce_scatter` replaces that reduce-scatter
on every ``fully_shard`` module (through FSDP2's ``set_custom_reduce_scatter``)
with one that moves fewer bytes:

* ``"bf16"`` / ``"fp16"``: each rank casts ``a_r = g_r + e_r`` down and an
  all-to-all delivers row ``j`` of every rank to rank ``j``, which sums them in
  float32 in rank order. 2x fewer bytes than float32; the sum itself loses
  nothing (unlike a reduce-scatter run in the low precision).
* ``"int8"``: rows quantized with one float32 scale per chunk of
  ``chunk_elems`` elements (``q = round(a / s)``, ``s = max|a_chunk| / 127``),
  the same all-to-all, a float32 sum in rank order. About 4x fewer bytes.
* ``"none"``: FSDP2's own reduce-scatter (for A/B runs).

**Error feedback** (on for int8 by default; ``error_feedback=True`` turns it
on for the casts too, which torch's cast hooks go without): each rank keeps
what its rows did not carry, ``e_r' = a_r - decode(encode(a_r))``, and adds it to the next step's
input, so ``sent + residual = g + old residual`` holds element by element.
The residual is float32 and the size of the module's *unsharded* gradient on
every rank (the error is made at the sender, before sharding), the memory of
one unsharded float32 gradient per module; ``error_feedback=False`` avoids it.

Every shard is reduced on the one rank that owns it, so the parameters FSDP2
all-gathers from the shards are the same on every rank. A reduction FSDP2 asks
for that is not SUM or AVG (``set_gradient_divide_factor`` makes it
PREMUL_SUM), or an input under ``min_bytes``, goes through the uncompressed
reduce-scatter (counted in ``state.stats`` as sent uncompressed).

**Without a hook.** FSDP2 on a group made with
``xcomm.Options(compression=...)`` has its reduce-scatters compressed by the
backend (same all-to-all and exact sum, no error feedback); this hook adds
the error feedback and per-model control.

**HSDP.** FSDP2 all-reduces the shards between replicas itself, with
``dist.all_reduce`` on the replicate dimension's group; give that group
``xcomm.Options(compression=...)`` (``init_device_mesh``'s
``backend_override``) and the backend compresses it.

Example::

    >>> from torch.distributed.fsdp import fully_shard
    >>> from xcomm.hooks import compress_reduce_scatter
    >>> for layer in model.layers:  # doctest: +SKIP
    ...     fully_shard(layer)
    >>> fully_shard(model)  # doctest: +SKIP
    >>> state = compress_reduce_scatter(model, method="int8")  # doctest: +SKIP
    >>> # train as usual; state.stats counts the bytes saved,
    >>> # state.state_dict() checkpoints the residuals (one per rank)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import _C
from .stats import CompressionStats, alltoall_bytes

__all__ = [
    "FSDP_METHODS",
    "CompressedReduceScatter",
    "FsdpCompressionState",
    "compress_reduce_scatter",
]

#: Values of ``method``.
FSDP_METHODS: tuple[str, ...] = ("none", "bf16", "fp16", "int8")

#: The version :meth:`FsdpCompressionState.state_dict` writes.
FSDP_STATE_VERSION = 1

_CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: ``reduce_scatter_tensor`` under its newer name where torch has it (2.13+
#: warns that the old name is deprecated).
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _reduce_scatter_base() -> type:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:  # pragma: no cover - torch without FSDP2's comm hooks
        return object
    return ReduceScatter


@dataclass
class FsdpCompressionState:
    """Settings, error-feedback residuals and byte counts shared by the
    compressed reduce-scatters of one model (see the module docstring).

    Args:
        method: one of :data:`FSDP_METHODS`.
        chunk_elems: elements per int8 scale; smaller is more precise and
            costs ``4 / chunk_elems`` bytes per element more.
        error_feedback: carry what a lossy method did not send into the next
            step (per module, per rank). ``None`` (default): for int8, whose
            codec does it in the same pass; not for the casts, where it would
            cost three more passes over the gradient for an error of 2^-8.
        min_bytes: inputs smaller than this go uncompressed (latency, not
            bandwidth, bounds them).

    Example::

        >>> from xcomm.hooks import FsdpCompressionState
        >>> FsdpCompressionState(method="bf16").method
        'bf16'
    """

    method: str = "int8"
    chunk_elems: int = 1024
    error_feedback: bool | None = None
    min_bytes: int = 64 * 1024
    stats: CompressionStats = field(default_factory=CompressionStats)

    def __post_init__(self) -> None:
        if self.method not in FSDP_METHODS:
            raise ValueError(
                f"xcomm.hooks.FsdpCompressionState: method must be one of {FSDP_METHODS}, "
                f"got {self.method!r}"
            )
        if self.chunk_elems <= 0:
            raise ValueError(
                f"xcomm.hooks.FsdpCompressionState: chunk_elems must be > 0, got {self.chunk_elems}"
            )
        if self.min_bytes < 0:
            raise ValueError(
                f"xcomm.hooks.FsdpCompressionState: min_bytes must be >= 0, got {self.min_bytes}"
            )
        if self.error_feedback is None:
            self.error_feedback = self.method == "int8"
        self.codec = _C.Int8Codec(self.chunk_elems)
        self.feedback = _C.ErrorFeedback()
        self.keys: dict[str, int] = {}

    def key(self, name: str) -> int:
        """The error-feedback key of the module named ``name``."""
        return self.keys.setdefault(name, len(self.keys))

    def residual(self, name: str) -> torch.Tensor | None:
        """The live residual of module ``name`` (not a copy), or None."""
        if name not in self.keys:
            return None
        return self.feedback.get(self.keys[name])

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals by module name, and the byte counts.

        Residuals differ between ranks: save one per rank."""
        return {
            "version": FSDP_STATE_VERSION,
            "method": self.method,
            "residuals": {
                name: r.clone() for name in self.keys if (r := self.residual(name)) is not None
            },
            "stats": self.stats.as_dict(),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        version = d.get("version")
        if version != FSDP_STATE_VERSION:
            raise ValueError(
                f"xcomm.hooks.FsdpCompressionState: checkpoint version {version!r} is not "
                f"{FSDP_STATE_VERSION}"
            )
        self.feedback.clear()
        for name, r in d["residuals"].items():
            self.feedback.store(self.key(name), r.clone())
        self.stats.load_dict(d["stats"])


class CompressedReduceScatter(_reduce_scatter_base()):  # type: ignore[misc]
    """FSDP2's reduce-scatter for one module, compressed as ``state`` says.

    Runs synchronously (FSDP2 calls it so, on its reduce-scatter stream).
    """

    def __init__(self, state: FsdpCompressionState, name: str) -> None:
        self.state = state
        self.name = name
        self.key = state.key(name)

    def allocate(
        self,
        size: Sequence[int | torch.SymInt],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> dist.Work | None:
        state = self.state
        world = group.size()
        mean = op == dist.ReduceOp.AVG
        if input_tensor.numel() != world * output_tensor.numel():
            raise ValueError(
                f"xcomm.hooks.CompressedReduceScatter: input has {input_tensor.numel()} elements, "
                f"expected {world} x output ({output_tensor.numel()})"
            )
        rs_bytes = alltoall_bytes(input_tensor.nbytes, world)
        if (
            state.method == "none"
            or not (mean or op == dist.ReduceOp.SUM)
            or input_tensor.nbytes < state.min_bytes
            or not input_tensor.is_floating_point()
        ):
            state.stats.record(rs_bytes, rs_bytes)
            return _reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        if state.method == "int8":
            total = self._int8(input_tensor, group, world)
        else:
            total = self._cast(input_tensor, group, world, _CAST_DTYPES[state.method])
        if mean:
            total.div_(world)
        output_tensor.copy_(total)
        return None

    def _int8(self, flat: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
        state = self.state
        if flat.device.type != "cpu":
            raise TypeError(
                "xcomm.hooks.CompressedReduceScatter: int8 runs on CPU tensors; "
                f"got a {flat.device.type} gradient (use method='bf16' or 'fp16' there)"
            )
        feedback = state.feedback if state.error_feedback else None
        rows = state.codec.pack_rows(flat, world, feedback, self.key)  # uint8 [world, bytes]
        received = torch.empty_like(rows)
        dist.all_to_all_single(received, rows, group=group)
        state.stats.record(alltoall_bytes(flat.nbytes, world), alltoall_bytes(rows.numel(), world))
        padded = state.codec.row_elems(flat.numel(), world)
        return state.codec.reduce_shards(received, padded)[: flat.numel() // world]

    def _cast(
        self, flat: torch.Tensor, group: dist.ProcessGroup, world: int, dtype: torch.dtype
    ) -> torch.Tensor:
        state = self.state
        a = flat.float()
        if state.error_feedback:
            r = state.feedback.get(self.key)
            if r is not None:
                a = a + r.view_as(a)
        low = a.to(dtype)
        if state.error_feedback:
            state.feedback.store(self.key, a - low.float())
        received = torch.empty_like(low)
        dist.all_to_all_single(received, low, group=group)
        state.stats.record(alltoall_bytes(flat.nbytes, world), alltoall_bytes(low.nbytes, world))
        rows = received.view(world, -1)
        total = rows[0].float()
        for j in range(1, world):  # rank order: the same bits every run
            total += rows[j]
        return total


def compress_reduce_scatter(
    model: torch.nn.Module,
    method: str = "int8",
    *,
    state: FsdpCompressionState | None = None,
    **settings: Any,
) -> FsdpCompressionState:
    """Compresses the gradient reduce-scatter of every ``fully_shard`` module
    in ``model`` (see the module docstring) and returns the shared state.

    Args:
        model: a model whose modules ``fully_shard`` wrapped.
        method: one of :data:`FSDP_METHODS`.
        state: a state to reuse (e.g. one loaded from a checkpoint); otherwise
            a new one from ``method`` and ``settings``.
        settings: :class:`FsdpCompressionState`'s other fields.

    Example::

        >>> state = compress_reduce_scatter(model, "bf16")  # doctest: +SKIP
    """
    from torch.distributed.fsdp import FSDPModule

    if state is None:
        state = FsdpCompressionState(method=method, **settings)
    elif settings:
        raise ValueError(
            "xcomm.hooks.compress_reduce_scatter: pass settings or a state, not both "
            f"(got {sorted(settings)})"
        )
    found = 0
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(CompressedReduceScatter(state, name or "<root>"))
            found += 1
    if found == 0:
        raise ValueError(
            "xcomm.hooks.compress_reduce_scatter: no module of the model is wrapped by "
            "fully_shard; call it after fully_shard"
        )
    return state
