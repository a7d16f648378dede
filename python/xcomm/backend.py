"""Creation of xcomm process groups: the creator that torch.distributed calls.

Each xcomm group wraps transport backends built over its own view of the
group's store: a ``ProcessGroupGloo`` for CPU tensors and, when torch has CUDA
and a GPU is visible, a ``ProcessGroupNCCL`` for CUDA tensors. The C++
``XcommBackend`` checks and stages every call and hands it to the right one.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from . import _C, shm
from .options import Options

__all__ = ["create_backend"]


def _gloo_transport(
    store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, prefix: str = "xcomm/gloo"
) -> Any:
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)


def _nccl_transport(
    store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, group_name: str
) -> Any | None:
    if not (_C.built_with_cuda and torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.group_name = group_name
    return dist.ProcessGroupNCCL(dist.PrefixStore("xcomm/nccl", store), rank, size, opts)


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
    timeout = pg_options.timeout or dist_backend_opts.timeout
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    store = dist_backend_opts.store
    rank = dist_backend_opts.group_rank
    size = dist_backend_opts.group_size
    compression = pg_options.compression or "none"
    # Gloo, wrapped in the shared-memory transport when the whole group is on one host.
    cpu = shm.maybe_shm_transport(
        store,
        rank,
        size,
        timeout,
        _gloo_transport(store, rank, size, timeout),
        pg_options.shm,
        leader_compression=compression,
        compression_min_bytes=pg_options.compression_min_bytes,
        int8_chunk_elems=pg_options.int8_chunk_elems,
    )
    if getattr(cpu, "hierarchical", False):
        # A group spanning hosts compresses only its leaders' step, inside the
        # hierarchical allreduce (sums within a host stay exact); the backend
        # itself then compresses nothing.
        compression = "none"
    # int8 runs two collectives back to back on a worker thread: they get a
    # Gloo of their own, so their order never mixes with the caller's ops.
    compression_transport = (
        _gloo_transport(store, rank, size, timeout, "xcomm/gloo-int8")
        if compression == "int8"
        else None
    )
    backend = _C.XcommBackend(
        rank,
        size,
        timeout,
        cpu,
        _nccl_transport(store, rank, size, timeout, str(dist_backend_opts.group_id)),
        compression=compression,
        compression_min_bytes=pg_options.compression_min_bytes,
        int8_chunk_elems=pg_options.int8_chunk_elems,
        cpu_compression_transport=compression_transport,
    )
    if pg_options.fusion_threshold_bytes:
        # A cycle's agreement rounds get a Gloo of their own: their order
        # never mixes with the ops they schedule.
        control = (
            _gloo_transport(store, rank, size, timeout, "xcomm/gloo-fusion")
            if pg_options.fusion_cycle_ms > 0
            else None
        )
        _C.set_fusion_threshold(
            backend,
            pg_options.fusion_threshold_bytes,
            cycle_ms=float(pg_options.fusion_cycle_ms),
            control=control,
        )
    return backend
