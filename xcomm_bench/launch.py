"""Starting benchmark ranks: one entry point, :func:`run_ranks`, for every benchmark.

A rank is a fresh interpreter running one command, usually
``python -m xcomm_bench... --worker`` (:func:`module_command`), that joins its
group with ``init_method="env://"``. :func:`run_ranks` starts ``world_size``
of them either on loopback (``nodes=0``) or as the ranks of an emulated
cluster (``nodes=N``, :mod:`xcomm_bench.cluster`, root), and waits. Each
rank finds ``xcomm_bench`` whatever its working directory: the repository
root goes first on its ``PYTHONPATH`` (:func:`python_env`).

Example::

    >>> from xcomm_bench.launch import module_command, run_ranks
    >>> run_ranks(module_command("xcomm_bench.fusion", "--worker", "/tmp/r.json"), 2)  # doctest: +SKIP
    0
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["REPO", "RankSpawner", "free_port", "module_command", "python_env", "run_ranks"]

#: The repository root, the folder that holds ``xcomm_bench/``.
REPO = Path(__file__).resolve().parents[1]

#: Exit status of :func:`run_ranks` when its timeout killed the ranks.
EXIT_TIMEOUT = 124


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def python_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the repository root
    first on ``PYTHONPATH``, so ``python -m xcomm_bench...`` works in a child."""
    env = dict(os.environ if base is None else base)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *rest])
    return env


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args...`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def _loopback_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The ``env://`` variables of one rank on this host (what the cluster sets per node)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }


def run_ranks(
    command: Sequence[str],
    world_size: int,
    *,
    nodes: int = 0,
    rate: str | int | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    fail_grace_s: float = 30.0,
    cluster_options: Mapping[str, Any] | None = None,
) -> int:
    """Runs ``command`` as each of ``world_size`` ranks and waits for all of them.

    Args:
        command: argv, the same for every rank; ranks tell themselves apart by
            ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_RANK``.
        world_size: Ranks in all.
        nodes: 0 runs them on loopback; N > 0 on N emulated nodes of
            ``world_size // N`` ranks each (needs root).
        rate: Link rate of the emulated nodes (e.g. ``"1gbit"``); ``None`` unshaped.
        env: Extra environment for every rank.
        timeout: Seconds before every rank is killed; ``None`` waits.
        fail_grace_s: Once a rank failed, how long the others may still run
            (they usually wait for it) before they are killed.
        cluster_options: More keyword arguments of
            :class:`~xcomm_bench.cluster.EmulatedCluster` (``latency_ms``, ``mtu``...).

    Returns:
        0 when every rank exited 0; 124 when ``timeout`` killed them; else the
        first rank's non-zero exit status.
    """
    if world_size < 1 or (nodes and world_size % nodes):
        raise ValueError(f"world size {world_size} must be >= 1 and a multiple of nodes {nodes}")
    if nodes:
        return _run_cluster(command, world_size, nodes, rate, env, timeout, cluster_options)
    if rate is not None or cluster_options:
        raise ValueError("a link rate or cluster options need an emulated cluster (nodes > 0)")
    return _run_loopback(command, world_size, env, timeout, fail_grace_s)


def _timed_out(timeout: float | None) -> int:
    print(f"xcomm_bench: ranks still running after {timeout:g}s, killed", file=sys.stderr)
    return EXIT_TIMEOUT


def _run_cluster(
    command: Sequence[str],
    world_size: int,
    nodes: int,
    rate: str | int | None,
    env: Mapping[str, str] | None,
    timeout: float | None,
    cluster_options: Mapping[str, Any] | None,
) -> int:
    from .cluster import ClusterTimeoutError, EmulatedCluster

    # The cluster adds each rank's variables on top of this environment.
    full_env = python_env({**os.environ, **(env or {})})
    with EmulatedCluster(nodes, world_size // nodes, rate, **(cluster_options or {})) as cluster:
        try:
            results = cluster.run(command, env=full_env, timeout=timeout)
        except ClusterTimeoutError:
            return _timed_out(timeout)
    return next((r.returncode for r in results if r.returncode != 0), 0)


def _run_loopback(
    command: Sequence[str],
    world_size: int,
    env: Mapping[str, str] | None,
    timeout: float | None,
    fail_grace_s: float,
) -> int:
    port = free_port()
    base = python_env({**os.environ, **(env or {})})
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world_size):
            rank_env = {**base, **_loopback_env(rank, world_size, port)}
            procs.append(subprocess.Popen(list(command), env=rank_env, stdin=subprocess.DEVNULL))
        deadline = None if timeout is None else time.monotonic() + timeout
        failed_at = None
        while [p.poll() for p in procs].count(None):  # polls every rank
            now = time.monotonic()
            if deadline is not None and now > deadline:
                return _timed_out(timeout)
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now > failed_at + fail_grace_s:
                break  # the others wait for the failed rank: killed below
            time.sleep(0.05)
        # Exit statuses of the ranks that ended on their own, in rank order.
        codes = [p.returncode for p in procs if p.returncode is not None]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return next((c for c in codes if c != 0), 0)


class RankSpawner:
    """Starts ranks one at a time, on loopback or spread over emulated nodes:
    for benchmarks that kill, stop or add ranks themselves (``run_ranks``
    starts a whole group and waits). A context manager; with ``nodes`` it
    holds one :class:`~xcomm_bench.cluster.EmulatedCluster` for all the
    groups it starts.

    Args:
        nodes: 0 for loopback; N > 0 for N emulated nodes (needs root). A
            group of ``world`` ranks puts rank ``r`` on node
            ``r * N // world``, so rank 0 (the store's host) is on node 0.
        rate: Link rate of the emulated nodes (e.g. ``"1gbit"``); ``None`` unshaped.

    Example::

        >>> with RankSpawner(nodes=2, rate="1gbit") as spawner:  # doctest: +SKIP
        ...     port = spawner.new_group()
        ...     procs = [spawner.spawn(r, 4, port, ["python", "-c", "..."]) for r in range(4)]
    """

    def __init__(self, nodes: int = 0, rate: str | int | None = None) -> None:
        if nodes < 0:
            raise ValueError(f"nodes must be >= 0, got {nodes}")
        if not nodes and rate is not None:
            raise ValueError("a link rate needs emulated nodes (nodes > 0)")
        self.nodes = nodes
        self._rate = rate
        self._cluster: Any = None
        # Each group on the cluster gets a port of its own, so a new store
        # never meets the last one's connections in TIME_WAIT.
        self._ports = itertools.count(29500)

    def __enter__(self) -> RankSpawner:  # noqa: PYI034 - typing.Self needs 3.11
        if self.nodes:
            from .cluster import EmulatedCluster

            self._cluster = EmulatedCluster(self.nodes, 1, self._rate)
            self._cluster.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    @property
    def where(self) -> str:
        """In words, for reports: ``"one host (loopback)"`` or the nodes and rate."""
        if not self.nodes:
            return "one host (loopback)"
        rate = "unshaped" if self._rate is None else str(self._rate)
        return f"{self.nodes} emulated nodes ({rate} links)"

    def node_of(self, rank: int, world: int) -> int:
        """The node rank ``rank`` of a ``world``-rank group runs on (0 on loopback)."""
        return rank * self.nodes // world if self.nodes else 0

    def new_group(self) -> int:
        """The ``MASTER_PORT`` of the next group."""
        return next(self._ports) if self.nodes else free_port()

    def env(self, rank: int, world: int, port: int) -> dict[str, str]:
        """The ``env://`` variables of ``rank`` (on top of :func:`python_env`)."""
        if not self.nodes:
            return {**python_env(), **_loopback_env(rank, world, port)}
        cluster = self._cluster
        if cluster is None:
            raise RuntimeError("RankSpawner: enter the `with` block before spawning ranks")
        node = self.node_of(rank, world)
        peers = [r for r in range(world) if self.node_of(r, world) == node]
        return {
            **python_env(),
            "MASTER_ADDR": cluster.master_addr,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(peers.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(peers)),
            **cluster.node_env(node),
        }

    def spawn(
        self, rank: int, world: int, port: int, command: Sequence[str], **popen: Any
    ) -> subprocess.Popen[bytes]:
        """Starts ``command`` as ``rank`` of a ``world``-rank group on ``port``.
        The process's pid is the command's own (``ip netns exec`` execs it),
        so signals sent to it reach the rank. Extra keyword arguments go to
        :class:`subprocess.Popen`."""
        env = self.env(rank, world, port)
        popen.setdefault("stdin", subprocess.DEVNULL)
        if not self.nodes:
            return subprocess.Popen(list(command), env=env, **popen)
        return self._cluster.popen(self.node_of(rank, world), command, env=env, **popen)  # type: ignore[no-any-return]
