"""A group's plan (csrc/backend/GroupPlan): decided once per group from the
members' host identities and the options, identical on every rank, and what
the group then does (shared memory, leaders, compression site) follows it."""

from __future__ import annotations

import datetime
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import xcomm
from dist_harness import RankContext, run_ranks


def _rank_plans(ctx: RankContext, tag_of_rank: list[str]) -> dict[str, Any]:
    os.environ["XCOMM_SHM_HOST_TAG"] = tag_of_rank[ctx.rank]
    int8 = dist.new_group(backend="xcomm", pg_options=xcomm.Options(compression="int8"))
    cycle = dist.new_group(
        backend="xcomm",
        pg_options=xcomm.Options(shm=False, fusion_threshold_bytes=1 << 16, fusion_cycle_ms=1.0),
    )
    t = torch.arange(70_000, dtype=torch.float32) + ctx.rank
    dist.all_reduce(t, group=int8)
    small = torch.ones(10)  # below compression_min_bytes: exact, over the group's transport
    dist.all_reduce(small, group=int8)
    return {
        "int8": xcomm.group_plan(int8),
        "cycle": xcomm.group_plan(cycle),
        "stats": int8._get_backend(torch.device("cpu")).compression_stats,
        "shm_ops": xcomm.shm.ops_run(int8),
    }


def _groups(plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["name"]: g for g in plan["groups"]}


@pytest.mark.parametrize(
    "tags, shape",
    [
        (["a", "a", "a"], "single-host shared memory"),
        (["a", "a", "b"], "hierarchical"),
        (["a", "b", "c"], "plain"),
    ],
    ids=["one-host", "two-hosts", "one-rank-per-host"],
)
def test_plan_follows_host_identities(tags: list[str], shape: str) -> None:
    results = run_ranks(_rank_plans, 3, tags, timeout=120)
    for rank, r in enumerate(results):
        plan = r["int8"]
        assert plan["shape"] == shape, plan["description"]
        assert plan["rank"] == rank and plan["size"] == 3
        groups = _groups(plan)
        if shape == "hierarchical":
            # Only the step between hosts is compressed, over the leaders' group.
            assert plan["backend_compression"] == "none"
            assert plan["leader_compression"] == "int8"
            assert "xcomm/gloo-int8" not in groups
            assert groups["xcomm/leaders"]["member"] == (rank in (0, 2))
            assert plan["hosts"] == 2 and plan["host"] == (0 if rank < 2 else 1)
            leader = rank in (0, 2)
            # Leaders count the compressed step; the others compress nothing.
            assert (r["stats"]["calls"] > 0) == leader, r["stats"]
        else:
            assert plan["backend_compression"] == "int8"
            assert plan["leader_compression"] == "none"
            assert "xcomm/gloo-int8" in groups and "xcomm/leaders" not in groups
            assert r["stats"]["calls"] == 1, r["stats"]
        assert (r["shm_ops"] > 0) == (shape != "plain"), r["shm_ops"]
        # shm=False with a fusion cycle: plain, with the cycle's control group.
        cycle = r["cycle"]
        assert cycle["shape"] == "plain" and "shm=False" in cycle["why"]
        assert cycle["fusion_cycle_ms"] == 1.0
        assert set(_groups(cycle)) == {"xcomm/gloo", "xcomm/gloo-check", "xcomm/gloo-fusion"}
        assert cycle["checks_collectives"] and plan["checks_collectives"] == (
            shape != "single-host shared memory"
        )
    # Every rank agrees on everything but its own coordinates.
    common = [
        {
            k: v
            for k, v in r["int8"].items()
            if k not in ("rank", "host", "local_rank", "local_size", "groups")
        }
        for r in results
    ]
    common = [{k: v for k, v in c.items() if k != "description"} for c in common]
    assert all(c == common[0] for c in common), common


def test_options_defaults_and_checks_come_from_cpp() -> None:
    cpp = xcomm._C.XcommOptions()
    opts = xcomm.Options()
    assert opts.compression_min_bytes == cpp.compression_min_bytes == 64 * 1024
    assert opts.int8_chunk_elems == cpp.int8_chunk_elems
    assert opts.shm is cpp.shm is True
    with pytest.raises(TypeError, match="fusion_threshold_bytes must be an int, got bool"):
        xcomm.Options(fusion_threshold_bytes=True)
    with pytest.raises(TypeError, match="shm must be a bool"):
        xcomm.Options(shm=1)
    assert opts.check_collectives is cpp.check_collectives is True
    with pytest.raises(TypeError, match="check_collectives must be a bool"):
        xcomm.Options(check_collectives="yes")
    assert opts.carry_small_ops is cpp.carry_small_ops is True
    assert xcomm.Options(carry_small_ops=False).to_cpp().carry_small_ops is False
    with pytest.raises(TypeError, match="carry_small_ops must be a bool"):
        xcomm.Options(carry_small_ops=1)
    with pytest.raises(ValueError, match="timeout must be positive"):
        xcomm.Options(timeout=datetime.timedelta(0))


def _rank_gloo_plan(ctx: RankContext) -> str:
    g = dist.new_group(backend="gloo")
    try:
        xcomm.group_plan(g)
    except TypeError as e:
        return str(e)
    return "no error"


def test_group_plan_of_a_gloo_group_is_an_error() -> None:
    for msg in run_ranks(_rank_gloo_plan, 1):
        assert "not xcomm" in msg, msg


def _rank_bad_slot_env(ctx: RankContext) -> tuple[str, int]:
    import xcomm.backend

    os.environ["XCOMM_SHM_SLOT_BYTES"] = "lots"
    made = []
    real_gloo = xcomm.backend._gloo

    def counting_gloo(*args: object) -> object:
        made.append(args)
        return real_gloo(*args)

    xcomm.backend._gloo = counting_gloo
    try:
        dist.new_group(backend="xcomm")
    except ValueError as e:
        return str(e), len(made)
    finally:
        xcomm.backend._gloo = real_gloo
    return "no error", len(made)


def test_a_bad_shm_size_on_rank_0_is_an_error_on_every_rank() -> None:
    """Rank 0 chooses the segment sizes; a bad value must fail every rank at
    once (the others used to wait for rank 0's choice until the timeout), and
    before any Gloo group is connected: rank 0 leaving a Gloo mesh its peer
    was still joining failed the peer with "Connection closed by peer"."""
    results = run_ranks(_rank_bad_slot_env, 2, timeout=60)
    for msg, gloo_groups in results:
        assert "XCOMM_SHM_SLOT_BYTES must be an integer, got 'lots'" in msg, msg
        assert gloo_groups == 0
