"""xcomm_bench.recovery: one kill, then the survivors' recovery, measured."""

from __future__ import annotations

import pytest

from xcomm_bench import recovery


@pytest.mark.parametrize("method", ["xcomm-shrink", "gloo-recreate"])
def test_a_trial_recovers_with_the_survivors_exact_sum(method: str) -> None:
    r = recovery.run_trial(method, 3, timeout_s=10, deadline_s=90)
    assert r["ok"], r["log_tail"]  # every survivor's allreduce on the new group was exact
    # Measured from the kill: detection first, then the rebuilt group's first allreduce.
    assert 0 < r["detect_ms"] <= r["recover_ms"] < 10_000, r
    rows = recovery.summarize([r])
    assert rows[0]["method"] == method and rows[0]["failed"] == 0
    assert "| 3 | " + method in recovery.format_table(rows)
