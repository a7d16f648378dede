"""pytest configuration for the xcomm Python test suite.

* ``XCOMM_TEST_BACKEND`` selects the backend under test (default ``xcomm``;
  ``gloo`` to develop the suite before xcomm is built: every comparison is then
  gloo against gloo and must pass, except assertions marked xcomm-specific).
* ``XCOMM_TEST_RUN_TIMEOUT`` (default 60 s) is the hard limit of one
  multi-process run; ``XCOMM_TEST_PG_TIMEOUT`` (default 40 s) the process
  group timeout inside ranks.
* Markers (all tests run by default): ``large_world`` for world sizes > 2,
  ``slow`` for tests that take several seconds (fresh interpreters, DDP
  training, fault injection).  ``-m 'not large_world and not slow'`` gives a
  quick pass.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import dist_harness  # after HERE is on sys.path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "large_world: spawns more than 2 ranks (runs by default)")
    config.addinivalue_line("markers", "slow: takes several seconds (runs by default)")
    config.addinivalue_line(
        "markers", "xcomm_specific: asserts xcomm's own behaviour (messages); may fail against gloo"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"xcomm tests: backend under test = {dist_harness.BACKEND!r} "
        f"(XCOMM_TEST_BACKEND), run timeout = {dist_harness.DEFAULT_RUN_TIMEOUT:.0f}s"
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fail fast, with one clear message, if the backend cannot be imported."""
    if dist_harness.BACKEND != "xcomm":
        return
    try:
        import xcomm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.exit(
            f"cannot import xcomm ({type(e).__name__}: {e}). Build/install the package, "
            "or run the suite against gloo with XCOMM_TEST_BACKEND=gloo.",
            returncode=1,
        )
