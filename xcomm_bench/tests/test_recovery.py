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


def test_a_hierarchical_group_across_emulated_nodes_shrinks_to_the_exact_sum() -> None:
    """Four ranks on two emulated nodes (a hierarchical group: shared memory
    on each node, Gloo between them); the last is SIGKILLed and the three
    survivors, two on node 0 and one on node 1, shrink and reduce exactly."""
    from xcomm_bench.cluster import ClusterError, ClusterPermissionError, check_privileges
    from xcomm_bench.launch import RankSpawner

    try:
        check_privileges()
    except (ClusterPermissionError, ClusterError) as e:
        pytest.skip(f"needs root to build network namespaces: {e}")
    with RankSpawner(nodes=2, rate="1gbit") as spawner:
        assert [spawner.node_of(r, 4) for r in range(4)] == [0, 0, 1, 1]
        r = recovery.run_trial("xcomm-shrink", 4, timeout_s=10, deadline_s=90, spawner=spawner)
    assert r["where"] == "2 emulated nodes (1gbit links)"
    assert r["ok"], r["log_tail"]
    assert 0 < r["detect_ms"] <= r["recover_ms"] < 10_000, r
    assert r["shapes"] == ["hierarchical"], r
