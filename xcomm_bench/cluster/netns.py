"""Low-level helpers of the emulated cluster: privileges, rates, ``ip``/``tc`` calls.

Everything here is a thin, typed wrapper over iproute2 (``ip`` and ``tc``);
the topology itself is built by :class:`xcomm_bench.cluster.EmulatedCluster`.

Example::

    >>> from xcomm_bench.cluster.netns import parse_rate, TbfConfig
    >>> parse_rate("1gbit")
    1000000000
    >>> TbfConfig.for_rate(parse_rate("1gbit")).burst_bytes
    125000
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

__all__ = [
    "MAX_RATE_BPS",
    "MIN_RATE_BPS",
    "ClusterError",
    "ClusterPermissionError",
    "TbfConfig",
    "check_privileges",
    "delete_netns",
    "effective_capabilities",
    "format_rate",
    "ip",
    "kill_netns_processes",
    "list_netns",
    "netns_pids",
    "parse_rate",
    "tc",
]

#: Slowest rate the emulation supports (0.1 Gbit/s), in bit/s.
MIN_RATE_BPS: int = 100_000_000
#: Fastest rate the emulation supports (10 Gbit/s), in bit/s. Above a few
#: Gbit/s a 2-core box measures its CPU rather than the shaped link.
MAX_RATE_BPS: int = 10_000_000_000

_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21

_RATE_UNITS: dict[str, int] = {
    "": 1,
    "bit": 1,
    "kbit": 1_000,
    "mbit": 1_000_000,
    "gbit": 1_000_000_000,
}
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class ClusterError(RuntimeError):
    """A step of building, running or tearing down the emulated cluster failed."""


class ClusterPermissionError(PermissionError):
    """The process lacks the privileges to build network namespaces."""


def effective_capabilities() -> int:
    """Returns this process's effective capability bitmask (``CapEff`` in /proc)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_privileges(capabilities: int | None = None) -> None:
    """Raises :class:`ClusterPermissionError` unless namespaces can be built.

    Creating named network namespaces needs CAP_SYS_ADMIN (``ip netns add``
    bind-mounts them under /run/netns); veth pairs, bridges and qdiscs need
    CAP_NET_ADMIN. Root normally has both. Also checks that ``ip`` and ``tc``
    exist.

    Args:
        capabilities: The effective capability mask to judge; by default this
            process's own (tests pass 0 to simulate an unprivileged user).
    """
    caps = effective_capabilities() if capabilities is None else capabilities
    missing = [
        name
        for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"), (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
        if not caps & (1 << bit)
    ]
    if missing:
        raise ClusterPermissionError(
            "xcomm_bench.cluster needs root (precisely CAP_NET_ADMIN and CAP_SYS_ADMIN) to create "
            "network namespaces, veth pairs, a bridge and tbf qdiscs; this process "
            f"(euid {os.geteuid()}) lacks {' and '.join(missing)}. Run it as root, "
            "e.g. `sudo -E python -m xcomm_bench.cluster run ...`."
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(
                f"xcomm_bench.cluster needs iproute2's `{tool}` on PATH; it was not found"
            )


def parse_rate(rate: str | float) -> int:
    """Parses a link rate into bit/s and checks it is in the supported range.

    Accepts tc-style SI units (``"100mbit"``, ``"2.5gbit"``, ``"1e9bit"``) or a
    plain number of bit/s. Bytes-per-second units (tc's ``bps``) are refused
    on purpose, because they are a classic factor-8 mistake.

    Raises:
        ValueError: unknown unit, or outside 0.1 to 10 Gbit/s.
    """
    if isinstance(rate, (int, float)):
        bps = float(rate)
    else:
        m = _RATE_RE.match(rate)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _RATE_UNITS:
            raise ValueError(
                f"cannot parse rate {rate!r}: use a number with one of the units "
                "bit, kbit, mbit, gbit (decimal, bits per second), e.g. '1gbit' or '500mbit'"
            )
        bps = float(m.group(1)) * _RATE_UNITS[unit]
    bits = round(bps)
    if not MIN_RATE_BPS <= bits <= MAX_RATE_BPS:
        raise ValueError(
            f"rate {format_rate(bits)} is outside the supported 0.1-10 Gbit/s "
            "(tbf on veth is accurate there; below it bursts dominate, above it the CPU does)"
        )
    return bits


def format_rate(bps: float) -> str:
    """Formats bit/s for humans: ``format_rate(2.5e9) == '2.5 Gbit/s'``."""
    for div, unit in ((1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bps >= div:
            return f"{bps / div:g} {unit}"
    return f"{bps:g} bit/s"


@dataclasses.dataclass(frozen=True)
class TbfConfig:
    """Parameters of one token-bucket-filter qdisc (``tc qdisc ... tbf``).

    Attributes:
        rate_bps: Long-run rate, bit/s.
        burst_bytes: Bucket size. It must hold at least one MTU-sized packet;
            veth's GSO super-packets larger than it are segmented by tbf, so
            it does not have to hold 64 KiB. Larger buckets let short transfers
            (small collectives) run faster than the rate.
        latency_ms: How long a packet may wait in the queue; tbf sizes the
            queue as rate x latency + burst. Short queues mean loss and TCP
            back-off at low rates, long ones add bufferbloat to small messages.
    """

    rate_bps: int
    burst_bytes: int
    latency_ms: float

    @classmethod
    def for_rate(
        cls, rate_bps: int, *, burst_bytes: int | None = None, latency_ms: float | None = None
    ) -> TbfConfig:
        """Defaults: latency 10 ms; burst 1 ms of traffic up to 1 Gbit/s, rising
        linearly to 4 ms at 4 Gbit/s and above, and at least 32 KiB.

        The bucket must outlast the qdisc's wake-up delay, which grows with
        the CPU load a fast link causes on a small VM: with a 1 ms bucket,
        goodput here fell to ~88% at 5 Gbit/s and ~80% at 10 Gbit/s, with 4 ms
        it stays at ~95%. Below 1 Gbit/s, 1 ms is enough, and a small bucket
        keeps short transfers (a small collective after idle time) from
        running much faster than the rate: a transfer shorter than ``burst``
        goes at veth speed.

        ==========  ===========  =====================
        rate        burst        queue (latency 10 ms)
        ==========  ===========  =====================
        0.1 Gbit/s  32 KiB       ~158 KB
        1 Gbit/s    125 kB       ~1.4 MB
        2.5 Gbit/s  ~781 kB      ~3.9 MB
        10 Gbit/s   5 MB         ~17.5 MB
        ==========  ===========  =====================
        """
        if burst_bytes is None:
            burst_ms = min(4.0, max(1.0, rate_bps / 1e9))
            burst_bytes = max(32 * 1024, int(rate_bps / 8 * burst_ms / 1000))
        if latency_ms is None:
            latency_ms = 10.0
        if burst_bytes < 2048:
            raise ValueError(
                f"tbf burst must hold a full-size packet (>= 2048 bytes), got {burst_bytes}"
            )
        if latency_ms <= 0:
            raise ValueError(f"tbf latency must be positive, got {latency_ms} ms")
        return cls(rate_bps=rate_bps, burst_bytes=burst_bytes, latency_ms=latency_ms)

    def tc_args(self) -> list[str]:
        """The ``tbf ...`` part of a ``tc qdisc replace`` command line."""
        return [
            "tbf",
            "rate",
            f"{self.rate_bps}bit",
            "burst",
            str(self.burst_bytes),
            "latency",
            f"{self.latency_ms:g}ms",
        ]


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> str:
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"`{' '.join(argv)}` timed out after {timeout:g}s") from e
    if check and proc.returncode != 0:
        raise ClusterError(
            f"`{' '.join(argv)}` failed with exit code {proc.returncode}: {proc.stderr.strip()}"
        )
    return proc.stdout


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    """Runs ``ip [-n NETNS] ARGS...`` and returns its stdout.

    Raises:
        ClusterError: the command failed (and ``check`` is true).
    """
    ns = ["-n", netns] if netns else []
    return _run(["ip", *ns, *args], check=check)


def tc(*args: str, netns: str | None = None, check: bool = True) -> str:
    """Runs ``tc [-n NETNS] ARGS...`` and returns its stdout."""
    ns = ["-n", netns] if netns else []
    return _run(["tc", *ns, *args], check=check)


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    """PIDs of the processes living in a named namespace (``ip netns pids``)."""
    out = _run(["ip", "netns", "pids", netns], check=False)
    return [int(tok) for tok in out.split() if tok.isdigit()]


def kill_netns_processes(netns: str, *, grace_s: float = 2.0) -> None:
    """SIGTERMs, then after ``grace_s`` SIGKILLs, every process in ``netns``."""
    pids = netns_pids(netns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            pids = netns_pids(netns)
            if not pids:
                return
            time.sleep(0.05)


def delete_netns(netns: str) -> None:
    """Kills the processes in ``netns`` and deletes it, with its links and qdiscs.

    Deleting a namespace destroys the veth ends inside it, which destroys their
    peers too, and every qdisc goes with its device. A missing namespace is not
    an error.

    Raises:
        ClusterError: the namespace still exists afterwards.
    """
    if netns not in list_netns():
        return
    kill_netns_processes(netns)
    _run(["ip", "netns", "delete", netns], check=False)
    if netns in list_netns():
        raise ClusterError(f"could not delete network namespace {netns!r}")
