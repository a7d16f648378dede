"""Where torch's Python layer gates a feature on the backend's *name*.

``torch.distributed.monitored_barrier`` raises "only implemented for GLOO
backend" for any group whose backend is not named ``"gloo"``, before the call
reaches the group, although the group's own ``monitored_barrier`` is what it
then calls. xcomm runs Gloo's monitored barrier on each group's Gloo backend,
so :func:`monitored_barrier` does exactly what torch's function does after its
name check, and :func:`install` points ``dist.monitored_barrier`` at it for
xcomm groups (every other group still goes to torch's function unchanged).

Example::

    import xcomm, datetime
    import torch.distributed as dist
    dist.init_process_group("xcomm")
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
"""

from __future__ import annotations

import datetime
import functools
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


def install() -> None:
    """Routes ``dist.monitored_barrier`` on xcomm groups to :func:`monitored_barrier`
    (idempotent; other groups keep torch's function)."""
    original = dist.monitored_barrier
    if getattr(original, "_xcomm_wrapped", False):
        return

    @functools.wraps(original)
    def routed(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        if _is_xcomm(group):
            return monitored_barrier(group, timeout, wait_all_ranks)
        return original(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)

    routed._xcomm_wrapped = True  # type: ignore[attr-defined]
    dist.monitored_barrier = routed
    c10d.monitored_barrier = routed
