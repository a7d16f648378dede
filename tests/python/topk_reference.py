"""Top-k written the plain way, as the reference the codec's tests compare
against: the exact selection (ties to the lower index) and the split of k
between the tensors of a bucket (``TopKCodec.split_k``)."""

from __future__ import annotations

import torch


def topk_reference(acc: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest |acc|, ties to the lower index, ascending:
    every magnitude above the k-th, then the first of those equal to it.

    Example::

        >>> topk_reference(torch.tensor([1.0, -3.0, 3.0, 0.5]), 2).tolist()
        [1, 2]
    """
    mag = acc.abs()
    kth = torch.topk(mag, k).values.min()
    above = torch.nonzero(mag > kth).view(-1)
    tied = torch.nonzero(mag == kth).view(-1)[: k - above.numel()]
    return torch.sort(torch.cat([above, tied])).values


def split_k_reference(nonzero: list[int], sizes: list[int], k: int) -> list[int]:
    """k split by largest remainders in proportion to ``nonzero`` (by size
    when all are zero), each part at most its size, the rest to those with
    room.

    Example::

        >>> split_k_reference([100, 12], [100, 900], 56)
        [50, 6]
    """
    k = min(k, sum(sizes))
    weights = nonzero if sum(nonzero) else sizes
    quotas = [k * w / sum(weights) for w in weights]
    parts = [min(int(q), s) for q, s in zip(quotas, sizes)]
    order = sorted(range(len(sizes)), key=lambda i: -(quotas[i] - int(quotas[i])))
    for i in order:
        if sum(parts) < k and parts[i] < sizes[i] and quotas[i] > int(quotas[i]):
            parts[i] += 1
    for i in range(len(sizes)):
        parts[i] += min(sizes[i] - parts[i], k - sum(parts))
    return parts
