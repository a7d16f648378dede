"""Registers "xcomm" with torch.distributed (idempotent)."""

from __future__ import annotations

import torch.distributed as dist

BACKEND_NAME = "xcomm"


def register() -> None:
    """Makes ``init_process_group(backend="xcomm")`` available.

    Safe to call any number of times: torch 2.11 to 2.13 assert on a second
    registration, so this registers only once per process. On torch 2.14+ it
    is also the ``torch.distributed.backends`` entry point.
    """
    from .compat import install

    install()  # dist.monitored_barrier on xcomm groups (see compat.py)
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    from .backend import create_backend

    dist.Backend.register_backend(
        BACKEND_NAME, create_backend, extended_api=True, devices=["cpu", "cuda"]
    )
