"""The compression methods xcomm's Python surfaces know, listed once.

Each method says where it runs, so that every list of method names (what the
DDP hook's ``auto`` may choose, its default set, what FSDP2 and DiLoCo
accept, what ``auto`` may choose on a GPU bucket without xcomm's CUDA
kernels) is a question to this table rather than a tuple of its own.

The backend's ``Options(compression=)`` names live in C++
(``csrc/common/Compression.hpp``, bound as ``xcomm._C.compression_names()``);
``tests/python/test_methods.py`` checks that the methods marked ``backend``
here are exactly those.

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


_EVERYWHERE = frozenset({"ddp", "fsdp", "diloco", "backend"})

#: Every method, cheapest codec first.
METHODS: tuple[Method, ...] = (
    Method("none", lossless=True, in_default=True, host_only=False, surfaces=_EVERYWHERE),
    Method("bf16", lossless=False, in_default=True, host_only=False, surfaces=_EVERYWHERE),
    Method("fp16", lossless=False, in_default=False, host_only=False, surfaces=_EVERYWHERE),
    Method("int8", lossless=False, in_default=True, host_only=True, surfaces=_EVERYWHERE),
    Method("topk", lossless=False, in_default=True, host_only=True, surfaces=frozenset({"ddp"})),
    Method(
        "powersgd", lossless=False, in_default=True, host_only=True, surfaces=frozenset({"ddp"})
    ),
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
    if surface not in _EVERYWHERE:
        raise ValueError(f"unknown surface {surface!r}; known: {sorted(_EVERYWHERE)}")
    return tuple(
        m.name
        for m in METHODS
        if surface in m.surfaces
        and (m.in_default or not default_only)
        and (m.lossless or not lossless_only)
        and (not m.host_only or not device_capable_only)
    )
