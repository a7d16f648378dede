"""``dist.shrink_group`` on xcomm: the survivors go on without the excluded ranks.

No built-in CPU backend of torch implements ``shrink`` (only NCCL does). An
xcomm group builds its survivors' group the way it builds any group
(``GroupBuilder``, over a fresh namespace of the group's store), without the
excluded ranks taking part, so every shape works: plain (checked Gloo),
single-host shared memory and hierarchical, with the survivors' own shape.

Reference: a group created from scratch for the same survivors
(``dist.new_group(ranks=survivors)``, same options): the shrunk group must
have its plan and give its all_reduce results, bit for bit.

Faults: a rank SIGKILLed, or SIGSTOPped past the timeout (frozen, its sockets
open), while the others are inside an all_reduce, an all_to_all or an int8
compressed all_reduce, on each route: the survivors' op fails, they shrink
the lost rank out and their next op is right; no segment is left in /dev/shm.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import SHRINK_ABORT

from dist_harness import BACKEND, RankContext, error_of, run_ranks

# Host tags per shape (XCOMM_SHM_HOST_TAG): what the group builder sees as hosts.
SINGLE_HOST = "single-host shared memory"
SHAPES = {
    "plain": {"options": {"shm": False}, "hosts": None},
    "single-host shared memory": {"options": {}, "hosts": None},
    "hierarchical": {"options": {}, "hosts": "halves"},
}


def _host_tag(rank: int, world: int, hosts: str | None) -> str:
    return "" if hosts is None else ("a" if rank < (world + 1) // 2 else "b")


def _allreduces_since(before: int, expected: int) -> int:
    """ALLREDUCE calls counted by xcomm.stats() since `before`, once `expected`
    arrived or after a second: a count lands when the op's completion runs,
    which may be just after wait() returned."""
    import xcomm

    deadline = time.monotonic() + 1.0
    while True:
        got = xcomm.stats()["ALLREDUCE"]["calls"] - before
        if got >= expected or time.monotonic() > deadline:
            return got
        time.sleep(0.005)


def _shrink_every_shape(ctx: RankContext) -> dict[str, Any]:
    import xcomm

    world = ctx.world_size
    out: dict[str, Any] = {}
    # Every group first: torch 2.14 numbers the groups a shrink makes on the
    # survivors alone, so a new_group after it would pair different groups.
    made = []
    for shape, spec in SHAPES.items():
        os.environ["XCOMM_SHM_HOST_TAG"] = _host_tag(ctx.rank, world, spec["hosts"])
        options = xcomm.Options(timeout=datetime.timedelta(seconds=60), **spec["options"])
        for excluded in sorted({0, world // 2, world - 1}):
            survivors = [r for r in range(world) if r != excluded]
            group = dist.new_group(backend=BACKEND, pg_options=options)
            reference = dist.new_group(ranks=survivors, backend=BACKEND, pg_options=options)
            made.append((shape, spec, excluded, survivors, group, reference))
    for shape, spec, excluded, survivors, group, reference in made:
        # The survivors' group is built at the shrink: with their hosts as they were.
        os.environ["XCOMM_SHM_HOST_TAG"] = _host_tag(ctx.rank, world, spec["hosts"])
        key = f"{shape}/exclude{excluded}"
        if ctx.rank == excluded:
            out[key] = {"excluded": True}
            continue
        parent_plan = xcomm.group_plan(group)["shape"]
        backend = group._get_backend(torch.device("cpu"))
        supports = bool(backend.supports_shrinking)
        started = time.monotonic()
        shrunk = dist.shrink_group([excluded], group=group)
        shrink_s = time.monotonic() - started
        calls_before = xcomm.stats().get("ALLREDUCE", {}).get("calls", 0)
        # Every survivor's data differs; 70_000 floats run the bulk path of each route.
        data = torch.arange(70_000, dtype=torch.float32) * (ctx.rank + 1) + ctx.rank
        got = data.clone()
        dist.all_reduce(got, group=shrunk)
        want = data.clone()
        dist.all_reduce(want, group=reference)
        out[key] = {
            "excluded": False,
            "parent_shape": parent_plan,
            "supports_shrinking": supports,
            "shrink_s": shrink_s,
            "rank": shrunk.rank(),
            "size": shrunk.size(),
            "plan": xcomm.group_plan(shrunk)["shape"],
            "reference_plan": xcomm.group_plan(reference)["shape"],
            "equal": torch.equal(got, want),
            "expected_sum": torch.equal(
                got,
                sum(torch.arange(70_000, dtype=torch.float32) * (r + 1) + r for r in survivors),
            ),
            "allreduces": _allreduces_since(calls_before, 2),
            "backend": shrunk._get_backend(torch.device("cpu")).__class__.__name__,
        }
        dist.destroy_process_group(shrunk)
    return out


# every_case: torch's own shrink_group (Python) at each size, on every torch.
@pytest.mark.every_case
@pytest.mark.parametrize("world", [3, 4])
def test_shrink_group_excluding_first_middle_and_last_on_every_shape(world: int) -> None:
    results = run_ranks(_shrink_every_shape, world, timeout=240)
    for shape in SHAPES:
        for excluded in sorted({0, world // 2, world - 1}):
            key = f"{shape}/exclude{excluded}"
            survivors = [r for r in range(world) if r != excluded]
            for rank, result in enumerate(results):
                r = result[key]
                if rank == excluded:
                    assert r["excluded"], (key, r)
                    continue
                assert r["parent_shape"] == shape, (key, r)
                assert r["supports_shrinking"], (key, r)
                # The survivors keep their order: the new rank is the position among them.
                assert (r["rank"], r["size"]) == (survivors.index(rank), world - 1), (key, r)
                assert r["backend"] == "XcommBackend", (key, r)
                # The survivors' shape, as a group created for them from scratch has it.
                assert r["plan"] == r["reference_plan"], (key, r)
                assert r["equal"] and r["expected_sum"], (key, r)
                # The new group's all_reduce ran on xcomm (the reference's counts as one more).
                assert r["allreduces"] == 2, (key, r)


def _segments_of(pids: list[int]) -> list[str]:
    """Shared-memory segments in /dev/shm created by these processes (the
    creator's pid is in the name: xcomm-shm-<pid ns>-<pid>-...)."""
    return sorted(
        n
        for n in os.listdir("/dev/shm")
        for pid in pids
        if n.startswith("xcomm-shm-") and f"-{pid}-" in n
    )


def _survivors_shrink_after_a_fault(
    ctx: RankContext, route: str, hosts: str | None, op: str, fault: str
) -> dict[str, Any] | None:
    """The last rank is SIGKILLed (or SIGSTOPped: frozen, its sockets open)
    while the others are inside `op`; they shrink it out and go on."""
    import xcomm

    timeout = datetime.timedelta(seconds=20 if fault == "kill" else 3)
    os.environ["XCOMM_SHM_HOST_TAG"] = _host_tag(ctx.rank, ctx.world_size, hosts)
    options = xcomm.Options(
        timeout=timeout, shm=route != "plain", compression="int8" if op == "int8" else None
    )
    group = dist.new_group(backend=BACKEND, pg_options=options)
    Path(ctx.tmpdir, f"pid_{ctx.rank}").write_text(str(os.getpid()))
    dist.all_reduce(torch.ones(4), group=group)
    world, victim = ctx.world_size, ctx.world_size - 1
    pids = [int(Path(ctx.tmpdir, f"pid_{r}").read_text()) for r in range(world)]
    if ctx.rank == victim:
        time.sleep(0.3)  # the survivors are inside the op by then
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        time.sleep(60)  # SIGSTOP: the survivors SIGKILL it once they went on

    def run_op(g: dist.ProcessGroup, size: int) -> bool:
        """`op` over `g` of `size` ranks, with each rank's data; whether it came out right."""
        n = 1 << 18
        if op == "all_to_all":
            data = torch.arange(n, dtype=torch.float32) + 1000 * ctx.rank
            got = torch.empty_like(data)
            dist.all_to_all_single(got, data, group=g)
            chunk = n // size
            me = g.rank()
            want = torch.cat(
                [
                    torch.arange(me * chunk, (me + 1) * chunk, dtype=torch.float32) + 1000 * src
                    for src in range(size)
                ]
            )
            return torch.equal(got, want)
        data = torch.full((n,), float(ctx.rank + 1))
        dist.all_reduce(data, group=g)
        members = [r for r in range(world) if r != victim] if size < world else range(world)
        expected = float(sum(r + 1 for r in members))
        if op == "int8":  # lossy, but a constant block is coded exactly up to rounding
            return torch.allclose(data, torch.full_like(data, expected), rtol=1e-2)
        return bool((data == expected).all())

    error = error_of(lambda: run_op(group, world))
    failed_at = time.monotonic()
    shrunk = dist.shrink_group([victim], group=group, shrink_flags=SHRINK_ABORT)
    correct = run_op(shrunk, world - 1)
    recovered_s = time.monotonic() - failed_at
    if fault == "stop" and ctx.rank == 0:
        os.kill(pids[victim], signal.SIGKILL)
    out = {
        "error": error,
        "recovered_s": recovered_s,
        "correct": correct,
        "size": shrunk.size(),
        # Counted by each backend (xcomm.stats() leaves out a hierarchical leader's step).
        "int8_calls": [
            g._get_backend(torch.device("cpu")).compression_stats["calls"] for g in (group, shrunk)
        ],
        "segments": _segments_of(pids),
        "shapes": [xcomm.group_plan(g)["shape"] for g in (group, shrunk)],
    }
    dist.destroy_process_group(shrunk)
    return out


# Each case costs a few seconds: a spread over the routes rather than every pair.
FAULT_CASES = [
    ("plain", "all_reduce", "kill"),
    ("shared-memory", "all_reduce", "kill"),
    ("shared-memory", "all_to_all", "kill"),
    ("plain", "all_to_all", "kill"),
    ("plain", "int8", "kill"),
    ("shared-memory", "int8", "kill"),
    ("shared-memory", "all_reduce", "stop"),
    ("plain", "all_reduce", "stop"),
    ("hierarchical", "all_reduce", "kill"),
    ("hierarchical", "int8", "kill"),
]
SHAPE_OF = {"plain": "plain", "shared-memory": SINGLE_HOST, "hierarchical": "hierarchical"}


@pytest.mark.parametrize(
    "route,op,fault", FAULT_CASES, ids=["-".join(case) for case in FAULT_CASES]
)
def test_survivors_of_a_lost_rank_shrink_and_go_on(route: str, op: str, fault: str) -> None:
    # Hierarchical: 4 ranks on two hosts of two; the victim leaves one behind.
    world = 4 if route == "hierarchical" else 3
    hosts = "halves" if route == "hierarchical" else None
    results = run_ranks(
        _survivors_shrink_after_a_fault,
        world,
        route,
        hosts,
        op,
        fault,
        timeout=120,
        may_die=[world - 1],
    )
    assert results[world - 1] is None
    for r in results[: world - 1]:
        assert r is not None
        assert r["error"] is not None, r  # the op the victim left failed, on every survivor
        assert r["correct"] and r["size"] == world - 1, r
        assert r["shapes"] == [SHAPE_OF[route]] * 2, r
        # Rebuilt at once, not after the 20 s group timeout (a frozen rank: the 3 s one).
        assert r["recovered_s"] < 10, r
        # The survivors' new segment was unlinked as soon as they had mapped it.
        assert r["segments"] == [], r
    if op == "int8":  # the compressed path ran (on a hierarchical group: by the hosts' leaders)
        leaders = [0, 2] if route == "hierarchical" else range(world - 1)
        assert all(results[rank]["int8_calls"][1] == 1 for rank in leaders), results


def _disagreeing_exclusions(ctx: RankContext) -> dict[str, Any]:
    import xcomm

    group = dist.new_group(
        backend=BACKEND, pg_options=xcomm.Options(timeout=datetime.timedelta(seconds=30))
    )
    backend = group._get_backend(torch.device("cpu"))
    excluded = [3] if ctx.rank < 2 else [1]  # ranks 2 and 3 think rank 1 left
    error = error_of(lambda: backend.shrink(excluded, 0, None))
    # The group was not touched: it still works.
    ones = torch.ones(3)
    dist.all_reduce(ones, group=group)
    return {"error": error, "sum": ones[0].item()}


def test_survivors_that_disagree_on_whom_to_exclude_get_a_value_error() -> None:
    results = run_ranks(_disagreeing_exclusions, 4, timeout=120)
    for r in results:
        assert r["error"] is not None and "ValueError" in r["error"], r
        assert "every survivor must exclude the same ranks" in r["error"], r
        assert r["sum"] == 4.0, r


def _shrinks_of_a_group_made_again_over_its_store(ctx: RankContext) -> dict[int, float]:
    """Two groups of one name over one store, one after the other (as
    destroy_process_group() + init_process_group() make them), each shrinking
    a different rank out. Rank 1 comes late to the second shrink, so rank 2
    reads rank 1's exclusion list before rank 1 writes it: where the first
    group's list is still in the store under the same key, rank 2 took it."""
    from types import SimpleNamespace

    import xcomm
    from xcomm.backend import create_backend

    store = dist.FileStore(os.path.join(ctx.tmpdir, "one-store"), ctx.world_size)
    timeout = datetime.timedelta(seconds=30)
    sums: dict[int, float] = {}
    for excluded in (2, 0):
        made = SimpleNamespace(
            store=dist.PrefixStore("same-name", store),
            group_rank=ctx.rank,
            group_size=ctx.world_size,
            timeout=timeout,
            group_id="same-name",
        )
        group = create_backend(made, xcomm.Options(shm=False, timeout=timeout))
        if ctx.rank != excluded:
            if (ctx.rank, excluded) == (1, 0):
                time.sleep(0.5)
            shrunk = group.shrink([excluded], 0, None)
            got = torch.full((4,), float(ctx.rank + 1))
            shrunk.allreduce([got]).wait()
            sums[excluded] = got[0].item()
            del shrunk
        dist.barrier()  # every rank done with this group before the next is made
        del group
    return sums


def test_a_group_made_again_over_the_same_store_shrinks_by_its_own_lists() -> None:
    results = run_ranks(_shrinks_of_a_group_made_again_over_its_store, 3, timeout=120)
    assert results[0] == {2: 3.0}  # ranks 0 and 1: 1 + 2
    assert results[1] == {2: 3.0, 0: 5.0}
    assert results[2] == {0: 5.0}  # ranks 1 and 2: 2 + 3


def _bad_shrink_calls(ctx: RankContext) -> dict[str, str | None]:
    import xcomm

    group = dist.new_group(backend=BACKEND, pg_options=xcomm.Options(shm=False))
    backend = group._get_backend(torch.device("cpu"))
    errors = {
        "self": error_of(lambda: backend.shrink([ctx.rank], 0, None)),
        "out_of_range": error_of(lambda: backend.shrink([5], 0, None)),
        "twice": error_of(lambda: backend.shrink([1 - ctx.rank, 1 - ctx.rank], 0, None)),
        "flags": error_of(lambda: backend.shrink([1 - ctx.rank], 4, None)),
        "options": error_of(lambda: backend.shrink([1 - ctx.rank], 0, "fast")),
    }
    # Every call above is refused locally: without an op on the group, a rank
    # could exit while its peer is still connecting the group's Gloo, and
    # the peer's set-up would fail (seen once under CI's load). The group
    # still works after the refusals.
    dist.barrier(group=group)
    return errors


def test_bad_shrink_calls_raise_value_errors_naming_the_problem() -> None:
    for r in run_ranks(_bad_shrink_calls, 2, timeout=60):
        assert "ValueError" in r["self"] and "among the excluded" in r["self"], r
        assert "ValueError" in r["out_of_range"] and "not in this group" in r["out_of_range"], r
        assert "ValueError" in r["twice"] and "excluded twice" in r["twice"], r
        assert "ValueError" in r["flags"] and "unknown shrink flags" in r["flags"], r
        assert "ValueError" in r["options"] and "xcomm.Options" in r["options"], r


def _ddp_goes_on_after_a_shrink(ctx: RankContext, method: str) -> dict[str, Any] | None:
    """DDP with a compressed hook over 3 ranks; rank 2 is gone at step 4. The
    survivors' backward fails, they shrink, and wrap the same module in a new
    DDP over the survivors' group with a new hook state (the documented
    semantics: residuals, PowerSGD's P and Q, auto's measurements start
    afresh). Reference: a DDP over a group created for the survivors from the
    start, on a copy of the module and optimizer taken at the failure."""
    import copy
    import gc
    import weakref

    from torch.nn.parallel import DistributedDataParallel as DDP

    import xcomm
    from ddp_helpers import flat_params, small_mlp
    from xcomm import hooks

    group = dist.new_group(
        backend=BACKEND, pg_options=xcomm.Options(timeout=datetime.timedelta(seconds=20))
    )
    reference_group = dist.new_group(ranks=[0, 1], backend=BACKEND)

    def hooked(module: torch.nn.Module, pg: dist.ProcessGroup) -> tuple[DDP, Any]:
        ddp = DDP(module, process_group=pg, bucket_cap_mb=0.001)
        if method == "int8":
            state: Any = hooks.Int8State(process_group=pg)
            ddp.register_comm_hook(state, hooks.int8_compress_hook)
        else:
            state = hooks.PowerSGDState(pg, matrix_approximation_rank=2, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, hooks.powersgd_hook)
        return ddp, state

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 * ctx.rank + step)
        return torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)

    def step_of(ddp: DDP, opt: torch.optim.Optimizer, step: int) -> None:
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    torch.manual_seed(0)
    module = small_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ddp, state = hooked(module, group)
    failed_at, error, reference = None, None, None
    for step in range(1, 11):
        if step == 4 and ctx.rank == 2:
            os._exit(0)
        if reference is not None:
            step_of(*reference, step)
        try:
            step_of(ddp, opt, step)
            continue
        except Exception as e:  # noqa: BLE001 - the lost rank's error, expected once
            failed_at, error = step, f"{type(e).__name__}: {e}"
        # Out of the except block: its traceback holds the old DDP's frames, and
        # the old DDP must be gone (its autograd hooks leave the parameters
        # with it) before the module is wrapped again.
        shrunk = dist.shrink_group([2], group=group, shrink_flags=SHRINK_ABORT)
        old = weakref.ref(ddp)
        del ddp
        gc.collect()
        assert old() is None, "the failed DDP is still alive"
        reference_module = small_mlp()
        reference_module.load_state_dict(module.state_dict())
        reference_opt = torch.optim.SGD(reference_module.parameters(), lr=0.1, momentum=0.9)
        # A copy: load_state_dict keeps the momentum buffers it is given.
        reference_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        ddp, state = hooked(module, shrunk)
        reference = hooked(reference_module, reference_group)[0], reference_opt
        step_of(ddp, opt, step)  # the failed step again, now over the survivors
        step_of(*reference, step)
    assert reference is not None
    return {
        "failed_at": failed_at,
        "error": error,
        "params": flat_params(module),
        "reference": flat_params(reference[0].module),
        "hook_calls": state.stats.calls,
        "size": ddp.process_group.size(),
    }


@pytest.mark.parametrize("method", ["int8", "powersgd"])
def test_ddp_with_a_compressed_hook_goes_on_after_a_shrink(method: str) -> None:
    results = run_ranks(
        _ddp_goes_on_after_a_shrink, 3, method, timeout=180, may_die=[2], destroy=False
    )
    assert results[2] is None
    for r in results[:2]:
        assert r is not None
        assert r["failed_at"] == 4 and r["error"], r
        assert r["size"] == 2
        assert r["hook_calls"] > 0, r  # the new state's hook compressed after the shrink
        assert torch.equal(r["params"], r["reference"]), method
    assert torch.equal(results[0]["params"], results[1]["params"])
