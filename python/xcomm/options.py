"""Options of an xcomm process group."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

__all__ = ["Options"]


@dataclass(frozen=True)
class Options:
    """Settings of one xcomm process group, passed as ``pg_options``.

    Attributes:
        timeout: How long a collective may wait for its peers before it fails.
            ``None`` uses the ``timeout`` given to ``init_process_group`` /
            ``new_group`` (30 minutes unless set). When both are given, this
            one wins.
        shm: Run CPU collectives through shared memory when every rank of
            the group is on one host (see ``xcomm.shm``). ``False``, or the
            environment variable ``XCOMM_SHM=0``, keeps them on Gloo.

    Example::

        >>> import datetime, xcomm
        >>> import torch.distributed as dist
        >>> dist.init_process_group(  # doctest: +SKIP
        ...     "xcomm", pg_options=xcomm.Options(timeout=datetime.timedelta(seconds=30)))
    """

    timeout: datetime.timedelta | None = None
    shm: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.shm, bool):
            raise TypeError(f"xcomm.Options: shm must be a bool, got {type(self.shm).__name__}")
        if self.timeout is not None:
            if not isinstance(self.timeout, datetime.timedelta):
                raise TypeError(
                    f"xcomm.Options: timeout must be a datetime.timedelta, got {type(self.timeout).__name__}"
                )
            if self.timeout <= datetime.timedelta(0):
                raise ValueError(f"xcomm.Options: timeout must be positive, got {self.timeout}")
