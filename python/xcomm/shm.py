"""Shared-memory transport for groups whose ranks all run on one host.

Whether a group qualifies is decided per process group, from a host identity
every member publishes through the group's store, never from launcher
environment variables (``LOCAL_WORLD_SIZE`` says nothing about sub-groups).
The identity is the hostname, the kernel boot id, the inodes of the network,
IPC and PID namespaces and the device/inode of ``/dev/shm``: two network
namespaces on one machine (an emulated cluster's "nodes") count as different
hosts, and ranks must share the ``/dev/shm`` filesystem and see each other's
pids (PID namespace, used to detect a dead peer).

When every member has the same identity, the group's CPU transport becomes a
``ShmCpuBackend`` over one shared segment: allreduce, broadcast, allgather,
reduce_scatter and barrier run through shared memory; every other op (and any
dtype without a kernel) still goes to the Gloo backend it wraps. If any rank
cannot set up the segment, every rank keeps Gloo alone.

When the members span several hosts and some host has several, allreduce is
hierarchical: a shared-memory allreduce inside each host, an allreduce among
one leader per host over Gloo, a shared-memory broadcast back. With
``xcomm.Options(compression="fp16" | "bf16" | "int8")`` only the leaders'
step is compressed: the sums inside a host stay exact, the bytes between
hosts shrink 2x (16-bit) or ~4x (int8) more.

Switches: ``xcomm.Options(shm=False)`` or the environment variable
``XCOMM_SHM=0`` turn it off. Tuning (read on rank 0, shared with the group):
``XCOMM_SHM_SLOT_BYTES`` (bytes per rank per buffer, default 1 MiB) and
``XCOMM_SHM_SMALL_BYTES`` (largest allreduce taking the one-barrier path,
default 256 KiB); ``XCOMM_SHM_SPIN_US`` (per rank) sets how long a waiting
rank spins before it sleeps on a futex. ``XCOMM_SHM_HIERARCHICAL=0`` keeps
groups that span hosts on flat Gloo; ``XCOMM_SHM_HOST_TAG`` is mixed into
the host identity (ranks with different tags count as different hosts).

Example::

    >>> import torch.distributed as dist, xcomm
    >>> dist.init_process_group("xcomm")  # doctest: +SKIP
    >>> xcomm.shm.is_active(dist.group.WORLD)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from . import _C

__all__ = [
    "DEFAULT_SLOT_BYTES",
    "enabled",
    "host_identity",
    "is_active",
    "maybe_shm_transport",
    "ops_run",
]

_log = logging.getLogger("xcomm.shm")

DEFAULT_SLOT_BYTES = 1 << 20
DEFAULT_SMALL_BYTES = 256 << 10


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def _ns(kind: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return "?"


def _shm_mount() -> str:
    """The tmpfs behind /dev/shm (not the mount namespace: ``ip netns exec``
    gives every process its own mount namespace over the same /dev/shm)."""
    try:
        st = os.stat("/dev/shm")
        return f"shm:{st.st_dev}:{st.st_ino}"
    except OSError:
        return "shm:?"


def host_identity() -> str:
    """This process's host identity: equal strings mean shared memory works
    between the two processes (same kernel, ``/dev/shm`` and pid space)."""
    parts = [
        socket.gethostname(),
        _read("/proc/sys/kernel/random/boot_id"),
        *(f"{k}:{_ns(k)}" for k in ("net", "ipc", "pid")),
        _shm_mount(),
        # Splits one machine into logical hosts (tests of the hierarchical path).
        os.environ.get("XCOMM_SHM_HOST_TAG", ""),
    ]
    return "|".join(parts)


def enabled(shm_option: bool) -> bool:
    """Whether the shared-memory path may be used: the ``Options`` switch and
    ``XCOMM_SHM`` (``0``/``false``/``off`` turn it off)."""
    env = os.environ.get("XCOMM_SHM", "1").strip().lower()
    return bool(shm_option) and env not in ("0", "false", "off", "no")


def _host_identities(store: dist.Store, rank: int, size: int) -> list[str]:
    store.set(f"host/{rank}", host_identity())
    return [store.get(f"host/{r}").decode() for r in range(size)]


def _group_config(store: dist.Store, rank: int) -> tuple[int, int]:
    """(slot bytes, small-allreduce bytes), chosen by rank 0 so that every
    rank takes the same algorithm for the same message."""
    if rank == 0:
        slot = int(os.environ.get("XCOMM_SHM_SLOT_BYTES", DEFAULT_SLOT_BYTES))
        small = int(os.environ.get("XCOMM_SHM_SMALL_BYTES", DEFAULT_SMALL_BYTES))
        store.set("config", f"{slot},{small}")
    slot_s, small_s = store.get("config").decode().split(",")
    return int(slot_s), int(small_s)


def hierarchical_enabled() -> bool:
    """``XCOMM_SHM_HIERARCHICAL=0`` keeps groups that span hosts on flat Gloo."""
    env = os.environ.get("XCOMM_SHM_HIERARCHICAL", "1").strip().lower()
    return env not in ("0", "false", "off", "no")


def maybe_shm_transport(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    gloo: Any,
    shm_option: bool = True,
    leader_compression: str = "none",
    compression_min_bytes: int = 64 << 10,
    int8_chunk_elems: int = 1024,
) -> Any:
    """The CPU transport of a group: a ``ShmCpuBackend`` wrapping ``gloo``
    when the segment(s) can be set up, else ``gloo`` itself. Collective over
    the group's ``store`` (all ranks call it with the same ``shm_option``).

    * every member on this host: all CPU collectives that have a
      shared-memory algorithm use it;
    * members on several hosts, some host with several: hierarchical
      allreduce (shared memory inside each host, Gloo among one leader per
      host, shared-memory broadcast back); other ops stay on Gloo;
    * one rank per host: Gloo alone.
    """
    if size < 2 or not enabled(shm_option):
        return gloo
    shm_store = dist.PrefixStore("xcomm/shm", store)
    ids = _host_identities(shm_store, rank, size)
    hosts = list(dict.fromkeys(ids))  # in order of first appearance: the same on every rank
    slot, small = _group_config(shm_store, rank)
    spin = int(os.environ.get("XCOMM_SHM_SPIN_US", "-1"))
    if len(hosts) == 1:
        backend, why_not = _C.ShmCpuBackend.try_create(
            shm_store, rank, size, timeout, gloo, slot, spin, small
        )
        if backend is None:
            _log.warning("xcomm: shared memory unavailable (%s); this group uses gloo", why_not)
            return gloo
        return backend
    if len(hosts) == size or not hierarchical_enabled():
        return gloo
    local = [r for r in range(size) if ids[r] == ids[rank]]
    host = hosts.index(ids[rank])
    local_rank = local.index(rank)
    leaders = None
    if local_rank == 0:
        leaders = dist.ProcessGroupGloo(
            dist.PrefixStore("xcomm/leaders", store), host, len(hosts), timeout
        )
    backend, why_not = _C.ShmCpuBackend.try_create_hierarchical(
        dist.PrefixStore(f"xcomm/shm/host{host}", store),
        local_rank,
        len(local),
        rank,
        size,
        len(hosts),
        timeout,
        gloo,
        leaders,
        slot,
        spin,
        small,
        leader_compression,
        compression_min_bytes,
        int8_chunk_elems,
    )
    # Every host must take the same path, or allreduce would deadlock.
    shm_store.set(f"hierarchical/{rank}", "1" if backend is not None else "0")
    if not all(shm_store.get(f"hierarchical/{r}") == b"1" for r in range(size)):
        _log.warning(
            "xcomm: shared memory unavailable on some host (%s); this group uses gloo", why_not
        )
        return gloo
    return backend


def is_active(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the world) runs its CPU collectives over
    shared memory."""
    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    return getattr(backend, "cpu_transport_name", "") == "xcomm-shm"


def ops_run(group: dist.ProcessGroup | None = None) -> int:
    """How many collectives ``group`` ran over shared memory (-1: it does not
    use shared memory)."""
    pg = group if group is not None else dist.group.WORLD
    return int(_C.shm_ops_of(pg._get_backend(torch.device("cpu"))))
