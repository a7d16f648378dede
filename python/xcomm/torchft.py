"""xcomm as torchft's cross-replica process group.

torchft (https://github.com/pytorch/torchft) keeps a job training when a
replica group dies: its ``Manager`` asks a lighthouse for a quorum at every
step and, whenever the quorum changes, re-creates the process group that
joins the replicas on a fresh store prefix through a
``torchft.process_group.ProcessGroupWrapper`` whose ``_create_pg`` builds the
backend. :class:`ProcessGroupXcomm` is that wrapper for xcomm, so DDP,
LocalSGD and DiLoCo under torchft run on xcomm (shared memory between the
replicas of one host, the checked Gloo route across hosts, compression by
``xcomm.Options``).

Why xcomm helps here: torchft needs a group it can abort while an op is
pending (Gloo's ``abort()`` does nothing, so torchft runs Gloo in a
subprocess it can kill). xcomm's ``abort()`` releases every pending CPU op of
the group within milliseconds, and a peer's death fails the survivors' ops
(at once on shared memory), so :meth:`ProcessGroupXcomm.abort` and
:meth:`ProcessGroupXcomm.errored` give the ``Manager`` what it polls.

This module needs torchft (``pip install torchft``); ``import xcomm`` does not
import it.

Example::

    from torchft import Manager
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper
    import xcomm
    from xcomm.torchft import ProcessGroupXcomm

    pg = ProcessGroupXcomm(timeout=timedelta(seconds=10), options=xcomm.Options(shm=True))
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load, state_dict=save,
                      replica_id="0", lighthouse_addr=lighthouse_address)
    model = DistributedDataParallel(manager, model)   # its allreduces run on xcomm
    optimizer = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupWrapper

from . import _C, compat
from .backend import _gloo, _nccl_factory
from .options import Options

__all__ = ["ProcessGroupXcomm"]

#: What :meth:`ProcessGroupXcomm.getBackendName` answers (torchft's names are "torchft-<backend>").
BACKEND_NAME = "torchft-xcomm"


class _TorchftWork(dist.Work):
    """An xcomm work as torchft's ``Manager`` needs it.

    ``wait()`` returns only once the work's future is done (xcomm's own
    ``wait()`` does so too, as Gloo's does; an older xcomm returned a moment
    before): torchft chains its callbacks on the future right after
    ``wait()``, expecting them to run at once (a later run takes the wrong
    link of its chain and fails the step).

    ``wait()`` does not raise: a failed op (a dead peer, an abort) leaves its
    error in its future, where torchft's ``Manager`` catches and reports it,
    and in :meth:`ProcessGroupXcomm.errored`, which the ``Manager`` reads
    before it commits the step. torchft's DDP hook fails with an
    ``AssertionError`` where ``wait()`` raises (torchft 0.2.0, also on its
    ``ProcessGroupGloo``), which ends the surviving replica.
    """

    def __init__(self, work: dist.Work, pg: ProcessGroupXcomm) -> None:
        super().__init__()
        self._work = work
        self._pg = pg

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        try:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            self._work.get_future().wait()
        except Exception as error:  # noqa: BLE001 - every op error goes to errored()
            self._pg._report(error)
            return False
        return True

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()


class ProcessGroupXcomm(ProcessGroupWrapper):
    """A reconfigurable xcomm process group for torchft's ``Manager``.

    Every ``configure(store_addr, ...)`` (the ``Manager`` calls it at each new
    quorum, with a new store prefix) aborts the previous group and builds a
    new xcomm group on that store, exactly as ``init_process_group("xcomm")``
    builds one (same plan: shared memory when the replicas share a host).

    Args:
        timeout: How long ``configure`` waits for the store, and the
            collectives' timeout unless ``options.timeout`` is set.
        options: The xcomm options of every group it builds (compression,
            shm, fusion, ...); ``None`` is ``xcomm.Options()``.

    Example::

        >>> from datetime import timedelta
        >>> import xcomm
        >>> from xcomm.torchft import ProcessGroupXcomm
        >>> pg = ProcessGroupXcomm(timeout=timedelta(seconds=5), options=xcomm.Options(shm=False))
        >>> pg.getBackendName()
        'torchft-xcomm'
        >>> pg.configure("localhost:29500/torchft/1/0", "0", rank=0, world_size=2)  # doctest: +SKIP
        >>> t = torch.ones(4)
        >>> pg.allreduce([t], dist.ReduceOp.SUM).wait()  # doctest: +SKIP
    """

    def __init__(
        self,
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        options: Options | None = None,
    ) -> None:
        if options is None:
            options = Options()
        if not isinstance(options, Options):
            raise TypeError(
                f"ProcessGroupXcomm: options must be an xcomm.Options, got {type(options).__name__}"
            )
        super().__init__(timeout=timeout)
        self._options = options
        self._backend: _C.XcommBackend | None = None
        # An abort ends the group before configure() builds the next one: errored()
        # must still say so, as torchft's NCCL wrapper does.
        self._aborted: Exception | None = None
        # The first op error since the group was built (a work's wait() keeps it
        # here instead of raising): also one the backend's state does not show.
        self._op_error: Exception | None = None

    @property
    def options(self) -> Options:
        """The xcomm options every group of this wrapper is built with."""
        return self._options

    @property
    def backend(self) -> _C.XcommBackend | None:
        """The current group's xcomm backend (``plan``, ``get_error()``, ...), or None."""
        return self._backend

    def getBackendName(self) -> str:
        """``"torchft-xcomm"``."""
        return BACKEND_NAME

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        compat.mark_group_made()
        timeout = self._options.timeout or self._timeout
        # Per quorum, like torchft's own wrappers (NCCL takes it as the communicator's name).
        name = f"torchft_quorum_{self._quorum_id}_rank_{self._group_rank or 0}"
        backend = _C.build_group(
            store, rank, world_size, self._options.to_cpp(timeout), _gloo, _nccl_factory(name)
        )
        backend._set_sequence_number_for_group()
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, backend)
        if torch.cuda.is_available():
            pg._register_backend(
                torch.device("cuda"), dist.ProcessGroup.BackendType.CUSTOM, backend
            )
        self._backend = backend
        self._aborted = None
        self._op_error = None
        return pg

    def _wrap_work(self, work: dist.Work, opts: object) -> dist.Work:
        return _TorchftWork(work, self)

    def _report(self, error: Exception) -> None:
        if self._op_error is None:
            self._op_error = error

    def abort(self, errored: bool = True) -> None:
        """Aborts the current group: its pending ops raise within milliseconds.

        Returns at once: xcomm's abort releases the pending ops first, and on
        Gloo's route then waits for the op inside Gloo to end (its peer's
        exit, or the timeout), so it runs on a thread of its own and
        ``configure()`` builds the next group meanwhile. ``errored=False`` is
        torchft's own call before it builds the next group (a planned
        reconfiguration, not an error).
        """
        backend = self._backend
        self._backend = None
        if backend is not None:
            if errored:
                # Before the abort releases the pending ops: their callers may
                # ask errored() at once.
                self._aborted = RuntimeError("xcomm: the torchft process group was aborted")
            threading.Thread(target=backend.abort, name="xcomm-torchft-abort", daemon=True).start()
        # The base class logs the abort and aborts the group it holds: that
        # is the same backend, whose abort is under way.
        self._pg = None
        super().abort(errored=errored)

    def errored(self) -> Exception | None:
        """The group's error, if it has one: an abort, a transport error
        (a dead peer) or a timeout, read from the backend's ``get_error()``."""
        if self._aborted is not None:
            return self._aborted
        if self._op_error is not None:
            return self._op_error
        backend = self._backend
        if backend is None:
            return None
        state = backend.get_error()
        if state.name == "SUCCESS":
            return None
        return RuntimeError(f"xcomm: the torchft process group failed: {state.name}")

    def shutdown(self) -> None:
        """Aborts the current group (torchft's base class only drops it)."""
        self.abort(errored=False)
