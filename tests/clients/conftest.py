"""pytest configuration for the client tests (tests/clients).

The clients reuse the multi-process harness of tests/python
(``dist_harness.run_ranks``); this puts tests/python and this folder on
``sys.path`` so both ``dist_harness`` and ``client_common`` import by name
(in pytest and in the rank processes it starts).
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS_DIR = os.path.join(os.path.dirname(HERE), "python")
for _p in (HERE, HARNESS_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes several seconds (runs by default)")
    config.addinivalue_line("markers", "client: runs a third-party client program on two backends")
