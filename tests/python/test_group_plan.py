"""A group's plan (csrc/backend/GroupPlan): decided once per group from the
members' host identities and the options, identical on every rank, and what
the group then does (shared memory, leaders, compression site) follows it."""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import xcomm
from dist_harness import DelegatingStore, RankContext, error_of, run_ranks


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
            assert "xcomm/leaders" not in groups
            # Its own collectives ride on the check's group where there is one
            # (plain); a single-host group has no check group and a group of its own.
            assert ("xcomm/gloo-int8" in groups) == (shape != "plain"), groups
            assert ("xcomm/gloo-check" in groups) == (shape == "plain"), groups
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
    assert opts.shm_hierarchical is cpp.shm_hierarchical is True
    assert opts.direct_exchange is cpp.direct_exchange is True
    assert opts.shm_slot_bytes is cpp.shm_slot_bytes is None
    assert opts.shm_small_bytes is cpp.shm_small_bytes is None
    sized = xcomm.Options(shm_slot_bytes=4096, shm_small_bytes=0).to_cpp()
    assert (sized.shm_slot_bytes, sized.shm_small_bytes) == (4096, 0)
    with pytest.raises(ValueError, match=r"shm_slot_bytes must be > 0 \(or None\), got 0"):
        xcomm.Options(shm_slot_bytes=0)
    with pytest.raises(ValueError, match=r"shm_small_bytes must be >= 0 \(or None\), got -1"):
        xcomm.Options(shm_small_bytes=-1)
    with pytest.raises(TypeError, match="shm_slot_bytes must be an int, got bool"):
        xcomm.Options(shm_slot_bytes=True)
    with pytest.raises(TypeError, match="shm_hierarchical must be a bool, got int"):
        xcomm.Options(shm_hierarchical=0)
    with pytest.raises(TypeError, match="direct_exchange must be a bool, got str"):
        xcomm.Options(direct_exchange="off")


def test_auto_bounds_as_options_are_checked_naming_the_option() -> None:
    cpp = xcomm.Options(
        compression="auto", auto_methods=("int8", "none", "int8"), auto_link=(1e-4, 1.25e8)
    ).to_cpp()
    assert cpp.auto_methods == ("none", "int8")  # deduplicated, in auto's order
    assert cpp.auto_link == (1e-4, 1.25e8)
    assert xcomm.Options().to_cpp().auto_methods is None
    with pytest.raises(ValueError, match="auto_methods names 'zstd'"):
        xcomm.Options(compression="auto", auto_methods=("none", "zstd"))
    with pytest.raises(ValueError, match="auto_methods names no method"):
        xcomm.Options(compression="auto", auto_methods=())
    with pytest.raises(TypeError, match="auto_methods must be a sequence of str"):
        xcomm.Options(compression="auto", auto_methods="bf16")
    with pytest.raises(ValueError, match="auto_methods needs compression='auto'"):
        xcomm.Options(compression="int8", auto_methods=("none",))
    with pytest.raises(ValueError, match="auto_link needs compression='auto'"):
        xcomm.Options(auto_link=(0.0, 1e9))
    with pytest.raises(ValueError, match="auto_link's bandwidth must be > 0"):
        xcomm.Options(compression="auto", auto_link=(1e-4, 0))
    with pytest.raises(ValueError, match="auto_link must be"):
        xcomm.Options(compression="auto", auto_link=(-1.0, 1e9))
    with pytest.raises(TypeError, match="auto_link must be"):
        xcomm.Options(compression="auto", auto_link=1e9)


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


@contextlib.contextmanager
def _counting_gloo() -> Iterator[list[object]]:
    """Counts the Gloo groups xcomm's builder makes inside the block."""
    import xcomm.backend

    made: list[object] = []
    real_gloo = xcomm.backend._gloo

    def counting_gloo(*args: object) -> object:
        made.append(args)
        return real_gloo(*args)

    xcomm.backend._gloo = counting_gloo
    try:
        yield made
    finally:
        xcomm.backend._gloo = real_gloo


def _gloo_loop_threads() -> int:
    """Gloo TCP devices alive in this process: each runs one loop thread."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            count += f.read().strip() == "gloo_tcp_loop"
    return count


def _rank_shared_gloo_device(ctx: RankContext) -> dict[str, Any]:
    import xcomm.backend

    plain = xcomm.Options(shm=False)  # two Gloo groups each: the transport and its checks
    before = _gloo_loop_threads()
    with _counting_gloo() as made:
        first = dist.new_group(backend="xcomm", pg_options=plain)
        second = dist.new_group(backend="xcomm", pg_options=plain)
    during = _gloo_loop_threads()
    sums = []
    for g in (first, second):
        t = torch.full((5,), float(ctx.rank + 1))
        dist.all_reduce(t, group=g)
        sums.append(t.tolist())
    # Letting one group go leaves the device to the others.
    dist.destroy_process_group(first)
    t = torch.full((5,), float(ctx.rank + 1))
    dist.all_reduce(t, group=second)
    sums.append(t.tolist())
    mine = [k for k in xcomm.backend._GLOO_DEVICES if k[0] == os.getpid()]
    return {
        "gloo_groups": len(made),
        "new_devices": during - before,
        "cached": len(mine),
        "sums": sums,
    }


def test_the_gloo_groups_of_a_process_share_one_device() -> None:
    """Every Gloo group xcomm builds in a process uses one Gloo device (a
    listening socket and a loop thread): a device per group cost a thread
    and about a millisecond to make, and up to 10 ms to let go, on the path
    of every group built, shrunk or reconfigured."""
    for r in run_ranks(_rank_shared_gloo_device, 2, timeout=120):
        assert r["gloo_groups"] == 4, r  # the plain groups were built with Gloo
        # The default xcomm group made the process's device: none is new.
        assert r["new_devices"] == 0, r
        assert r["cached"] == 1, r
        assert r["sums"] == [[3.0] * 5] * 3, r


def _rank_bad_slot_env(ctx: RankContext) -> tuple[str, int]:
    os.environ["XCOMM_SHM_SLOT_BYTES"] = "lots"
    with _counting_gloo() as made:
        try:
            dist.new_group(backend="xcomm")
        except ValueError as e:
            return str(e), len(made)
    return "no error", len(made)


def test_a_bad_shm_size_is_an_error_on_every_rank_before_any_gloo_group() -> None:
    """The segment sizes are agreed with the group's other settings; a value
    a rank cannot read must fail every rank at once (when rank 0 chose them,
    the others waited for its choice until the timeout), and before any Gloo
    group is connected: rank 0 leaving a Gloo mesh its peer was still joining
    failed the peer with "Connection closed by peer"."""
    results = run_ranks(_rank_bad_slot_env, 2, timeout=60)
    for msg, gloo_groups in results:
        assert "XCOMM_SHM_SLOT_BYTES must be an integer, got 'lots'" in msg, msg
        assert gloo_groups == 0


# -- settings every rank must share (csrc/backend/GroupSettings) ----------------------


def _rank_settings(
    ctx: RankContext, env_of_rank: list[dict[str, str]], options_of_rank: list[dict[str, Any]]
) -> dict[str, Any]:
    mine = env_of_rank[ctx.rank]
    os.environ.update(mine)
    options = xcomm.Options(**options_of_rank[ctx.rank])
    t0 = time.monotonic()
    with _counting_gloo() as made:
        error = error_of(lambda: dist.new_group(backend="xcomm", pg_options=options))
    elapsed = time.monotonic() - t0
    # The job goes on: with the setting alike on every rank, a group forms.
    for name in mine:
        del os.environ[name]
    group = dist.new_group(backend="xcomm", pg_options=xcomm.Options(shm=False))
    x = torch.arange(4, dtype=torch.float32) + ctx.rank
    dist.all_reduce(x, group=group)
    return {"error": error, "elapsed": elapsed, "gloo_groups": len(made), "after": x.tolist()}


_LINK = "1e-4,1.25e8"


@pytest.mark.parametrize(
    "env_of_rank, options_of_rank, expected",
    [
        (
            [{}, {"XCOMM_AUTO_LINK": _LINK}],
            [{"compression": "auto", "shm": False}] * 2,
            "XCOMM_AUTO_LINK (rank 0 unset; rank 1 '0.0001,125000000')",
        ),
        (
            [{"XCOMM_AUTO_METHODS": "bf16,none"}, {}],
            [{"compression": "auto", "shm": False}] * 2,
            "XCOMM_AUTO_METHODS (rank 0 'none,bf16'; rank 1 unset)",
        ),
        ([{}, {"XCOMM_SHM": "off"}], [{}] * 2, "XCOMM_SHM (rank 0 'on'; rank 1 'off')"),
        (
            [{}, {}],
            [{"compression": "int8", "shm": False}, {"shm": False}],
            "Options.compression (rank 0 'int8'; rank 1 'none')",
        ),
        (
            [{}, {}, {"XCOMM_SHM_SLOT_BYTES": "4096"}],
            [{}] * 3,
            "XCOMM_SHM_SLOT_BYTES (ranks 0, 1 unset; rank 2 '4096')",
        ),
        (
            [{}, {}],
            [{"shm_slot_bytes": 4096}, {}],
            "Options.shm_slot_bytes (rank 0 '4096'; rank 1 unset)",
        ),
        (
            [{}, {}],
            [{"direct_exchange": False, "shm": False}, {"shm": False}],
            "Options.direct_exchange (rank 0 'off'; rank 1 'on')",
        ),
        (
            [{}, {"XCOMM_SHM_SPIN_US": "-5"}],
            [{}] * 2,
            "XCOMM_SHM_SPIN_US must be >= 0, got -5 (on rank 1)",
        ),
    ],
    ids=[
        "auto-link",
        "auto-methods",
        "shm-env",
        "compression-option",
        "slot-bytes-3-ranks",
        "slot-bytes-option",
        "direct-exchange-option",
        "bad-spin-one-rank",
    ],
)
def test_ranks_that_differ_on_a_group_setting_all_raise_it_at_once(
    env_of_rank: list[dict[str, str]], options_of_rank: list[dict[str, Any]], expected: str
) -> None:
    """A setting that changes which collectives a rank issues, set on some
    ranks only, is the same ValueError on every rank, naming the setting and
    every rank's value, before any Gloo group is made; without the agreement
    a rank with XCOMM_AUTO_LINK skipped the link probes its peers ran and
    the group hung until the timeout."""
    world = len(env_of_rank)
    results = run_ranks(_rank_settings, world, env_of_rank, options_of_rank, timeout=90)
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors  # the same words on every rank
    for r in results:
        assert r["error"] is not None and r["error"].startswith("ValueError"), r
        assert expected in r["error"], r["error"]
        assert r["elapsed"] < 5, r
        assert r["gloo_groups"] == 0, r
        total = sum(range(world))
        assert r["after"] == [float(total + world * i) for i in range(4)], r


def _rank_agreed_settings(ctx: RankContext, by: str) -> dict[str, Any]:
    os.environ["XCOMM_SHM_SLOT_BYTES"] = "65536"
    bounds: dict[str, Any] = {}
    if by == "environment":
        os.environ["XCOMM_AUTO_LINK"] = _LINK
        os.environ["XCOMM_AUTO_METHODS"] = "int8,none"
    elif by == "options":
        bounds = {"auto_link": (1e-4, 1.25e8), "auto_methods": ("int8", "none")}
    else:  # the variables override the options
        os.environ["XCOMM_AUTO_LINK"] = _LINK
        os.environ["XCOMM_AUTO_METHODS"] = "int8,none"
        bounds = {"auto_link": (1.0, 1e3), "auto_methods": ("bf16",)}
    group = dist.new_group(backend="xcomm", pg_options=xcomm.Options(compression="auto"))
    options = xcomm.Options(compression="auto", shm=False, **bounds)
    plain = dist.new_group(backend="xcomm", pg_options=options)
    x = torch.randn(1 << 18, generator=ctx.generator())
    dist.all_reduce(x, group=plain)
    stats = plain._get_backend(torch.device("cpu")).compression_stats["auto"]
    return {"shm": xcomm.group_plan(group), "plain": xcomm.group_plan(plain), "auto": stats}


@pytest.mark.parametrize("by", ["environment", "options", "environment-over-options"])
def test_settings_alike_on_every_rank_are_in_the_plan_and_used(by: str) -> None:
    for r in run_ranks(_rank_agreed_settings, 2, by):
        settings = r["plain"]["settings"]
        assert settings["auto_link"] == (1e-4, 1.25e8), settings
        assert settings["auto_methods"] == ["none", "int8"], settings
        assert "XCOMM_AUTO_LINK: 0.0001 s latency" in r["plain"]["description"]
        assert r["shm"]["settings"]["shm_slot_bytes"] == 65536, r["shm"]
        # auto read the pinned link (not a probe) and chose only among its methods.
        assert r["auto"]["inputs"]["bandwidth_bytes_per_s"] == pytest.approx(1.25e8), r["auto"]
        assert r["auto"]["inputs"]["latency_s"] == pytest.approx(1e-4), r["auto"]
        assert r["auto"]["chosen"]["bf16"] == 0, r["auto"]


def _rank_shm_options(ctx: RankContext) -> dict[str, Any]:
    tiny = xcomm.Options(shm_slot_bytes=256, shm_small_bytes=96, direct_exchange=False)
    by_options = dist.new_group(backend="xcomm", pg_options=tiny)
    os.environ["XCOMM_SHM_SLOT_BYTES"] = "512"  # overrides the option's 256
    os.environ["XCOMM_DIRECT_EXCHANGE"] = "1"  # cannot turn on what the option turned off
    overridden = dist.new_group(backend="xcomm", pg_options=tiny)
    del os.environ["XCOMM_SHM_SLOT_BYTES"], os.environ["XCOMM_DIRECT_EXCHANGE"]
    # Two hosts of two ranks: hierarchical unless the option keeps it plain.
    os.environ["XCOMM_SHM_HOST_TAG"] = "a" if ctx.rank < 2 else "b"
    spanning = dist.new_group(backend="xcomm", pg_options=xcomm.Options(shm_hierarchical=False))
    hierarchical = dist.new_group(backend="xcomm")
    del os.environ["XCOMM_SHM_HOST_TAG"]
    # 10_000 floats through 256-byte slots: many pieces, the same sum as Gloo's.
    x = torch.arange(10_000, dtype=torch.float32) * (ctx.rank + 1)
    ref = x.clone()
    ops_before = xcomm.shm.ops_run(by_options)
    dist.all_reduce(x, group=by_options)
    dist.all_reduce(ref, group=ctx.ref)
    return {
        "settings": xcomm.group_plan(by_options)["settings"],
        "overridden": xcomm.group_plan(overridden)["settings"],
        "spanning": xcomm.group_plan(spanning),
        "hierarchical": xcomm.group_plan(hierarchical)["shape"],
        "equal": torch.equal(x, ref),
        "shm_ops": xcomm.shm.ops_run(by_options) - ops_before,
    }


def test_shm_and_direct_exchange_options_are_in_the_plan_and_the_environment_overrides_them() -> (
    None
):
    """Options(shm_slot_bytes, shm_small_bytes, shm_hierarchical,
    direct_exchange) set what XCOMM_SHM_SLOT_BYTES, XCOMM_SHM_SMALL_BYTES,
    XCOMM_SHM_HIERARCHICAL and XCOMM_DIRECT_EXCHANGE set: the variables
    override the sizes and may turn the switches off, not on."""
    for r in run_ranks(_rank_shm_options, 4, timeout=120):
        settings = r["settings"]
        assert settings["shm_slot_bytes"] == 256 and settings["shm_small_bytes"] == 96, settings
        assert settings["direct_exchange"] is False, settings
        assert r["overridden"]["shm_slot_bytes"] == 512, r["overridden"]
        assert r["overridden"]["direct_exchange"] is False, r["overridden"]
        assert r["spanning"]["shape"] == "plain", r["spanning"]
        assert "Options(shm_hierarchical=False)" in r["spanning"]["why"], r["spanning"]
        assert r["hierarchical"] == "hierarchical"
        assert r["equal"] and r["shm_ops"] == 1, r


def _rank_own_spin(ctx: RankContext) -> dict[str, Any]:
    if ctx.rank == 0:
        os.environ["XCOMM_SHM_SPIN_US"] = "0"
    group = dist.new_group(backend="xcomm")
    x = torch.arange(1 << 16, dtype=torch.float32) * (ctx.rank + 1)
    dist.all_reduce(x, group=group)
    ref = torch.arange(1 << 16, dtype=torch.float32) * (ctx.rank + 1)
    dist.all_reduce(ref, group=ctx.ref)
    plan = xcomm.group_plan(group)
    return {"equal": torch.equal(x, ref), "plan": plan, "shm_ops": xcomm.shm.ops_run(group)}


def test_the_spin_time_is_each_ranks_own_and_read_with_the_settings() -> None:
    """XCOMM_SHM_SPIN_US changes how long a waiting rank spins before it
    sleeps, not what it sends: ranks may differ on it (rank 0 never spins
    here), the group forms and reduces as gloo does, and each rank's plan
    shows its own value."""
    results = run_ranks(_rank_own_spin, 2)
    for rank, r in enumerate(results):
        assert r["equal"], r
        assert r["plan"]["shape"] == "single-host shared memory", r["plan"]
        assert r["shm_ops"] >= 1, r
        assert r["plan"]["settings"]["shm_spin_us"] == (0 if rank == 0 else None), r["plan"]
    assert "XCOMM_SHM_SPIN_US: 0 (this rank's)" in results[0]["plan"]["description"]
    assert "XCOMM_SHM_SPIN_US" not in results[1]["plan"]["description"]


class _CorruptingStore(DelegatingStore):
    """A store in which another process overwrote rank 0's set-up record
    just before this rank read it (the TCPStore takes writes from anyone)."""

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        return b"not xcomm's" if key.endswith("/settings/0") else value


def _rank_corrupted_record(ctx: RankContext) -> dict[str, Any]:
    import xcomm.backend

    base = dist.FileStore(os.path.join(ctx.tmpdir, "corrupt-store"), ctx.world_size)
    store = _CorruptingStore(base) if ctx.rank == 1 else base
    options = xcomm.Options(timeout=datetime.timedelta(seconds=30)).to_cpp()
    t0 = time.monotonic()
    error = error_of(
        lambda: xcomm._C.build_group(store, ctx.rank, ctx.world_size, options, xcomm.backend._gloo)
    )
    return {"error": error, "elapsed": time.monotonic() - t0}


def test_a_set_up_record_corrupted_in_the_store_fails_every_rank_at_once() -> None:
    """Rank 1 reads garbage where rank 0's record was: every rank raises the
    same clear error within a second (before: the rank that read garbage
    raised a bare 'stoull' while its peer waited the whole timeout)."""
    results = run_ranks(_rank_corrupted_record, 2, timeout=90)
    assert len({r["error"] for r in results}) == 1, results
    for r in results:
        assert r["error"] is not None and r["error"].startswith("ValueError"), r
        assert "rank 0's set-up record" in r["error"] and "not one this xcomm wrote" in r["error"]
        assert r["elapsed"] < 1.0, r
