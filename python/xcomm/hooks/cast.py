"""fp16 and bf16 compression hooks: halve the bytes, keep allreduce.

Each rank sends ``g / n`` cast to 16 bits; the allreduce sums them, so every
rank receives the mean gradient in 16 bits, which is cast back into the
bucket. Dividing before the cast keeps fp16 from overflowing on large sums.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ._common import PicklableState, check_floating, group_size
from ._streams import used_on_this_stream
from .stats import CompressionStats, allreduce_bytes

__all__ = ["CastState", "bf16_cast_hook", "fp16_cast_hook"]


@dataclass
class CastState(PicklableState):
    """State of the fp16/bf16 hooks: the group and the statistics.

    Example::

        >>> from xcomm.hooks import CastState, fp16_cast_hook
        >>> model.register_comm_hook(CastState(), fp16_cast_hook)  # doctest: +SKIP

    (torch's DDP refuses hooks *named* ``bf16_compress_hook`` without CUDA and
    NCCL, so xcomm's are named ``*_cast_hook``.)
    """

    process_group: dist.ProcessGroup | None = None
    stats: CompressionStats = field(default_factory=CompressionStats)

    def state_dict(self) -> dict:
        return {"stats": self.stats.as_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.stats.load_dict(d["stats"])


def _cast_hook(
    state: CastState, bucket: dist.GradBucket, dtype: torch.dtype, name: str
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    check_floating(name, buffer)
    world = group_size(state.process_group)
    compressed = buffer.to(dtype).div_(world)
    state.stats.record(
        allreduce_bytes(buffer.nbytes, world), allreduce_bytes(compressed.nbytes, world)
    )
    fut = dist.all_reduce(compressed, group=state.process_group, async_op=True).get_future()

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        summed = f.value()[0]
        buffer.copy_(summed)
        used_on_this_stream(summed)
        return buffer

    return fut.then(decompress)


def fp16_cast_hook(state: CastState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket with an allreduce in float16 (2x fewer bytes than fp32)."""
    return _cast_hook(state, bucket, torch.float16, "fp16_cast_hook")


def bf16_cast_hook(state: CastState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket with an allreduce in bfloat16 (fp32's range, 8-bit mantissa)."""
    return _cast_hook(state, bucket, torch.bfloat16, "bf16_cast_hook")
