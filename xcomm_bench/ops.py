"""The collectives the sweep times, each with buffers and a correctness check.

Every case owns its buffers for one message size and offers three steps:

* :meth:`Case.reset` fills the buffers for timing (an allreduce is timed in
  place on zeros, so repeated sums stay exact and finite);
* :meth:`Case.run` issues the collective once (what is timed);
* :meth:`Case.prepare_check` loads a known pattern (and sentinels in outputs);
  after one more :meth:`Case.run`, :meth:`Case.check` compares the output
  with the value the op must produce.

The patterns are small integers (< 256), exact in every dtype including
bfloat16, so the checks compare exactly.

Example::

    >>> import torch
    >>> case = make_case("allreduce", 1024, rank=0, world_size=1, dtype=torch.float32)
    >>> case.nbytes, case.count
    (1024, 256)
"""

from __future__ import annotations

import abc
from typing import Any

import torch
import torch.distributed as dist

from .metrics import OPS

__all__ = ["Case", "effective_count", "make_case"]

_SENTINEL = -1

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single
# (the old names warn); same ops, same c10d calls.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def effective_count(op: str, nbytes: int, world_size: int, element_size: int) -> int:
    """Elements in the op's buffer of about ``nbytes``: at least one per rank,
    and a multiple of ``world_size`` for the ops that split the buffer."""
    count = max(1, nbytes // element_size)
    if op in ("allgather", "reduce_scatter", "alltoall"):
        count = max(world_size, count // world_size * world_size)
    return count


def _periodic(
    count: int, period: int, start: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``(start + i) % period`` for i in [0, count), built from a small tile."""
    tile = (torch.arange(period, device=device) + start) % period
    reps = -(-count // period)
    return tile.repeat(reps)[:count].to(dtype)


class Case(abc.ABC):
    """One collective at one size on one rank (buffers + run + check).

    Attributes:
        op: Name of the op (see :data:`xcomm_bench.metrics.OPS`).
        count: Elements of the op's buffer (total for split ops).
        nbytes: ``count * element size``: the ``S`` of algbw = S / t.
    """

    op: str = ""

    def __init__(
        self, count: int, rank: int, world_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.count = count
        self.rank = rank
        self.n = world_size
        self.dtype = dtype
        self.device = device
        self.nbytes = count * torch.tensor([], dtype=dtype).element_size()

    def _pattern(self, count: int, period: int, start: int = 0) -> torch.Tensor:
        return _periodic(count, period, start, self.dtype, self.device)

    @abc.abstractmethod
    def reset(self) -> None:
        """Sets the buffers up for timed iterations."""

    @abc.abstractmethod
    def run(self, group: Any) -> None:
        """Issues the collective once on ``group`` and waits for it."""

    @abc.abstractmethod
    def prepare_check(self) -> None:
        """Loads the check pattern into inputs and sentinels into outputs."""

    @abc.abstractmethod
    def check(self) -> bool:
        """True when the output of the last :meth:`run` after :meth:`prepare_check` is right."""


class _AllReduce(Case):
    op = "allreduce"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.buf = torch.zeros(self.count, dtype=self.dtype, device=self.device)

    def reset(self) -> None:
        self.buf.zero_()

    def run(self, group: Any) -> None:
        dist.all_reduce(self.buf, group=group)

    def prepare_check(self) -> None:
        self.buf.copy_(self._pattern(self.count, 7) + (self.rank + 1))

    def check(self) -> bool:
        n = self.n
        expected = self._pattern(self.count, 7) * n + n * (n + 1) // 2
        return torch.equal(self.buf, expected)


class _Broadcast(Case):
    op = "broadcast"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.buf = self._pattern(self.count, 7) + 1

    def reset(self) -> None:
        pass

    def run(self, group: Any) -> None:
        dist.broadcast(self.buf, src=_global_rank(0, group), group=group)

    def prepare_check(self) -> None:
        if self.rank == 0:
            self.buf.copy_(self._pattern(self.count, 7) + 1)
        else:
            self.buf.fill_(_SENTINEL)

    def check(self) -> bool:
        return torch.equal(self.buf, self._pattern(self.count, 7) + 1)


class _AllGather(Case):
    op = "allgather"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.chunk = self.count // self.n
        self.inp = self._pattern(self.chunk, 7) + (self.rank + 1)
        self.out = torch.empty(self.count, dtype=self.dtype, device=self.device)

    def reset(self) -> None:
        pass

    def run(self, group: Any) -> None:
        _all_gather(self.out, self.inp, group=group)

    def prepare_check(self) -> None:
        self.out.fill_(_SENTINEL)

    def check(self) -> bool:
        base = self._pattern(self.chunk, 7)
        expected = torch.cat([base + (s + 1) for s in range(self.n)])
        return torch.equal(self.out, expected)


class _ReduceScatter(Case):
    op = "reduce_scatter"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.chunk = self.count // self.n
        self.inp = self._pattern(self.count, 7) + (self.rank + 1)
        self.out = torch.empty(self.chunk, dtype=self.dtype, device=self.device)

    def reset(self) -> None:
        pass

    def run(self, group: Any) -> None:
        _reduce_scatter(self.out, self.inp, group=group)

    def prepare_check(self) -> None:
        self.out.fill_(_SENTINEL)

    def check(self) -> bool:
        n = self.n
        start = (self.rank * self.chunk) % 7
        expected = self._pattern(self.chunk, 7, start) * n + n * (n + 1) // 2
        return torch.equal(self.out, expected)


class _AllToAll(Case):
    op = "alltoall"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.chunk = self.count // self.n
        wiggle = self._pattern(self.chunk, 3) * 64
        # Chunk d goes to rank d and carries (sender * n + d) mod 61.
        self.inp = torch.cat([wiggle + (self.rank * self.n + d) % 61 for d in range(self.n)])
        self.out = torch.empty(self.count, dtype=self.dtype, device=self.device)

    def reset(self) -> None:
        pass

    def run(self, group: Any) -> None:
        dist.all_to_all_single(self.out, self.inp, group=group)

    def prepare_check(self) -> None:
        self.out.fill_(_SENTINEL)

    def check(self) -> bool:
        wiggle = self._pattern(self.chunk, 3) * 64
        expected = torch.cat([wiggle + (s * self.n + self.rank) % 61 for s in range(self.n)])
        return torch.equal(self.out, expected)


_CASES: dict[str, type[Case]] = {
    c.op: c for c in (_AllReduce, _Broadcast, _AllGather, _ReduceScatter, _AllToAll)
}
assert set(_CASES) == set(OPS)


def _global_rank(group_rank: int, group: Any) -> int:
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def make_case(
    op: str,
    nbytes: int,
    *,
    rank: int,
    world_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Case:
    """Allocates the buffers of ``op`` for a message of about ``nbytes``.

    The actual size (``case.nbytes``) is rounded down to whole elements and,
    for allgather / reduce_scatter / alltoall, to a multiple of the world
    size (see :func:`effective_count`).

    Raises:
        ValueError: unknown op.
    """
    if op not in _CASES:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    element_size = torch.tensor([], dtype=dtype).element_size()
    count = effective_count(op, nbytes, world_size, element_size)
    return _CASES[op](count, rank, world_size, dtype, torch.device(device))
