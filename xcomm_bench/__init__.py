"""xcomm's benchmarks and emulated cluster (:mod:`xcomm_bench.cluster`), tooling kept
outside the installed ``xcomm`` package. Command line, from the repository root:
``python -m xcomm_bench --help``. Every benchmark starts its ranks through
:func:`xcomm_bench.launch.run_ranks`.

Example::

    >>> from xcomm_bench.collectives import SweepConfig, launch
    >>> launch(SweepConfig(backends=["xcomm", "gloo"], nproc=2, max_bytes=1 << 20))  # doctest: +SKIP
    0
"""

from .collectives import BackendSpec, Measurement, SweepConfig, message_sizes, run_sweep
from .metrics import OPS, algbw, busbw, busbw_factor

__all__ = [
    "OPS",
    "BackendSpec",
    "Measurement",
    "SweepConfig",
    "algbw",
    "busbw",
    "busbw_factor",
    "message_sizes",
    "run_sweep",
]
