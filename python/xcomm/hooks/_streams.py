"""CUDA stream bookkeeping for hooks whose work continues in future callbacks."""

from __future__ import annotations

import torch


def used_on_this_stream(*tensors: torch.Tensor | None) -> None:
    """Tells CUDA's caching allocator that the current stream uses ``tensors``.

    A future's callback runs on a stream from torch's pool, not on the stream
    that allocated the hook's buffers. Without this, a buffer the callback
    reads (a gathered payload, random-k's positions) goes back to its
    allocation stream's pool when the callback drops it, and the hook's next
    bucket can be given the same memory and overwrite it before the
    callback's kernels have read it. Call it in the callback, after queuing
    the kernels; it does nothing for CPU tensors.

    Example::

        >>> import torch
        >>> used_on_this_stream(torch.empty(1), None)  # CPU: nothing to do
    """
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
