"""Fault injection: a peer dies in the middle of a collective.

The victim rank kills itself (``os._exit`` or SIGKILL) while the survivors
are blocked in (or about to enter) a collective; in one scenario it freezes
itself with SIGSTOP instead (a stalled peer: connections stay open, so only
the timeout can detect it).  Expected behaviour, for
every survivor:

* the collective raises an exception (no hang, no silent wrong result)
  within the process-group timeout (5 s) plus slack: elapsed < 30 s;
* a second collective on the same group also raises quickly (no hang);
* the survivor then tears down (``destroy_process_group``) and its
  interpreter exits with code 0 (fresh interpreters via the ``subprocess``
  launcher, so atexit / static destructors of the extension run).

The survivors report through their return value (harness result file); the
harness fails the test if a survivor hangs, crashes or exits non-zero.
Reference: none needed (the expected outcome is an exception).
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist

from dist_harness import BACKEND, RankContext, rank_scripts, run_ranks

PG_TIMEOUT = datetime.timedelta(seconds=5)
#: Upper bound on the time a survivor may take to notice the dead peer.
BOUND_S = 30.0
#: Collectives a survivor issues before giving up waiting for the failure.
MAX_TRIES = 20

How = Literal["os_exit", "sigkill", "sigstop"]
Where = Literal["all_reduce", "all_reduce_async_big", "recv", "barrier"]


def _die(how: How) -> None:
    """End the victim; ``sigstop`` freezes it instead (a stalled peer whose
    sockets stay open: only the timeout can detect it)."""
    if how == "os_exit":
        os._exit(17)
    os.kill(os.getpid(), signal.SIGSTOP if how == "sigstop" else signal.SIGKILL)
    time.sleep(3600)


def _op(where: Where, ctx: RankContext, victim: int) -> None:
    if where in ("all_reduce", "all_reduce_async_big"):
        size = 1 << 20 if where == "all_reduce_async_big" else 64
        t = torch.ones(size)
        dist.all_reduce(t, async_op=True).wait()
    elif where == "recv":
        dist.recv(torch.zeros(64), src=victim)
    else:
        dist.barrier()


def _op_name(where: Where) -> str:
    return "all_reduce" if where.startswith("all_reduce") else where


def _rank_fault(ctx: RankContext, victim: int, how: How, where: Where) -> dict[str, Any] | None:
    # Healthy warm-up: the group works before the fault.
    t = torch.ones(8)
    dist.all_reduce(t)
    assert t[0].item() == ctx.world_size

    if ctx.rank == victim:
        if where == "all_reduce_async_big":
            # Enter a few large collectives (data starts moving), die mid-flight.
            for _ in range(3):
                dist.all_reduce(torch.ones(1 << 20), async_op=True)
        else:
            time.sleep(0.5)  # the survivors are blocked in the collective by now
        _die(how)

    result: dict[str, Any] = {}
    # "first": repeat the op until it fails (with a big async all_reduce the
    # victim may complete some of them before it dies); "second": one more
    # call after the failure, which must fail too.
    for attempt, tries in (("first", MAX_TRIES), ("second", 1)):
        for i in range(tries):
            t0 = time.monotonic()
            try:
                _op(where, ctx, victim)
            except Exception as e:  # noqa: BLE001
                result[attempt] = {
                    "raised": True,
                    "iteration": i,
                    "elapsed": time.monotonic() - t0,
                    "error": f"{type(e).__name__}: {str(e)[:400]}",
                }
                break
        else:
            result[attempt] = {
                "raised": False,
                "iteration": tries,
                "elapsed": time.monotonic() - t0,
            }
    return result


SCENARIOS = [
    pytest.param(2, 1, "os_exit", "all_reduce", True, id="ws2-os_exit-all_reduce-pg_options"),
    pytest.param(
        3,
        2,
        "sigkill",
        "all_reduce_async_big",
        True,
        id="ws3-sigkill-big_all_reduce-pg_options",
        marks=pytest.mark.large_world,
    ),
    pytest.param(
        3,
        0,
        "sigkill",
        "barrier",
        False,
        id="ws3-sigkill-rank0-barrier-init_timeout",
        marks=pytest.mark.large_world,
    ),
    pytest.param(2, 0, "os_exit", "recv", False, id="ws2-os_exit-recv-init_timeout"),
    pytest.param(
        2, 1, "sigstop", "all_reduce", True, id="ws2-sigstop(stalled peer)-all_reduce-pg_options"
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "victim", "how", "where", "use_pg_options"), SCENARIOS)
def test_peer_dies_mid_collective(
    world_size: int, victim: int, how: How, where: Where, use_pg_options: bool
) -> None:
    """Every survivor raises within the bound (a DistBackendError naming the
    op), a second call raises too, and it exits cleanly."""
    t0 = time.monotonic()
    results = run_ranks(
        _rank_fault,
        world_size,
        victim,
        how,
        where,
        pg_timeout=PG_TIMEOUT,
        use_pg_options=use_pg_options,
        launcher="subprocess",
        may_die=[victim],
        timeout=90,
    )
    wall = time.monotonic() - t0
    problems: list[str] = []
    for rank, res in enumerate(results):
        if rank == victim:
            continue
        if res is None:
            problems.append(f"rank {rank}: no result")
            continue
        for attempt in ("first", "second"):
            info = res[attempt]
            if not info["raised"]:
                problems.append(
                    f"rank {rank} {attempt} {where}: {info['iteration']} call(s) returned normally "
                    "although a peer is dead (expected an exception)"
                )
            elif attempt == "first" and not (
                info["error"].startswith("DistBackendError") and _op_name(where) in info["error"]
            ):
                # Whichever route ran it (shared memory, the checked route,
                # raw Gloo for point to point): an error that names the op,
                # not a transport's bare text.
                problems.append(f"rank {rank}: the error does not name the op: {info['error']}")
            elif info["elapsed"] >= BOUND_S:
                problems.append(
                    f"rank {rank} {attempt} {where}: raised only after {info['elapsed']:.1f}s "
                    f"(bound {BOUND_S}s, pg timeout {PG_TIMEOUT.total_seconds()}s): {info['error']}"
                )
    assert not problems, "\n".join(problems) + f"\nall results: {results}"
    assert wall < 90


_SETUP_DEATH_SCRIPT = """
import datetime, os, sys, time
import torch.distributed as dist
import xcomm, xcomm.backend
from dist_harness import DelegatingStore  # tests/python is on PYTHONPATH

path, rank, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

class DiesInGlooSetUp(DelegatingStore):
    # Rank 0 has published its Gloo address and dies as it looks for rank 1's:
    # rank 1 then waits for a connection that never comes.
    def wait(self, keys, timeout=None):
        if rank == 0 and any("xcomm/gloo" in k and k.endswith("/1") for k in keys):
            os._exit(3)
        super().wait(keys, timeout)

store = DiesInGlooSetUp(dist.FileStore(path, 2))
options = xcomm.Options(timeout=datetime.timedelta(seconds=timeout_s), shm=False).to_cpp()
t0 = time.monotonic()
try:
    xcomm._C.build_group(store, rank, 2, options, xcomm.backend._gloo)
    print("built", flush=True)
except Exception as e:
    print(f"raised after {time.monotonic() - t0:.2f} s: {type(e).__name__}: {e}", flush=True)
"""


@pytest.mark.slow
def test_a_peer_lost_while_gloo_connects_is_reported_within_the_timeout(tmp_path: Any) -> None:
    """Rank 0 dies between publishing its Gloo address and connecting to
    rank 1, so rank 1's set-up waits in Gloo's connect for a peer that can
    no longer come. ``ProcessGroupGloo`` built directly waits five times its
    timeout there (Gloo's allowance for a first connection: 10 s at 2 s);
    xcomm's set-up raises within the group's timeout, a ``DistBackendError``
    that says which of its Gloo groups failed and why that is likely."""
    timeout_s = 2.0
    script = tmp_path / "rank.py"
    script.write_text(_SETUP_DEATH_SCRIPT)
    store = str(tmp_path / "store")
    with rank_scripts(script, [[store, str(r), str(timeout_s)] for r in range(2)]) as ranks:
        out, _ = ranks[1].communicate(timeout=60)
        ranks[0].wait(timeout=60)
    assert ranks[0].returncode == 3, "rank 0 did not die where the test put it"
    # Gloo logs its own error on stderr too, on a line of its own or not.
    assert "raised after " in out, out
    line = out[out.index("raised after ") :].splitlines()[0]
    elapsed = float(line.split()[2])
    # Rank 1 waits in Gloo's connect ("Connect timeout"), or, when its pair
    # connected before rank 0 died, for rank 0's address of the next Gloo
    # group ("Wait timeout"; a FileStore's wait overshoots by about 1 s):
    # one wait of the timeout either way, where Gloo's own allowance is 10 s.
    assert "Connect timeout" in line or "Wait timeout" in line, out
    named = "DistBackendError: xcomm: setting up the group failed in its Gloo group xcomm/gloo"
    assert line.split(" s: ", 1)[1].startswith(named), out
    assert "on rank 1 of 2 (a peer died" in line, out
    assert timeout_s - 0.1 <= elapsed <= timeout_s + 2.5, out


def _collectives_under_lazy_gloo(ctx: RankContext) -> dict[str, Any]:
    import xcomm

    out: dict[str, Any] = {"lazy": os.environ.get("TORCH_GLOO_LAZY_INIT")}
    for shm in (False, True):
        group = dist.new_group(backend=BACKEND, pg_options=xcomm.Options(shm=shm))
        summed = torch.full((70_000,), float(ctx.rank + 1))
        dist.all_reduce(summed, group=group)
        sent = torch.full((10,), float(ctx.rank))
        dist.broadcast(sent, src=1, group=group)
        out[xcomm.group_plan(group)["shape"]] = (summed.unique().tolist(), sent.unique().tolist())
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_groups_build_and_run_under_torch_gloo_lazy_init(world: int) -> None:
    """Under ``TORCH_GLOO_LAZY_INIT=1`` Gloo's pairs connect at their first
    use. xcomm's Gloo groups connect every pair at set-up all the same (one
    all-to-all, while the set-up's store wrapper is alive: the pairs read
    their peers' addresses through it), each on a Gloo device of its own
    (two groups on one device failed to connect lazily, Gloo alone too).
    Before, a plain group's first all_reduce failed after the timeout."""
    results = run_ranks(_collectives_under_lazy_gloo, world, env={"TORCH_GLOO_LAZY_INIT": "1"})
    for r in results:
        assert r["lazy"] == "1", r
        for shape in ("plain", "single-host shared memory"):
            assert r[shape] == ([float(sum(range(1, world + 1)))], [1.0]), r
