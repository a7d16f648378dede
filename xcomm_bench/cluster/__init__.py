"""An emulated multi-node cluster (network namespaces + veth + bridge + tbf) on one box.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN). See :mod:`xcomm_bench.cluster.emulated`
for the topology and ``python -m xcomm_bench.cluster --help`` for the command line.

Example::

    >>> from xcomm_bench.cluster import EmulatedCluster
    >>> with EmulatedCluster(nodes=2, ranks_per_node=2, rate="1gbit") as c:  # doctest: +SKIP
    ...     results = c.run(["python", "train.py"])
"""

from .emulated import (
    DEFAULT_SUBNET,
    ClusterInterrupted,
    ClusterTimeoutError,
    EmulatedCluster,
    NodeInfo,
    RankResult,
    cleanup_stale,
)
from .goodput import GoodputResult, goodput_sweep, measure_goodput
from .netns import ClusterError, ClusterPermissionError, TbfConfig, check_privileges, parse_rate

__all__ = [
    "DEFAULT_SUBNET",
    "ClusterError",
    "ClusterInterrupted",
    "ClusterPermissionError",
    "ClusterTimeoutError",
    "EmulatedCluster",
    "GoodputResult",
    "NodeInfo",
    "RankResult",
    "TbfConfig",
    "check_privileges",
    "cleanup_stale",
    "goodput_sweep",
    "measure_goodput",
    "parse_rate",
]
