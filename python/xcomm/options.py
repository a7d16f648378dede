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
        fusion_threshold_bytes: When > 0, small async CPU allreduces issued
            back to back are held and sent as one flat allreduce of up to this
            many bytes (Horovod-style tensor fusion; identical results). Held
            ops go out when the next would pass the threshold, when any other
            op is issued, or as soon as any held op's result is asked for
            (``wait()``, ``get_future()``, ``is_completed()``). 0 (default): off.

    Example::

        >>> import datetime, xcomm
        >>> import torch.distributed as dist
        >>> dist.init_process_group(  # doctest: +SKIP
        ...     "xcomm", pg_options=xcomm.Options(timeout=datetime.timedelta(seconds=30)))
    """

    timeout: datetime.timedelta | None = None
    fusion_threshold_bytes: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.fusion_threshold_bytes, bool) or not isinstance(
            self.fusion_threshold_bytes, int
        ):
            raise TypeError(
                "xcomm.Options: fusion_threshold_bytes must be an int, got "
                f"{type(self.fusion_threshold_bytes).__name__}"
            )
        if self.fusion_threshold_bytes < 0:
            raise ValueError(
                f"xcomm.Options: fusion_threshold_bytes must be >= 0, got {self.fusion_threshold_bytes}"
            )
        if self.timeout is not None:
            if not isinstance(self.timeout, datetime.timedelta):
                raise TypeError(
                    f"xcomm.Options: timeout must be a datetime.timedelta, got {type(self.timeout).__name__}"
                )
            if self.timeout <= datetime.timedelta(0):
                raise ValueError(f"xcomm.Options: timeout must be positive, got {self.timeout}")
