"""Starting benchmark ranks on this machine: a free port and a rank's environment.

Example::

    >>> from xcomm.bench.launch import free_port, local_rank_env
    >>> env = local_rank_env(rank=0, world_size=2, port=free_port())
    >>> env["WORLD_SIZE"]
    '2'
"""

from __future__ import annotations

import os
import socket

__all__ = ["free_port", "local_rank_env"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """This process's environment plus the ``env://`` variables of one local rank."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }
