"""pytest configuration for the tests of the tooling (xcomm_bench).

``xcomm_bench/tests`` is a package, so pytest puts the repository root on
``sys.path`` and ``import xcomm_bench`` works from any directory, with
``pytest`` or ``python -m pytest``. The markers are those of tests/python.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes several seconds (runs by default)")
