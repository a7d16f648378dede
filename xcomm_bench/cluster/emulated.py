"""An emulated multi-node cluster on one Linux box: namespaces, veth, bridge, tbf.

Topology for ``EmulatedCluster(nodes=N, rate="1gbit")`` (``P`` is the per-run
prefix, ``xc<pid>-<seq>``)::

    netns P-br:   br0 ── veth-p0 ── veth-p1 ── ... (bridge ports, tbf = node i's downlink)
                            │          │
    netns P-n0:   veth-n0 198.18.0.1/24 (tbf = node 0's uplink), lo
    netns P-n1:   veth-n1 198.18.0.2/24 (tbf = node 1's uplink), lo
    ...

Nothing is created in the root namespace, so the host's interfaces and routes
are never touched; every link is created straight inside its namespace and
198.18.0.0/24 (RFC 2544's benchmarking range) exists only in them. Each node's
NIC is shaped in both directions by a tbf qdisc: on its veth end (egress) and
on its bridge port (the traffic the bridge sends to it). Ranks on the same
node talk to each other through the node's own address, which the kernel
routes over the namespace's loopback, unshaped, like a real host.

Teardown (namespace deletion, which removes links and qdiscs with it) runs on
``close()``, at the end of a ``with`` block whatever ends it, on SIGTERM/SIGHUP
(converted to :class:`ClusterInterrupted` while a cluster is open in the main
thread), on Ctrl-C (``KeyboardInterrupt``) and, as a last resort, at
interpreter exit. Only SIGKILL escapes it: ``python -m xcomm_bench.cluster cleanup``
removes what a killed run left behind.

Example::

    >>> from xcomm_bench.cluster import EmulatedCluster
    >>> with EmulatedCluster(nodes=2, ranks_per_node=1, rate="1gbit") as c:  # doctest: +SKIP
    ...     results = c.run(["python", "train.py"], timeout=600)
    >>> [r.returncode for r in results]  # doctest: +SKIP
    [0, 0]
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import ipaddress
import itertools
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import types
import weakref
from collections.abc import Mapping, Sequence
from typing import IO

from .netns import (
    ClusterError,
    TbfConfig,
    check_privileges,
    delete_netns,
    ip,
    list_netns,
    parse_rate,
    tc,
)

__all__ = [
    "DEFAULT_SUBNET",
    "ClusterInterrupted",
    "ClusterTimeoutError",
    "EmulatedCluster",
    "NodeInfo",
    "RankResult",
    "cleanup_stale",
]

#: Private subnet of the emulated nodes (RFC 2544 benchmarking range). It only
#: exists inside the cluster's namespaces.
DEFAULT_SUBNET = "198.18.0.0/24"

_PREFIX_RE = re.compile(r"^xc(\d+)-(\d+)-")
_SEQ = itertools.count()
_LIVE: weakref.WeakSet[EmulatedCluster] = weakref.WeakSet()
_TEARDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ClusterInterrupted(BaseException):
    """SIGTERM or SIGHUP arrived while a cluster was open (raised in the main thread)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """One emulated node.

    Attributes:
        index: Node rank, 0-based.
        netns: Name of its network namespace.
        ifname: Its veth interface (what ``GLOO_SOCKET_IFNAME`` is set to).
        address: Its IPv4 address in the private subnet.
        bridge_port: The veth peer on the bridge, in the bridge's namespace.
    """

    index: int
    netns: str
    ifname: str
    address: str
    bridge_port: str


@dataclasses.dataclass(frozen=True)
class RankResult:
    """Outcome of one rank of :meth:`EmulatedCluster.run`.

    Attributes:
        rank: Global rank.
        node: Node index.
        local_rank: Rank within the node.
        returncode: Exit status; negative for a signal (like ``subprocess``).
        stdout: Captured standard output (``""`` unless ``capture=True``).
        stderr: Captured standard error (``""`` unless ``capture=True``).
        duration_s: Wall-clock time from start to exit.
    """

    rank: int
    node: int
    local_rank: int
    returncode: int
    stdout: str
    stderr: str
    duration_s: float


class ClusterTimeoutError(ClusterError):
    """A run exceeded its timeout; its ranks were killed.

    Attributes:
        results: What the ranks returned (killed ones have a negative code).
    """

    def __init__(self, message: str, results: list[RankResult]) -> None:
        super().__init__(message)
        self.results = results


@dataclasses.dataclass
class _Proc:
    rank: int
    node: int
    local_rank: int
    popen: subprocess.Popen[bytes]
    started: float
    out: IO[bytes] | None
    err: IO[bytes] | None
    ended: float | None = None


class EmulatedCluster:
    """N emulated nodes joined by a shaped bridge; a context manager.

    Args:
        nodes: Number of nodes (network namespaces), >= 1.
        ranks_per_node: Processes :meth:`run` starts on each node.
        rate: Per-node link rate in each direction (``"1gbit"``, bit/s as a
            number), 0.1-10 Gbit/s; ``None`` for an unshaped link.
        burst_bytes: tbf bucket size; default 1 ms of traffic, >= 32 KiB.
        latency_ms: tbf queueing limit; default 10 ms.
        mtu: MTU of every node's link (68-65535); default the kernel's 1500.
            Jumbo frames cut the number of packets the kernel handles, and so
            the CPU the emulated network takes from the ranks on a small host.
        master_port: ``MASTER_PORT`` given to the ranks (each namespace has
            its own port space, so a fixed port is safe).
        subnet: IPv4 subnet of the nodes (only exists in the namespaces).
        prefix: Name prefix of the namespaces; default ``xc<pid>-<seq>``.
        handle_signals: Turn SIGTERM/SIGHUP into :class:`ClusterInterrupted`
            while the cluster is open (only possible in the main thread).

    Raises:
        ClusterPermissionError: not root / lacking CAP_NET_ADMIN+CAP_SYS_ADMIN
            (raised by :meth:`start`, i.e. on entering the ``with`` block).
        ValueError: bad sizes or rate.

    Example::

        >>> with EmulatedCluster(nodes=2, rate="500mbit") as c:  # doctest: +SKIP
        ...     print(c.nodes[0].address, c.nodes[0].ifname)
        ...     out = c.run(["sh", "-c", "echo $RANK of $WORLD_SIZE"], capture=True)
        198.18.0.1 veth-n0
    """

    def __init__(
        self,
        nodes: int,
        ranks_per_node: int = 1,
        rate: str | float | None = None,
        *,
        burst_bytes: int | None = None,
        latency_ms: float | None = None,
        mtu: int | None = None,
        master_port: int = 29500,
        subnet: str = DEFAULT_SUBNET,
        prefix: str | None = None,
        handle_signals: bool = True,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        net = ipaddress.IPv4Network(subnet)
        if net.num_addresses - 2 < nodes:
            raise ValueError(f"subnet {subnet} has no room for {nodes} nodes")
        self.num_nodes = nodes
        self.ranks_per_node = ranks_per_node
        if mtu is not None and not 68 <= mtu <= 65535:
            raise ValueError(f"mtu must be in 68..65535, got {mtu}")
        self.mtu = mtu
        self.rate_bps: int | None = None if rate is None else parse_rate(rate)
        if mtu is not None and burst_bytes is None and self.rate_bps is not None:
            # tbf drops every packet larger than its bucket: hold two frames
            default = TbfConfig.for_rate(self.rate_bps, latency_ms=latency_ms).burst_bytes
            burst_bytes = max(default, 2 * (mtu + 64))
        self.tbf: TbfConfig | None = (
            None
            if self.rate_bps is None
            else TbfConfig.for_rate(self.rate_bps, burst_bytes=burst_bytes, latency_ms=latency_ms)
        )
        self.master_port = master_port
        self.prefix = prefix or f"xc{os.getpid()}-{next(_SEQ)}"
        self.bridge_netns = f"{self.prefix}-br"
        hosts = list(itertools.islice(net.hosts(), nodes))
        self.nodes: list[NodeInfo] = [
            NodeInfo(
                index=i,
                netns=f"{self.prefix}-n{i}",
                ifname=f"veth-n{i}",
                address=str(hosts[i]),
                bridge_port=f"veth-p{i}",
            )
            for i in range(nodes)
        ]
        self._prefixlen = net.prefixlen
        self._handle_signals = handle_signals
        self._created: list[str] = []
        self._procs: list[_Proc] = []
        self._old_handlers: dict[int, object] = {}
        self._started = False
        self._closed = False
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ life cycle

    @property
    def world_size(self) -> int:
        """Total number of ranks :meth:`run` starts."""
        return self.num_nodes * self.ranks_per_node

    @property
    def master_addr(self) -> str:
        """Node 0's address (``MASTER_ADDR``)."""
        return self.nodes[0].address

    def __enter__(self) -> EmulatedCluster:  # noqa: PYI034 - typing.Self needs 3.11
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Builds the namespaces, links and qdiscs; tears down what it built on failure.

        Raises:
            ClusterPermissionError: lacking privileges.
            ClusterError: an ``ip``/``tc`` command failed.
        """
        if self._started:
            raise ClusterError("this EmulatedCluster was already started; create a new one")
        check_privileges()
        self._started = True
        _LIVE.add(self)
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kills remaining ranks and deletes every namespace (idempotent).

        Signals are blocked while it runs, so a second Ctrl-C cannot cut the
        teardown short; they are delivered once it is done.

        Raises:
            ClusterError: some namespace could not be deleted (all are tried).
        """
        with self._lock:
            if self._closed or not self._started:
                return
            self._closed = True
        blocked = _block_signals()
        errors: list[str] = []
        try:
            self._kill_procs()
            for name in reversed(self._created):
                try:
                    delete_netns(name)
                except ClusterError as e:
                    errors.append(str(e))
            self._created.clear()
        finally:
            _LIVE.discard(self)
            self._restore_signal_handlers()
            _unblock_signals(blocked)
        if errors:
            raise ClusterError("teardown incomplete: " + "; ".join(errors))

    def _build(self) -> None:
        for name in [self.bridge_netns, *(n.netns for n in self.nodes)]:
            if name in list_netns():
                raise ClusterError(f"network namespace {name!r} already exists")
            self._created.append(name)  # first: an interrupted add is still torn down
            ip("netns", "add", name)
            _disable_ipv6(name)
            ip("link", "set", "lo", "up", netns=name)
        br = self.bridge_netns
        ip("link", "add", "br0", "type", "bridge", netns=br)
        ip("link", "set", "br0", "up", netns=br)
        for n in self.nodes:
            # Created inside the bridge's namespace with its peer placed straight
            # into the node's: no link ever exists in the root namespace.
            veth = ["link", "add", n.bridge_port, "type", "veth"]
            ip(*veth, "peer", "name", n.ifname, "netns", n.netns, netns=br)
            if self.mtu is not None:
                ip("link", "set", n.bridge_port, "mtu", str(self.mtu), netns=br)
                ip("link", "set", n.ifname, "mtu", str(self.mtu), netns=n.netns)
            ip("link", "set", n.bridge_port, "master", "br0", "up", netns=br)
            ip("addr", "add", f"{n.address}/{self._prefixlen}", "dev", n.ifname, netns=n.netns)
            ip("link", "set", n.ifname, "up", netns=n.netns)
            if self.tbf is not None:
                tc("qdisc", "replace", "dev", n.ifname, "root", *self.tbf.tc_args(), netns=n.netns)
                tc("qdisc", "replace", "dev", n.bridge_port, "root", *self.tbf.tc_args(), netns=br)
        self._wait_links_up()

    def set_rate(self, rate: str | float) -> None:
        """Changes every link's rate while ranks run (``tc qdisc replace``):
        a link that slows down or speeds up mid-run."""
        self._check_open()
        self.rate_bps = parse_rate(rate)
        self.tbf = TbfConfig.for_rate(self.rate_bps)
        for n in self.nodes:
            tc("qdisc", "replace", "dev", n.ifname, "root", *self.tbf.tc_args(), netns=n.netns)
            tc("qdisc", "replace", "dev", n.bridge_port, "root", *self.tbf.tc_args(),
               netns=self.bridge_netns)  # fmt: skip

    def _wait_links_up(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        for n in self.nodes:
            while "LOWER_UP" not in ip("-br", "link", "show", "dev", n.ifname, netns=n.netns):
                if time.monotonic() > deadline:
                    raise ClusterError(f"link {n.ifname} in {n.netns} did not come up")
                time.sleep(0.02)

    # ------------------------------------------------------------------ running

    def rank_env(self, rank: int) -> dict[str, str]:
        """The variables :meth:`run` adds to the environment of ``rank``.

        ``MASTER_ADDR`` (node 0's address), ``MASTER_PORT``, ``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``,
        ``GLOO_SOCKET_IFNAME`` (the node's veth), plus ``XCOMM_CLUSTER_NODE_ADDR``
        and ``XCOMM_CLUSTER_RATE_BPS`` (``0`` when unshaped) for tools.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            **self.node_env(rank // self.ranks_per_node),
        }

    def node_env(self, node: int) -> dict[str, str]:
        """What every process on ``node`` needs, whatever its rank:
        ``NODE_RANK``, ``GLOO_SOCKET_IFNAME`` (the node's veth),
        ``XCOMM_CLUSTER_NODE_ADDR`` and ``XCOMM_CLUSTER_RATE_BPS`` (``0`` when
        unshaped)."""
        n = self.nodes[node]
        return {
            "NODE_RANK": str(n.index),
            "GLOO_SOCKET_IFNAME": n.ifname,
            "XCOMM_CLUSTER_NODE_ADDR": n.address,
            "XCOMM_CLUSTER_RATE_BPS": str(self.rate_bps or 0),
        }

    def popen(
        self,
        node: int,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """Starts one command inside ``node``'s namespace, in a new session.

        The process is killed by :meth:`close` if still running then. Extra
        keyword arguments go to :class:`subprocess.Popen`.
        """
        self._check_open()
        n = self.nodes[node]
        full_env = dict(os.environ if env is None else env)
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
            ["ip", "netns", "exec", n.netns, *command],
            env=full_env,
            cwd=cwd,
            start_new_session=True,
            **kwargs,
        )

    def run(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        capture: bool = False,
        fail_grace_s: float | None = 30.0,
    ) -> list[RankResult]:
        """Runs ``command`` as every rank (nodes x ranks_per_node processes) and waits.

        Args:
            command: argv, the same for all ranks; they tell themselves apart
                by the environment (see :meth:`rank_env`).
            env: Extra environment for all ranks, on top of this process's.
            cwd: Working directory of the ranks.
            timeout: Seconds before all ranks are killed and
                :class:`ClusterTimeoutError` is raised; ``None`` waits forever.
            capture: Capture stdout/stderr into the results instead of
                letting the ranks write to this process's terminal.
            fail_grace_s: Once a rank fails, how long the others may still run
                before they are killed (they usually hang waiting for it);
                ``None`` waits for them.

        Returns:
            One :class:`RankResult` per rank, ordered by rank.
        """
        self._check_open()
        if not command:
            raise ValueError("command is empty")
        procs: list[_Proc] = []
        with self._lock:
            for rank in range(self.world_size):
                rank_env = {**os.environ, **(env or {}), **self.rank_env(rank)}
                # Closed by _result() once the rank has exited.
                out = tempfile.TemporaryFile() if capture else None  # noqa: SIM115
                err = tempfile.TemporaryFile() if capture else None  # noqa: SIM115
                popen = self.popen(
                    rank // self.ranks_per_node,
                    command,
                    env=rank_env,
                    cwd=cwd,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                )
                p = _Proc(
                    rank,
                    rank // self.ranks_per_node,
                    rank % self.ranks_per_node,
                    popen,
                    time.monotonic(),
                    out,
                    err,
                )
                procs.append(p)
                self._procs.append(p)
        try:
            timed_out = self._wait(procs, timeout, fail_grace_s)
            results = [self._result(p) for p in procs]
        finally:
            _kill_group([p.popen for p in procs])
            with self._lock:
                self._procs = [p for p in self._procs if p not in procs]
        if timed_out:
            raise ClusterTimeoutError(
                f"ranks still running after {timeout:g}s were killed", results
            )
        return results

    def _wait(self, procs: list[_Proc], timeout: float | None, fail_grace_s: float | None) -> bool:
        start = time.monotonic()
        first_failure: float | None = None
        while True:
            now = time.monotonic()
            running = 0
            for p in procs:
                if p.ended is None and p.popen.poll() is not None:
                    p.ended = now
                if p.ended is None:
                    running += 1
                elif p.popen.returncode != 0 and first_failure is None:
                    first_failure = now
            if running == 0:
                return False
            if timeout is not None and now - start > timeout:
                _kill_group([p.popen for p in procs])
                return True
            if (
                first_failure is not None
                and fail_grace_s is not None
                and now - first_failure > fail_grace_s
            ):
                _kill_group([p.popen for p in procs])
                fail_grace_s = None  # the kill is done; now just reap
            time.sleep(0.05)

    @staticmethod
    def _result(p: _Proc) -> RankResult:
        rc = p.popen.wait()
        texts = []
        for f in (p.out, p.err):
            if f is None:
                texts.append("")
                continue
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
            f.close()
        ended = p.ended if p.ended is not None else time.monotonic()
        return RankResult(p.rank, p.node, p.local_rank, rc, texts[0], texts[1], ended - p.started)

    def _kill_procs(self) -> None:
        with self._lock:
            procs = list(self._procs)
            self._procs.clear()
        _kill_group([p.popen for p in procs])

    def _check_open(self) -> None:
        if not self._started or self._closed:
            raise ClusterError(
                "the cluster is not running: use it inside `with EmulatedCluster(...)`"
            )

    # ------------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: types.FrameType | None) -> None:
            raise ClusterInterrupted(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError, OSError):
                self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, old)  # type: ignore[arg-type]
        self._old_handlers.clear()


def _kill_group(popens: Sequence[subprocess.Popen[bytes]], grace_s: float = 2.0) -> None:
    """SIGTERM each process's session, SIGKILL what is left after ``grace_s``."""
    live = [p for p in popens if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace_s
        while live and time.monotonic() < deadline:
            live = [p for p in live if p.poll() is None]
            time.sleep(0.02)
        if not live:
            break
    for p in popens:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)
        # Grandchildren in the session that outlived the leader.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


def _disable_ipv6(netns: str) -> None:
    """Keeps interfaces IPv4-only so Gloo cannot pick a link-local IPv6 address."""
    subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            netns,
            "sysctl",
            "-q",
            "-w",
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
        ],
        capture_output=True,
        check=False,
    )


def _block_signals() -> set[int]:
    if threading.current_thread() is not threading.main_thread():
        return set()
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, _TEARDOWN_SIGNALS))


def _unblock_signals(previous: set[int]) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def cleanup_stale(*, include_live: bool = False) -> list[str]:
    """Deletes namespaces left by emulated clusters whose process has died.

    Runs killed by SIGKILL cannot tear down; their namespaces are named
    ``xc<pid>-<seq>-*``. This removes those whose ``<pid>`` no longer exists
    (all of them with ``include_live=True``).

    Returns:
        The names of the namespaces deleted.
    """
    removed = []
    for name in list_netns():
        m = _PREFIX_RE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        alive = pid == os.getpid() or _pid_alive(pid)
        if alive and not include_live:
            continue
        delete_netns(name)
        removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _teardown_at_exit() -> None:
    for cluster in list(_LIVE):
        with contextlib.suppress(Exception):
            cluster.close()
