"""The shared-memory transport (``xcomm.shm``) against gloo and under faults.

Reference: gloo (``ctx.ref``, same ranks, same deterministic inputs).

* Results are compared bitwise for integer and bool dtypes and, at 2 ranks,
  for every dtype (the two-term reduction has one order); at 3 and 4 ranks
  floating point is compared within summation-order tolerance
  (``dist_harness.tolerances``).
* Every rank must hold bitwise the same result as every other rank (digests
  of the outputs are compared across ranks in the parent).
* Sizes cover empty, one element, odd sizes, and messages spanning many
  chunks: the groups under test use tiny slots (``XCOMM_SHM_SLOT_BYTES``) so
  the chunked paths run at small sizes; one case per run uses the default
  slots with multi-MiB messages.
* World sizes 2 to 4: 4 ranks on this 2-core machine exercise the futex
  sleep path (ranks outnumber cores).
* Faults: a rank SIGKILLed mid-collective makes every survivor raise well
  within the timeout; a stalled (SIGSTOPped) rank makes them raise at the
  timeout; nothing is left in /dev/shm.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import (
    ALL_DTYPES,
    BASIC_OPS,
    IS_XCOMM,
    Mismatches,
    RankContext,
    assert_no_mismatches,
    dtype_name,
    error_of,
    make_input,
    run_ranks,
)

pytestmark = pytest.mark.skipif(not IS_XCOMM, reason="tests xcomm's shared-memory transport")

#: Tiny slots so that sizes of a few hundred elements span many chunks and the
#: one-barrier allreduce path covers only the smallest messages.
SMALL_SLOTS = {"XCOMM_SHM_SLOT_BYTES": "256", "XCOMM_SHM_SMALL_BYTES": "96"}
SIZES = (0, 1, 5, 61, 1000)
WORLD_SIZES = [pytest.param(2, id="ws2"), pytest.param(3, id="ws3"), pytest.param(4, id="ws4")]


def _shm_files() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("xcomm-shm-"))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _same(chk: Mismatches, label: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise at 2 ranks and for integers/bool, else summation tolerance."""
    if chk.ctx.world_size == 2 or not ref.is_floating_point():
        if got.dtype != ref.dtype or got.shape != ref.shape or not torch.equal(got, ref):
            diff = (got != ref).nonzero().flatten()[:4].tolist() if got.shape == ref.shape else []
            chk.fail(label, f"not bitwise equal to gloo (first differing indices {diff})")
    else:
        chk.compare(label, got, ref)


def _check_active(chk: Mismatches) -> None:
    import xcomm.shm

    if not xcomm.shm.is_active():
        chk.fail("setup", "the default xcomm group does not use shared memory")
    if _shm_files():
        chk.fail("setup", f"segments still linked in /dev/shm after init: {_shm_files()}")


def _rank_all_reduce(ctx: RankContext) -> tuple[list[str], dict[str, str], int]:
    import xcomm.shm

    chk = Mismatches(ctx)
    _check_active(chk)
    digests: dict[str, str] = {}
    ops: dict[str, Any] = dict(BASIC_OPS)
    ops["PREMUL_SUM"] = None
    for dtype in ALL_DTYPES:
        for name, op in ops.items():
            if name == "PREMUL_SUM" and not dtype.is_floating_point:
                continue
            for n in SIZES:
                label = f"all_reduce {dtype_name(dtype)} {name} n={n}"
                x = make_input(ctx, dtype, (n,), small=name == "PRODUCT")
                ref = x.clone()
                if name == "PREMUL_SUM":
                    ref = ref * 0.5
                    ref_op, op = dist.ReduceOp.SUM, dist._make_nccl_premul_sum(0.5)
                else:
                    ref_op = op
                # AVG of integers: NCCL's meaning (gloo's SUM, divided rounding toward zero).
                int_avg = name == "AVG" and not dtype.is_floating_point and dtype != torch.bool
                try:
                    dist.all_reduce(ref, op=dist.ReduceOp.SUM if int_avg else ref_op, group=ctx.ref)
                    if int_avg:
                        ref = ref.div(ctx.world_size, rounding_mode="trunc")
                except Exception:  # noqa: BLE001 - gloo rejects it: xcomm must too
                    try:
                        dist.all_reduce(x.clone(), op=op)
                    except Exception:  # noqa: BLE001, S112 - rejected by both: nothing to compare
                        continue
                    chk.fail(label, "gloo rejects this op but xcomm accepted it")
                    continue
                with chk.case(label):
                    got = x.clone()
                    dist.all_reduce(got, op=op)
                    _same(chk, label, got, ref)
                    digests[label] = _digest(got)

    # The default slots (2 MiB): one-barrier path, one chunk, many chunks.
    os.environ.pop("XCOMM_SHM_SLOT_BYTES", None)
    os.environ.pop("XCOMM_SHM_SMALL_BYTES", None)
    group = dist.new_group(backend="xcomm")
    for n in (1 << 14, 1 << 17, (3 << 20) + 7):
        for dtype in (torch.float32, torch.int32):
            label = f"all_reduce default slots {dtype_name(dtype)} SUM n={n}"
            x = make_input(ctx, dtype, (n,), salt=3)
            ref = x.clone()
            dist.all_reduce(ref, group=ctx.ref)
            with chk.case(label):
                dist.all_reduce(x, group=group)
                _same(chk, label, x, ref)
                digests[label] = _digest(x)
    return chk.items, digests, xcomm.shm.ops_run()


def _rank_data_movement(ctx: RankContext) -> tuple[list[str], dict[str, str]]:
    import xcomm.shm

    chk = Mismatches(ctx)
    _check_active(chk)
    ws, rank = ctx.world_size, ctx.rank
    digests: dict[str, str] = {}
    for dtype in (*ALL_DTYPES, torch.complex64):
        for n in SIZES:
            base = f"{dtype_name(dtype)} n={n}"
            for root in range(ws):
                label = f"broadcast {base} root={root}"
                with chk.case(label):
                    x = (
                        make_input(ctx, dtype, (n,))
                        if dtype != torch.complex64
                        else torch.full((n,), complex(rank, -rank))
                    )
                    ref = x.clone()
                    dist.broadcast(ref, root, group=ctx.ref)
                    dist.broadcast(x, root)
                    _same(chk, label, x, ref)
                    digests[label] = _digest(x)
            label = f"all_gather {base}"
            with chk.case(label):
                x = (
                    make_input(ctx, dtype, (n,))
                    if dtype != torch.complex64
                    else torch.full((n,), complex(rank, 1))
                )
                ref = [torch.empty_like(x) for _ in range(ws)]
                got = [torch.empty_like(x) for _ in range(ws)]
                dist.all_gather(ref, x, group=ctx.ref)
                dist.all_gather(got, x)
                for r in range(ws):
                    _same(chk, f"{label} [{r}]", got[r], ref[r])
                flat = torch.empty(ws * n, dtype=dtype)
                dist.all_gather_into_tensor(flat, x)
                _same(chk, f"{label} into_tensor", flat, torch.cat(ref))
                digests[label] = _digest(flat)
            # Uneven: rank s sends rank d (s + 2d + n) % 5 rows of 3; n=1000: many rounds.
            rows = [
                [(s + 2 * d + n) % 5 if n < 1000 else n + s + d for d in range(ws)]
                for s in range(ws)
            ]
            label = f"all_to_all_single {base}"
            with chk.case(label):
                x = (
                    make_input(ctx, dtype, (sum(rows[rank]), 3), salt=4)
                    if dtype != torch.complex64
                    else torch.full((sum(rows[rank]), 3), complex(rank, 2))
                )
                out_rows = [rows[s][rank] for s in range(ws)]
                ref = torch.empty(sum(out_rows), 3, dtype=dtype)
                got = torch.full_like(ref, 7)
                dist.all_to_all_single(ref, x, out_rows, rows[rank], group=ctx.ref)
                before = xcomm.shm.ops_run()
                dist.all_to_all_single(got, x, out_rows, rows[rank])
                if xcomm.shm.ops_run() != before + 1:
                    chk.fail(label, "did not run over shared memory")
                _same(chk, label, got, ref)  # each rank's own pieces: no digest to agree on
            label = f"all_to_all {base}"
            with chk.case(label):
                # Gloo's list form takes one shape throughout, and so does xcomm's.
                ins = [x.roll(d, 0)[:2].clone() for d in range(ws)] if len(x) >= 2 else [x] * ws
                ref_list = [torch.empty_like(t) for t in ins]
                got_list = [torch.full_like(t, 7) for t in ins]
                dist.all_to_all(ref_list, ins, group=ctx.ref)
                before = xcomm.shm.ops_run()
                dist.all_to_all(got_list, ins)
                if xcomm.shm.ops_run() != before + 1:
                    chk.fail(label, "did not run over shared memory")
                for r in range(ws):
                    _same(chk, f"{label} [{r}]", got_list[r], ref_list[r])
            if dtype == torch.complex64:
                continue
            for name, op in BASIC_OPS.items():
                label = f"reduce_scatter {base} {name}"
                ins = [
                    make_input(ctx, dtype, (n,), salt=10 + r, small=name == "PRODUCT")
                    for r in range(ws)
                ]
                ref = torch.empty(n, dtype=dtype)
                try:
                    dist.reduce_scatter(ref, [t.clone() for t in ins], op=op, group=ctx.ref)
                except Exception:  # noqa: BLE001 - gloo rejects it: xcomm must too
                    try:
                        dist.reduce_scatter(torch.empty(n, dtype=dtype), ins, op=op)
                    except Exception:  # noqa: BLE001, S112 - rejected by both: nothing to compare
                        continue
                    chk.fail(label, "gloo rejects this op but xcomm accepted it")
                    continue
                with chk.case(label):
                    got = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter(got, ins, op=op)
                    _same(chk, label, got, ref)
                    flat_out = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter_tensor(flat_out, torch.cat(ins), op=op)
                    _same(chk, label + " tensor", flat_out, ref)
    with chk.case("barrier"):
        dist.barrier()
    return chk.items, digests


def _assert_ranks_agree(digests: list[dict[str, str]]) -> None:
    differ = [k for k in digests[0] if any(d.get(k) != digests[0][k] for d in digests[1:])]
    assert not differ, f"ranks hold different bits for: {differ[:10]}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_matches_gloo(world_size: int) -> None:
    """Every dtype x reduce op x size (empty to many chunks), incl. PREMUL_SUM."""
    results = run_ranks(_rank_all_reduce, world_size, env=SMALL_SLOTS, timeout=120)
    assert_no_mismatches([r[0] for r in results])
    _assert_ranks_agree([r[1] for r in results])
    assert all(r[2] >= 250 for r in results), f"too few ops ran over shared memory: {results[0][2]}"
    assert not _shm_files()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast_all_gather_reduce_scatter_match_gloo(world_size: int) -> None:
    """And all_to_all (single, uneven, and list): every dtype, over shared memory."""
    results = run_ranks(_rank_data_movement, world_size, env=SMALL_SLOTS, timeout=120)
    assert_no_mismatches([r[0] for r in results])
    _assert_ranks_agree([r[1] for r in results])


def _rank_switches(ctx: RankContext) -> dict[str, Any]:
    import xcomm
    import xcomm.shm

    off = dist.new_group(backend="xcomm", pg_options=xcomm.Options(shm=False))
    sub = dist.new_group(ranks=[0, 1], backend="xcomm") if ctx.world_size > 2 else None
    x = torch.arange(10, dtype=torch.float32) + ctx.rank
    y = x.clone()
    dist.all_reduce(x)
    dist.all_reduce(y, group=off)
    return {
        "default": xcomm.shm.is_active(),
        "off": xcomm.shm.is_active(off),
        "sub": xcomm.shm.is_active(sub) if sub is not None and ctx.rank < 2 else None,
        "equal": torch.equal(x, y),
    }


def test_switches_and_subgroups() -> None:
    """On by default; Options(shm=False) and XCOMM_SHM=0 turn it off; a
    sub-group of ranks on this host gets its own segment."""
    res = run_ranks(_rank_switches, 3)
    assert all(r["default"] and not r["off"] and r["equal"] for r in res), res
    assert res[0]["sub"] and res[1]["sub"], res
    res = run_ranks(_rank_switches, 2, env={"XCOMM_SHM": "0"})
    assert not any(r["default"] or r["off"] for r in res), res


def _rank_mismatch(ctx: RankContext) -> dict[str, Any]:
    """Ranks that disagree (a user bug) must all raise, at once, never return."""
    rank = ctx.rank
    out: dict[str, Any] = {"errors": {}, "seconds": {}}
    x = torch.full((6,), float(rank))
    other = torch.zeros(6)
    cases: dict[str, Callable[[], object]] = {
        "sizes": lambda: dist.all_reduce(torch.ones(10 + 10 * rank)),
        # Each rank believes it is the root: before, both returned their own data.
        "broadcast_root": lambda: dist.broadcast(x, src=rank),
        "reduce_op": lambda: dist.all_reduce(
            torch.ones(4), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
        ),
        # Shared memory on one rank, the Gloo fallback on the other: before,
        # both waited for each other until the timeout.
        "shm_vs_fallback": lambda: (
            dist.all_reduce(torch.ones(6)) if rank == 0 else dist.reduce(x, dst=0)
        ),
        "all_to_all_vs_all_reduce": lambda: (
            dist.all_reduce(torch.ones(6)) if rank == 0 else dist.all_to_all_single(other, x)
        ),
        # Rank 0 sends rank 1 three rows; rank 1 expects two.
        "all_to_all_splits": lambda: dist.all_to_all_single(
            torch.zeros(6 - rank), torch.ones(6), [3 - rank, 3], [3, 3]
        ),
        # Both on the fallback, different roots (Gloo's reduce takes them as they are).
        "reduce_root": lambda: dist.reduce(torch.ones(4), dst=rank),
        "barrier_vs_all_reduce": lambda: (
            dist.barrier() if rank == 0 else dist.all_reduce(torch.ones(3))
        ),
        "dtype": lambda: dist.all_reduce(
            torch.ones(4, dtype=torch.float32 if rank else torch.int32)
        ),
    }
    for name, call in cases.items():
        start = time.monotonic()
        out["errors"][name] = error_of(call)
        out["seconds"][name] = time.monotonic() - start
        t = torch.ones(7)
        dist.all_reduce(t)  # the group is still in step
        assert t.tolist() == [2.0] * 7, (name, t)
    return out


@pytest.mark.xcomm_specific
def test_ranks_that_disagree_raise_on_every_rank_and_group_recovers() -> None:
    res = run_ranks(_rank_mismatch, 2)
    splits = [r["errors"].pop("all_to_all_splits") for r in res]
    for error in splits:
        assert error == splits[0], splits  # the same account on every rank
        assert error.startswith("ValueError"), error
        assert "rank 0 sends 12 bytes to rank 1, but rank 1 expects 8 bytes from rank 0" in error
    for r in res:
        for name, error in r["errors"].items():
            assert error and "called different collectives" in error, (name, res)
            assert "ValueError" in error, (name, error)
            # At once, not at the group's timeout (40 s in the tests).
            assert r["seconds"][name] < 10, (name, r["seconds"])
    # Every rank gives the same account (each names its own op first).
    for name, error in res[0]["errors"].items():
        tail = error.split("called different collectives")[1]
        assert tail == res[1]["errors"][name].split("called different collectives")[1]
    assert "broadcast(root=0" in res[0]["errors"]["broadcast_root"]
    assert "broadcast(root=1" in res[0]["errors"]["broadcast_root"]
    assert "reduce(root=0" in res[0]["errors"]["shm_vs_fallback"]
    assert "all_to_all(Float)" in res[0]["errors"]["all_to_all_vs_all_reduce"]


def _rank_fault(ctx: RankContext, victim: int, how: str) -> dict[str, Any] | None:
    t = torch.ones(1 << 20)  # 4 MiB: four chunks of the default slots
    for _ in range(3):
        dist.all_reduce(t)
    if ctx.rank == victim:
        work = dist.all_reduce(t, async_op=True)  # noqa: F841 - die while it runs
        os.kill(os.getpid(), signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
        time.sleep(3600)
    result: dict[str, Any] = {}
    for attempt in ("first", "second"):
        t0 = time.monotonic()
        try:
            for _ in range(50):
                dist.all_reduce(t)
            result[attempt] = {"raised": False, "elapsed": time.monotonic() - t0}
        except Exception as e:  # noqa: BLE001
            result[attempt] = {
                "raised": True,
                "elapsed": time.monotonic() - t0,
                "error": f"{type(e).__name__}: {e}",
            }
    result["files"] = _shm_files()
    return result


@pytest.mark.parametrize(
    ("world_size", "victim", "how", "pg_timeout_s", "bound_s"),
    [
        pytest.param(3, 1, "sigkill", 20.0, 5.0, id="ws3-sigkill"),
        pytest.param(2, 0, "sigstop", 2.0, 10.0, id="ws2-sigstop"),
    ],
)
def test_dead_or_stalled_peer_raises_within_timeout(
    world_size: int, victim: int, how: str, pg_timeout_s: float, bound_s: float
) -> None:
    """SIGKILL: survivors notice the dead pid long before the (20 s) timeout.
    SIGSTOP: the peer is alive but stuck; survivors raise at the 2 s timeout.
    Either way nothing is left in /dev/shm."""
    res = run_ranks(
        _rank_fault,
        world_size,
        victim,
        how,
        pg_timeout=datetime.timedelta(seconds=pg_timeout_s),
        use_pg_options=True,
        may_die=[victim],
        timeout=60,
    )
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        assert r is not None
        for attempt in ("first", "second"):
            info = r[attempt]
            assert info["raised"], (rank, attempt, r)
            assert info["elapsed"] < bound_s, (rank, attempt, r)
        assert ("died" if how == "sigkill" else "timed out") in r["first"]["error"], r
        assert r["files"] == [], r
    assert not _shm_files()


def _rank_hierarchical(ctx: RankContext) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    import xcomm.shm

    chk = Mismatches(ctx)
    # Two logical hosts on this machine: ranks {0, 1} and {2, 3} (ws4), or
    # {0, 1} and {2} (ws3).
    os.environ["XCOMM_SHM_HOST_TAG"] = f"host{ctx.rank // 2}"
    group = dist.new_group(backend="xcomm")
    backend = group._get_backend(torch.device("cpu"))
    info = {"transport": backend.cpu_backend_name, "shm_ops": xcomm.shm.ops_run(group)}
    digests: dict[str, str] = {}
    for dtype in ALL_DTYPES:
        for name, op in BASIC_OPS.items():
            for n in (0, 1, 61, 1000):
                label = f"hierarchical all_reduce {dtype_name(dtype)} {name} n={n}"
                x = make_input(ctx, dtype, (n,), small=name == "PRODUCT")
                ref = x.clone()
                try:
                    dist.all_reduce(ref, op=op, group=ctx.ref)
                except Exception:  # noqa: BLE001, S112 - rejected by gloo: skip
                    continue
                with chk.case(label):
                    dist.all_reduce(x, op=op, group=group)
                    _same(chk, label, x, ref)
                    digests[label] = _digest(x)
    # Ops other than allreduce go to gloo over the whole group.
    with chk.case("hierarchical broadcast"):
        b = torch.full((5,), float(ctx.rank))
        dist.broadcast(b, 2, group=group)
        _same(chk, "hierarchical broadcast", b, torch.full((5,), 2.0))
    info["shm_ops_after"] = xcomm.shm.ops_run(group)
    return chk.items, digests, info


@pytest.mark.parametrize("world_size", [pytest.param(3, id="ws3"), pytest.param(4, id="ws4")])
def test_hierarchical_all_reduce_matches_gloo(world_size: int) -> None:
    """A group spanning two (logical) hosts: shm inside each, gloo between the
    leaders, shm broadcast back; same results as gloo, same bits everywhere."""
    results = run_ranks(_rank_hierarchical, world_size, env=SMALL_SLOTS, timeout=120)
    assert_no_mismatches([r[0] for r in results])
    _assert_ranks_agree([r[1] for r in results])
    for r in results:
        assert r[2]["transport"] == "xcomm-shm", r[2]
        assert r[2]["shm_ops_after"] > 200, r[2]


def _rank_hierarchical_compressed(ctx: RankContext, method: str) -> dict[str, Any]:
    import xcomm

    os.environ["XCOMM_SHM_HOST_TAG"] = f"host{ctx.rank // 2}"  # hosts {0, 1} and {2, 3}
    group = dist.new_group(
        backend="xcomm", pg_options=xcomm.Options(compression=method, compression_min_bytes=64)
    )
    backend = group._get_backend(torch.device("cpu"))
    out: dict[str, Any] = {"transport": backend.cpu_backend_name}
    for op_name, op in (("SUM", dist.ReduceOp.SUM), ("AVG", dist.ReduceOp.AVG)):
        for n in (3, 1000, 5000):  # 3 elements: under compression_min_bytes, exact
            torch.manual_seed(100 + ctx.rank)
            x = torch.randn(n) * (ctx.rank + 1)
            parts = [x.clone() for _ in range(ctx.world_size)]
            dist.all_gather(parts, x, group=ctx.ref)
            got = x.clone()
            dist.all_reduce(got, op=op, group=group)
            out[(op_name, n)] = (got, parts)
    out["stats"] = backend.compression_stats
    out["counted"] = {k: v["calls"] for k, v in xcomm.stats().items() if k.startswith("ALLREDUCE")}
    return out


@pytest.mark.parametrize("method", ["fp16", "bf16", "int8"])
def test_hierarchical_compresses_only_the_leaders_step(method: str) -> None:
    """Options(compression=...) in a group spanning two hosts: each host sums
    exactly in float32, only the leaders' allreduce is compressed. fp16/bf16:
    bitwise the cast of the two host sums added in low precision (what Gloo
    does); int8: within two quantisations of the exact sum. Every rank holds the
    same bits; small tensors stay exact."""
    per_rank = run_ranks(_rank_hierarchical_compressed, 4, method, timeout=120)
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(method)
    for key in [k for k in per_rank[0] if isinstance(k, tuple)]:
        op_name, n = key
        got, parts = per_rank[0][key]
        for r in per_rank[1:]:
            assert torch.equal(r[key][0], got), (key, "ranks differ")
        hosts = [parts[0] + parts[1], parts[2] + parts[3]]  # exact in float32 (two terms)
        exact = (hosts[0] + hosts[1]) / (4 if op_name == "AVG" else 1)
        if n == 3:
            assert torch.equal(got, exact), key
        elif low is not None:
            scaled = [h / 4 if op_name == "AVG" else h for h in hosts]
            expected = (scaled[0].to(low) + scaled[1].to(low)).float()
            assert torch.equal(got, expected), key
        else:
            bound = 2 * max(h.abs().max().item() for h in hosts) / 127 * 2
            bound /= 4 if op_name == "AVG" else 1
            assert (got - exact).abs().max().item() <= bound, key
            assert not torch.equal(got, exact), (key, "int8 left the sum exact: not compressed?")
    for rank, r in enumerate(per_rank):
        assert r["transport"] == "xcomm-shm"
        stats = r["stats"]
        assert stats["method"] == method, stats
        if rank % 2 == 0:  # a leader: 2 ops x 2 sizes over the threshold crossed hosts
            assert stats["calls"] == 4, stats
            assert 0 < stats["link_bytes_sent"] * 1.5 < stats["link_bytes_before"], stats
        else:  # its bytes never leave the host
            assert stats["calls"] == 0, stats
        # xcomm.stats() counts the compressed ops under the method on every rank
        # (the small ones as plain allreduces), as in a group compressing every step.
        assert r["counted"].get(f"ALLREDUCE_{method.upper()}") == 4, r["counted"]


def _rank_unavailable(ctx: RankContext) -> dict[str, Any]:
    import xcomm.shm

    t = torch.arange(10, dtype=torch.float32) + ctx.rank
    dist.all_reduce(t)
    return {"active": xcomm.shm.is_active(), "sum": t.tolist(), "files": _shm_files()}


def test_falls_back_to_gloo_when_the_segment_cannot_be_made() -> None:
    """A segment /dev/shm cannot hold (1 TiB slots): every rank keeps Gloo,
    results stay right, and nothing is left in /dev/shm."""
    res = run_ranks(_rank_unavailable, 2, env={"XCOMM_SHM_SLOT_BYTES": str(1 << 40)})
    expected = [2.0 * i + 1 for i in range(10)]
    for r in res:
        assert not r["active"] and r["sum"] == expected and r["files"] == [], res
    assert not _shm_files()


def _rank_departs(ctx: RankContext, leaver: int, fusion: bool) -> dict[str, Any] | None:
    import xcomm

    options = xcomm.Options(fusion_threshold_bytes=1 << 16 if fusion else 0)
    group = dist.new_group(backend="xcomm", pg_options=options)
    assert xcomm.shm.is_active(group)
    dist.all_reduce(torch.ones(8), group=group)  # the group works first
    if ctx.rank == leaver:
        time.sleep(0.5)  # the others wait in the all_reduce below by now
        left_at = time.time()
        dist.destroy_process_group(group)
        time.sleep(5)  # alive, elsewhere: its pid tells the others nothing
        return {"left_at": left_at}
    t = torch.ones(1000)
    t0 = time.monotonic()
    error = error_of(lambda: dist.all_reduce(t, group=group, async_op=fusion).wait())
    return {"error": error, "elapsed": time.monotonic() - t0, "failed_at": time.time()}


@pytest.mark.parametrize(
    ("world_size", "leaver", "fusion"),
    [(2, 1, False), (3, 0, False), (2, 1, True)],
    ids=["ws2", "ws3-rank0-leaves", "ws2-fusion"],
)
def test_a_peer_that_destroys_its_group_fails_the_others_at_once(
    world_size: int, leaver: int, fusion: bool
) -> None:
    """A rank that calls destroy_process_group() while its peers wait in a
    collective marks itself departed in the segment: they fail within a
    fraction of a second, naming it, instead of at the group's timeout (40 s
    here); they used to wait the whole timeout."""
    res = run_ranks(_rank_departs, world_size, leaver, fusion, timeout=90)
    left_at = res[leaver]["left_at"]
    for rank, r in enumerate(res):
        if rank == leaver:
            continue
        assert r["error"] is not None, r
        assert f"rank {leaver} (pid" in r["error"] and "left the group" in r["error"], r
        assert r["elapsed"] < 5, r
        assert r["failed_at"] - left_at < 1.0, r
