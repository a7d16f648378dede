"""Options shared by every test folder (tests/python, tests/clients, tests/gpu,
xcomm_bench/tests).

``--one-case-per-test``: of each parametrized test, run only its first case
(in collection order). ``scripts/test.sh`` gives it on the second torch,
where a test's other cases take our own code down the same torch API the
first case does (routes, ops, codecs, world sizes), which the whole suite
already covers on the first torch. A test whose cases differ in what torch
does (its versions' own features) is marked ``every_case`` and keeps them
all.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--one-case-per-test",
        action="store_true",
        help="run only the first case of each parametrized test (not those marked every_case)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "every_case: --one-case-per-test keeps all of its cases (they differ in what torch does)",
    )


# trylast: after -m and -k have deselected theirs, so a test's first case is
# the first that would run (a case deselected by its mark keeps no other out).
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--one-case-per-test"):
        return
    kept, dropped, seen = [], [], set()
    for item in items:
        # "path::Class::test[case]" -> "path::Class::test": the test its cases share.
        test = item.nodeid.split("[", 1)[0]
        if "[" in item.nodeid and test in seen and item.get_closest_marker("every_case") is None:
            dropped.append(item)
            continue
        seen.add(test)
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
