"""Accuracy check of the emulated links: bulk TCP goodput against the tbf rate.

One TCP stream goes from node ``src`` to node ``dst`` for a few seconds; the
receiver counts payload bytes from the first to the last byte. With the
default tbf settings goodput is expected at ~94-96% of the set rate (TCP/IP
headers alone take ~3% at MTU 1500).

Example::

    >>> from xcomm_bench.cluster import EmulatedCluster
    >>> from xcomm_bench.cluster.goodput import measure_goodput
    >>> with EmulatedCluster(nodes=2, rate="1gbit") as c:  # doctest: +SKIP
    ...     r = measure_goodput(c, seconds=3)
    >>> round(r.ratio, 2)  # doctest: +SKIP
    0.95
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from .emulated import EmulatedCluster
from .netns import ClusterError, format_rate, parse_rate

__all__ = ["GoodputResult", "goodput_sweep", "measure_goodput"]

_ENDPOINT = str(Path(__file__).with_name("_tcp_endpoint.py"))


@dataclasses.dataclass(frozen=True)
class GoodputResult:
    """One bulk-transfer measurement.

    Attributes:
        rate_bps: The link rate set with tbf (0 when unshaped).
        bytes: Payload bytes received.
        seconds: First to last received byte.
    """

    rate_bps: int
    bytes: int
    seconds: float

    @property
    def goodput_bps(self) -> float:
        """Payload bit/s."""
        return 8 * self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def ratio(self) -> float:
        """Goodput as a fraction of the set rate (``nan`` when unshaped)."""
        return self.goodput_bps / self.rate_bps if self.rate_bps else float("nan")

    def __str__(self) -> str:
        return (
            f"set {format_rate(self.rate_bps) if self.rate_bps else 'unshaped'}: "
            f"goodput {format_rate(self.goodput_bps)} ({100 * self.ratio:.1f}%), "
            f"{self.bytes / 1e6:.1f} MB in {self.seconds:.2f} s"
        )


def measure_goodput(
    cluster: EmulatedCluster,
    *,
    src: int = 0,
    dst: int = 1,
    seconds: float = 3.0,
    port: int = 5201,
) -> GoodputResult:
    """Sends one bulk TCP stream from node ``src`` to node ``dst`` of an open cluster.

    Raises:
        ClusterError: an endpoint failed or hung.
    """
    if src == dst:
        raise ValueError("src and dst must be different nodes")
    py = sys.executable
    recv = cluster.popen(
        dst, [py, _ENDPOINT, "recv", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != b"READY":
            why = recv.stderr.read().decode(errors="replace") if recv.stderr else ""
            raise ClusterError(f"goodput receiver failed: {why}")
        addr = cluster.nodes[dst].address
        send = cluster.popen(
            src,
            [py, _ENDPOINT, "send", addr, str(port), str(seconds)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            _, send_err = send.communicate(timeout=seconds + 30)
        except subprocess.TimeoutExpired as e:
            raise ClusterError("goodput sender hung") from e
        finally:
            if send.poll() is None:
                send.kill()
        if send.returncode != 0:
            raise ClusterError(f"goodput sender failed: {send_err.decode(errors='replace')}")
        out, err = recv.communicate(timeout=30)
        if recv.returncode != 0:
            raise ClusterError(f"goodput receiver failed: {err.decode(errors='replace')}")
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    data = json.loads(out.decode().strip().splitlines()[-1])
    return GoodputResult(cluster.rate_bps or 0, int(data["bytes"]), float(data["seconds"]))


def goodput_sweep(
    rates: Iterable[str | float], *, seconds: float = 3.0, repeats: int = 1
) -> list[GoodputResult]:
    """Builds a fresh 2-node cluster per rate and measures node 0 -> node 1.

    Returns:
        ``repeats`` results per rate, in order.
    """
    results = []
    for rate in rates:
        parse_rate(rate)  # fail before building anything
        with EmulatedCluster(nodes=2, rate=rate) as cluster:
            for _ in range(repeats):
                results.append(measure_goodput(cluster, seconds=seconds))
    return results
