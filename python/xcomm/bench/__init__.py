"""xcomm's benchmarks. Command line: ``python -m xcomm.bench --help``.

Example::

    >>> from xcomm.bench import SweepConfig, launch
    >>> launch(SweepConfig(backends=["xcomm", "gloo"], nproc=2, max_bytes=1 << 20))  # doctest: +SKIP
    0
"""

from .collectives import BackendSpec, Measurement, SweepConfig, launch, message_sizes, run_sweep
from .metrics import OPS, algbw, busbw, busbw_factor

__all__ = [
    "OPS",
    "BackendSpec",
    "Measurement",
    "SweepConfig",
    "algbw",
    "busbw",
    "busbw_factor",
    "launch",
    "message_sizes",
    "run_sweep",
]
