"""Creation of xcomm process groups: the creator that torch.distributed calls.

What a group is (its shape: plain, single-host shared memory or hierarchical;
its auxiliary groups; who compresses what) is decided in C++, once, by
``GroupPlan`` (csrc/backend/GroupPlan.hpp), and the group is built by
``buildGroup`` (csrc/backend/GroupBuilder.cpp). This module only supplies the
inner backends the plan asks for: a ``ProcessGroupGloo`` for each CPU
backend and, when torch has CUDA and a GPU is visible, a ``ProcessGroupNCCL``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from . import _C, compat
from .options import Options

__all__ = ["create_backend", "group_plan"]


# This process's Gloo devices, shared by every Gloo group xcomm builds in it,
# keyed by what chooses them. A device is a listening socket and an event
# loop thread: making one per group costs about a millisecond, and letting
# one go joins its loop (up to 10 ms), on the path of every group built,
# shrunk or reconfigured. A forked child makes its own (the pid in the key).
_GLOO_DEVICES: dict[tuple[int, str, str], list[Any]] = {}


def _gloo_devices() -> list[Any]:
    """The Gloo devices a new Gloo group uses, as ``ProcessGroupGloo`` would
    choose them: one per interface in ``GLOO_SOCKET_IFNAME``, else the
    host's default."""
    ifnames = os.environ.get("GLOO_SOCKET_IFNAME", "")
    key = (os.getpid(), ifnames, os.environ.get("GLOO_DEVICE_TRANSPORT", ""))
    devices = _GLOO_DEVICES.get(key)
    if devices is None:
        devices = _new_gloo_devices(ifnames)
        _GLOO_DEVICES[key] = devices
    return devices


def _lazy_gloo() -> bool:
    """Whether Gloo's pairs connect at their first use (TORCH_GLOO_LAZY_INIT)."""
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "0") not in ("", "0")


def _new_gloo_devices(ifnames: str) -> list[Any]:
    gloo = dist.ProcessGroupGloo
    if len(ifnames) > 1:
        return [gloo.create_device(interface=name) for name in ifnames.split(",")]
    return [gloo.create_default_device()]


# Gloo waits five times its timeout for a pair's first connection
# (gloo/transport/tcp/pair.h, waitUntil), so a peer that dies between
# publishing its address and connecting would cost five group timeouts.
_GLOO_CONNECT_ALLOWANCE = 5


class _StoreWaitingAtLeast(dist.Store):
    """The group's store, with every wait lasting at least ``floor``: Gloo
    is built with a fifth of the group timeout (so its connect allowance is
    the timeout), and its waits for the peers' addresses keep the whole
    timeout."""

    def __init__(self, inner: dist.Store, floor: datetime.timedelta) -> None:
        super().__init__()
        self._inner = inner
        self._floor = floor

    def set(self, key: str, value: Any) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self._inner.get(key)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def deleteKey(self, key: str) -> bool:  # the name torch's trampoline calls
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._inner.wait(keys, max(timeout or self._floor, self._floor))


def _gloo(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """A Gloo group that reports a peer lost during its set-up within
    ``timeout``, as it does for its collectives (``ProcessGroupGloo`` built
    directly takes five times the timeout there)."""
    lazy = _lazy_gloo()
    options = dist.ProcessGroupGloo._Options()
    # Pairs that connect at their first use fail to when their group shares a
    # device with another (Gloo's own groups each have theirs).
    options._devices = (
        _new_gloo_devices(os.environ.get("GLOO_SOCKET_IFNAME", "")) if lazy else _gloo_devices()
    )
    options._threads = 2 * len(options._devices)  # as ProcessGroupGloo's own default
    options._timeout = timeout / _GLOO_CONNECT_ALLOWANCE
    # Gloo reads its peers' addresses through this Python object, which only
    # this frame keeps alive: every pair must connect before it returns.
    waiting_store = _StoreWaitingAtLeast(store, timeout)
    group = dist.ProcessGroupGloo(waiting_store, rank, size, options)
    group._set_default_timeout(timeout)  # its collectives get the whole timeout
    if lazy and size > 1:
        _connect_every_pair(group, size)
    return group


def _connect_every_pair(group: Any, size: int) -> None:
    """Connects every pair of a Gloo group made under
    ``TORCH_GLOO_LAZY_INIT=1``, whose pairs would otherwise connect at their
    first use: an all-to-all of one byte per rank, while the set-up's store
    wrapper is alive (the pairs read their peers' addresses through it; it
    is gone after the set-up).
    xcomm's groups connect at set-up: a peer lost then fails the set-up (a
    reconfigure then keeps the old group), not a later op. And left lazy, a
    plain group's first checked all_reduce at 2 ranks failed after the
    whole timeout, and Gloo's connect after five."""
    received = torch.empty(size, dtype=torch.uint8)
    group.alltoall_base(received, torch.zeros(size, dtype=torch.uint8), [], []).wait()


def _nccl_factory(group_name: str) -> Any | None:
    if not (_C.built_with_cuda and torch.cuda.is_available() and dist.is_nccl_available()):
        return None

    def nccl(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.group_name = group_name
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    return nccl


def create_backend(dist_backend_opts: Any, pg_options: Options | None) -> _C.XcommBackend:
    """Builds the backend of one process group (torch's extended creator API).

    Args:
        dist_backend_opts: torch's ``_DistributedBackendOptions``: the group's
            store, rank, size, timeout and name.
        pg_options: what the user passed as ``pg_options``: an ``xcomm.Options``
            or ``None``.
    """
    if pg_options is None:
        pg_options = Options()
    if not isinstance(pg_options, Options):
        raise TypeError(
            f"xcomm: pg_options must be an xcomm.Options, got {type(pg_options).__name__}"
        )
    compat.mark_group_made()
    timeout = pg_options.timeout or dist_backend_opts.timeout
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    # torch 2.14's init_process_group(enable_reconfigure=True); absent before.
    await_reconfigure = bool(getattr(dist_backend_opts, "enable_reconfigure", False))
    if await_reconfigure and not _lazy_gloo():
        # Nothing is built until the first reconfigure, which the other
        # members wait on: have this process's Gloo device ready for it
        # (lazily connecting groups each make their own).
        _gloo_devices()
    return _C.build_group(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        pg_options.to_cpp(timeout),
        _gloo,
        _nccl_factory(str(dist_backend_opts.group_id)),
        await_reconfigure=await_reconfigure,
    )


def group_plan(group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """What an xcomm group is: its shape and why, its hosts, who compresses
    what, fusion, and each auxiliary group with the reason it exists.

    Example::

        >>> import torch.distributed as dist, xcomm
        >>> dist.init_process_group("xcomm")  # doctest: +SKIP
        >>> print(xcomm.group_plan()["description"])  # doctest: +SKIP
        shape: single-host shared memory (every rank on one host)
        ...
    """
    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.XcommBackend):
        raise TypeError(
            f"xcomm.group_plan: the group's backend is {type(backend).__name__}, not xcomm"
        )
    return dict(backend.plan)
