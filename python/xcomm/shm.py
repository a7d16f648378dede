"""Shared-memory transport for groups whose ranks all run on one host.

Whether a group qualifies is decided per process group, from a host identity
every member publishes through the group's store, never from launcher
environment variables (``LOCAL_WORLD_SIZE`` says nothing about sub-groups);
the decision is the group's ``GroupPlan`` (csrc/backend/GroupPlan.hpp, shown
by :func:`xcomm.group_plan`). The identity (:func:`host_identity`) is the hostname, the kernel boot id, the inodes of the network,
IPC and PID namespaces and the device/inode of ``/dev/shm``: two network
namespaces on one machine (an emulated cluster's "nodes") count as different
hosts, and ranks must share the ``/dev/shm`` filesystem and see each other's
pids (PID namespace, used to detect a dead peer).

When every member has the same identity, the group's CPU transport becomes a
``ShmRoute`` over one shared segment: allreduce, broadcast, allgather,
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
``XCOMM_SHM=0`` turn it off. Tuning (agreed by every rank when the group is
made: a rank whose value differs gets a ``ValueError`` naming it):
``Options(shm_slot_bytes=...)`` (bytes per rank per buffer, default 1 MiB)
and ``Options(shm_small_bytes=...)`` (largest allreduce taking the
one-barrier path, default 256 KiB), which ``XCOMM_SHM_SLOT_BYTES`` and
``XCOMM_SHM_SMALL_BYTES`` override; ``XCOMM_SHM_SPIN_US`` (per rank) sets how
long a waiting rank spins before it sleeps on a futex.
``Options(shm_hierarchical=False)`` or ``XCOMM_SHM_HIERARCHICAL=0`` keeps
groups that span hosts on flat Gloo; ``XCOMM_SHM_HOST_TAG`` is mixed into
the host identity (ranks with different tags count as different hosts).

Example::

    >>> import torch.distributed as dist, xcomm
    >>> dist.init_process_group("xcomm")  # doctest: +SKIP
    >>> xcomm.shm.is_active(dist.group.WORLD)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C

__all__ = ["host_identity", "is_active", "ops_run"]


def host_identity() -> str:
    """This process's host identity: equal strings mean shared memory works
    between the two processes (same kernel, ``/dev/shm`` and pid space)."""
    return _C.host_identity()


def _xcomm_backend(group: dist.ProcessGroup | None) -> _C.XcommBackend | None:
    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    return backend if isinstance(backend, _C.XcommBackend) else None


def is_active(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the world) runs its CPU collectives over
    shared memory."""
    backend = _xcomm_backend(group)
    return backend is not None and backend.plan["shape"] != "plain"


def ops_run(group: dist.ProcessGroup | None = None) -> int:
    """How many collectives ``group`` ran over shared memory (-1: it does not
    use shared memory)."""
    backend = _xcomm_backend(group)
    return -1 if backend is None else int(backend.shm_ops)
