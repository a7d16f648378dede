"""Prints the slowest test files of a pytest run, from its JUnit XML report.

    python scripts/test_times.py build/pytest-torch2.13.0.xml [N]

scripts/test.sh prints this after each pytest run, so a CI log shows where
the suite's minutes go (pytest's --durations names single tests only).
"""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET


def seconds_per_file(report: str) -> dict[str, float]:
    """Sums each test file's test times (setup, call and teardown) in ``report``."""
    totals: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("classname", "")
        # "tests.python.test_shm" or "tests.python.test_shm.TestClass"
        parts = [p for p in name.split(".") if not p[:1].isupper()]
        totals["/".join(parts) + ".py"] += float(case.get("time", 0.0))
    return dict(totals)


def main() -> None:
    report = sys.argv[1]
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    totals = seconds_per_file(report)
    print(f"slowest test files ({sum(totals.values()):.0f} s in all):")
    for path, seconds in sorted(totals.items(), key=lambda item: -item[1])[:limit]:
        print(f"  {seconds:7.1f} s  {path}")


if __name__ == "__main__":
    main()
