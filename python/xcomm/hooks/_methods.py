"""The compression methods xcomm knows, as Python reads them.

The table itself lives in C++ (``csrc/common/Methods.hpp``, bound as
``xcomm._C.methods()``), where the backend's ``Options(compression=)``
names, its ``auto``'s choices and the cost model's errors read it too. Each
method says where it runs, so that every list of method names (what the DDP
hook's ``auto`` may choose, its default set, what FSDP2 and DiLoCo accept,
what ``auto`` may choose on a GPU bucket without xcomm's CUDA kernels) is a
question to this one table rather than a tuple of its own.

Order: cheapest codec first. Every chooser breaks ties towards the earlier
method, and DiLoCo agrees on a method by its index in its list, so the order
is part of the contract.

Example:
    >>> method_names("fsdp")
    ('none', 'bf16', 'fp16', 'int8')
    >>> method_names("ddp", default_only=True)
    ('none', 'bf16', 'int8', 'topk', 'powersgd')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .. import _C

__all__ = ["METHODS", "Method", "Surface", "method_names"]

#: Where a method can run: ``ddp`` (``auto_hook`` can choose it; each also has
#: a hook of its own), ``fsdp`` (:func:`~xcomm.hooks.compress_reduce_scatter`),
#: ``diloco`` (:class:`~xcomm.diloco.DiLoCo`), ``backend``
#: (``xcomm.Options(compression=)``).
Surface = Literal["ddp", "fsdp", "diloco", "backend"]


@dataclass(frozen=True)
class Method:
    """One compression method and where it runs.

    Attributes:
        name: What users pass (``"int8"``).
        lossless: Whether the reduction is exact (only ``"none"``).
        in_default: Whether ``auto`` chooses among it unless told otherwise.
            Under its default objective ``auto`` uses a cast, int8 or top-k
            only on a bucket where it drops at most 1% of the step's
            gradient (``AutoState.max_lost_share``): top-k passes on mostly
            zero gradients (an embedding table's, where it dropped 0.1-0.2%
            and reached the target loss in the steps uncompressed training
            took) and fails on dense ones. PowerSGD passes a gate on the
            whole step instead (``AutoState.powersgd_steps``): only where
            its steps are at least 2.5x as fast as the best without it.
            fp16 is left out: bf16 sends the same bytes without its range
            limit.
        host_only: Whether, where xcomm was built without its CUDA codec
            kernels, its codec would run on the host for a GPU bucket (a
            cast runs on the device with torch's own ops).
        surfaces: Where it runs.

    Example:
        >>> METHODS[0].lossless
        True
    """

    name: str
    lossless: bool
    in_default: bool
    host_only: bool
    surfaces: frozenset[str]


_SURFACES = frozenset({"ddp", "fsdp", "diloco", "backend"})

#: Every method, cheapest codec first (the C++ table's rows).
METHODS: tuple[Method, ...] = tuple(
    Method(
        name=row["name"],
        lossless=row["lossless"],
        in_default=row["in_default"],
        host_only=row["host_only"],
        surfaces=frozenset(row["surfaces"]),
    )
    for row in _C.methods()
)


def method_names(
    surface: Surface,
    *,
    default_only: bool = False,
    lossless_only: bool = False,
    device_capable_only: bool = False,
) -> tuple[str, ...]:
    """The names of the methods that run on ``surface``, in :data:`METHODS`' order.

    Args:
        surface: ``"ddp"``, ``"fsdp"``, ``"diloco"`` or ``"backend"``.
        default_only: Only those ``auto`` chooses among unless told otherwise.
        lossless_only: Only exact ones.
        device_capable_only: Only those whose codec runs on a GPU without
            xcomm's CUDA codec kernels.

    Example:
        >>> method_names("ddp", device_capable_only=True)
        ('none', 'bf16', 'fp16')
    """
    if surface not in _SURFACES:
        raise ValueError(f"unknown surface {surface!r}; known: {sorted(_SURFACES)}")
    return tuple(
        m.name
        for m in METHODS
        if surface in m.surfaces
        and (m.in_default or not default_only)
        and (m.lossless or not lossless_only)
        and (not m.host_only or not device_capable_only)
    )
