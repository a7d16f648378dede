"""Where torch's Python layer falls short of what xcomm needs.

**Exit.** :func:`release_before_exit` runs at interpreter exit (registered by
:func:`install`); see its docstring.

**Names.** Where torch's Python layer gates a feature on the backend's *name*:

``torch.distributed.monitored_barrier`` raises "only implemented for GLOO
backend" for any group whose backend is not named ``"gloo"``, before the call
reaches the group, although the group's own ``monitored_barrier`` is what it
then calls. xcomm runs Gloo's monitored barrier on each group's Gloo backend,
so :func:`monitored_barrier` does exactly what torch's function does after its
name check, and :func:`install` routes torch's function to it for xcomm groups
(every other group still runs torch's code unchanged). It reroutes torch's
function object itself (its code, not the module attribute), so a reference
taken before ``import xcomm`` (``from torch.distributed import
monitored_barrier``) routes too: the behaviour does not depend on the order
of imports.

Example::

    import xcomm, datetime
    import torch.distributed as dist
    dist.init_process_group("xcomm")
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
"""

from __future__ import annotations

import atexit
import datetime
import inspect
import time
import types
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

BACKEND_NAME = "xcomm"


def monitored_barrier(
    group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta | float | None = None,
    wait_all_ranks: bool = False,
) -> None:
    """Gloo's monitored barrier on an xcomm group: rank 0 fails naming the
    ranks that did not arrive within ``timeout`` (all of them with
    ``wait_all_ranks=True``); the others fail when rank 0 does."""
    if c10d._rank_not_in_group(group):
        return
    pg = c10d._get_default_group() if group is None else group
    if timeout is None:
        timeout = c10d._get_default_timeout(dist.get_backend(pg))
    elif isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    c10d._check_valid_timeout(timeout)
    pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def _is_xcomm(group: dist.ProcessGroup | None) -> bool:
    try:
        return not c10d._rank_not_in_group(group) and dist.get_backend(group) == BACKEND_NAME
    except (RuntimeError, ValueError):  # no default group yet: torch's own error
        return False


#: How long :func:`release_before_exit` lets other threads run.
EXIT_GRACE_S = 0.05
_made_groups = False


def mark_group_made() -> None:
    """Called by xcomm's backend creator: this process made an xcomm group
    (torch forgets its groups on ``destroy_process_group``)."""
    global _made_groups
    _made_groups = True


def release_before_exit() -> None:
    """At interpreter exit, before Python finalizes: lets the communication
    threads drop, with the GIL free, what they still hold.

    A Gloo worker (or one of xcomm's) drops its last reference to a finished
    op's tensors just after the op completes. When the main thread has moved
    on, that tensor's Python object may live only through that reference, so
    the drop takes the GIL; if Python is finalizing by then, CPython ends the
    thread with ``pthread_exit``, whose forced unwind through a C++
    destructor (noexcept) aborts the process: "terminate called without an
    active exception", after every step has finished (seen with plain Gloo
    too; a core showed ``ProcessGroupGloo::runLoop`` -> ``~AsyncAlltoallWork``
    -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``). The window is
    microseconds; a short sleep in an ``atexit`` handler (which runs before
    finalization starts) closes it. Only where xcomm made a group or a
    process group is still live.

    Example::

        >>> release_before_exit()  # no process group in this process: returns at once
    """
    if _made_groups or (dist.is_available() and dist.is_initialized()):
        time.sleep(EXIT_GRACE_S)


#: torch's own ``monitored_barrier`` (a copy of its code), for groups that
#: are not xcomm's; set by :func:`install`.
_torch_monitored_barrier: Any = None


def _dispatch(group: Any, timeout: Any, wait_all_ranks: bool) -> None:
    """What torch's ``monitored_barrier`` runs once :func:`install` rerouted it."""
    if _is_xcomm(group):
        return monitored_barrier(group, timeout, wait_all_ranks)
    return _torch_monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def _routed_code(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    # Only its code is used: it becomes torch's function's code and runs with
    # torch's module globals, so it reaches xcomm through sys.modules alone.
    import sys

    return sys.modules["xcomm.compat"]._dispatch(group, timeout, wait_all_ranks)


def _reroute_torch_function() -> bool:
    """Gives torch's ``monitored_barrier`` function object the code of
    :func:`_routed_code`, keeping a copy of its own code for other groups.
    False (nothing changed) where torch's function is not a plain function
    with the expected parameters."""
    global _torch_monitored_barrier
    target = inspect.unwrap(c10d.monitored_barrier)
    if getattr(target, "_xcomm_routed", False):
        return True
    code = getattr(target, "__code__", None)
    routed = _routed_code.__code__
    if (
        not isinstance(target, types.FunctionType)
        or code is None
        or code.co_freevars
        or code.co_varnames[: code.co_argcount] != routed.co_varnames[: routed.co_argcount]
    ):
        return False
    original = types.FunctionType(
        code, target.__globals__, target.__name__, target.__defaults__, target.__closure__
    )
    original.__kwdefaults__ = target.__kwdefaults__
    original.__doc__ = target.__doc__
    _torch_monitored_barrier = original
    target.__code__ = routed
    target._xcomm_routed = True  # type: ignore[attr-defined]
    return True


def install() -> None:
    """Routes ``dist.monitored_barrier`` on xcomm groups to :func:`monitored_barrier`
    (other groups keep torch's code), for every reference to torch's function,
    however early it was taken, and registers :func:`release_before_exit`
    (idempotent)."""
    global _torch_monitored_barrier
    if getattr(inspect.unwrap(c10d.monitored_barrier), "_xcomm_routed", False):
        return
    if getattr(dist.monitored_barrier, "_xcomm_wrapped", False):
        return
    if not _reroute_torch_function():
        # Fallback for a torch whose function cannot be rerouted: replace the
        # module attribute (references taken before import xcomm keep torch's).
        _torch_monitored_barrier = original = dist.monitored_barrier

        def routed(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
            return _dispatch(group, timeout, wait_all_ranks)

        routed._xcomm_wrapped = True  # type: ignore[attr-defined]
        routed.__doc__ = original.__doc__
        dist.monitored_barrier = routed
        c10d.monitored_barrier = routed
    atexit.register(release_before_exit)
