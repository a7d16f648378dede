"""CUDA tensors through xcomm, against NCCL (runs where a GPU is visible).

Reference for every test: a plain NCCL group (``dist.new_group(backend="nccl")``)
over the same ranks, fed the same inputs. xcomm hands CUDA tensors to its
inner NCCL group, so its results must equal NCCL's bit for bit; a call NCCL
refuses, xcomm must refuse too.

* collectives: every collective, reduce op and dtype NCCL takes, sync, async
  (``work.wait()``) and through ``get_future()``;
* DDP on CUDA: no hook and torch's own hooks over xcomm equal the same over
  NCCL bit for bit; each of xcomm's hooks over xcomm equals the same hook over
  NCCL bit for bit, and stays close to uncompressed training.

World size 1 always runs. World size 2 runs on one GPU where NCCL accepts two
ranks on it (probed once); otherwise it is skipped with NCCL's own error as
the reason. Two ways are tried at once: ``NCCL_MULTI_RANK_GPU_ENABLE=1``
(NCCL 2.30+), and a host id of its own per rank (``NCCL_HOSTID``), with which
older NCCL takes the ranks for two hosts (its duplicate-GPU check compares
host and bus id) and joins them with its socket transport over loopback.

Without a GPU the module is skipped, unless ``XCOMM_GPU_TESTS_ON_CPU=1``:
then the same tests run on CPU tensors with gloo as the reference (CI does
this, so the tests themselves cannot rot; a visible GPU always wins).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from dist_harness import RankContext, RankError, error_of, run_ranks

ON_CPU = os.environ.get("XCOMM_GPU_TESTS_ON_CPU") == "1" and not torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or ON_CPU), reason="needs a GPU (or XCOMM_GPU_TESTS_ON_CPU=1)"
)
REF_BACKEND = "gloo" if ON_CPU else "nccl"
#: NCCL 2.30+ accepts several ranks on one GPU only when asked to; older NCCL
#: when each rank seems to be on a host of its own, joined by sockets on lo.
ENV = {
    "NCCL_MULTI_RANK_GPU_ENABLE": "1",
    "NCCL_HOSTID": "xcomm-gpu-test-rank-{rank}",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
}
TIMEOUT = 180.0


def _device() -> torch.device:
    if ON_CPU:
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _probe(ctx: RankContext) -> None:
    _device()
    t = torch.ones(4, device=_device())
    dist.all_reduce(t)
    assert t[0].item() == ctx.world_size


@functools.cache
def _two_ranks_refused() -> str | None:
    """Why two ranks cannot share the GPU here (None: they can)."""
    try:
        # A short limit: if the two ranks cannot connect, skipping beats waiting.
        run_ranks(_probe, 2, backend=REF_BACKEND, ref_group=False, env=ENV, timeout=60.0)
    except RankError as e:
        return str(e).splitlines()[0][:300]
    return None


def _world(n: int) -> int:
    if n > 1 and (why := _two_ranks_refused()) is not None:
        pytest.skip(f"NCCL refuses {n} ranks on one GPU: {why}")
    return n


WORLDS = [1, 2]

# -- collectives --------------------------------------------------------------

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = [torch.int32, torch.int64, torch.uint8, torch.int8]
OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def _input(
    ctx: RankContext, dtype: torch.dtype, n: int, salt: int, dev: torch.device
) -> torch.Tensor:
    g = ctx.generator(salt)
    if dtype.is_floating_point:
        t = torch.randn(n, generator=g)
    else:
        low = 0 if dtype == torch.uint8 else -3
        t = torch.randint(low, 4, (n,), generator=g)
    return t.to(dtype).to(dev)


def _compare(
    problems: list[str], what: str, run: Callable[[Any], list[torch.Tensor]], ref: Any
) -> None:
    """Runs ``run(group)`` on xcomm (the default group) and on ``ref``."""
    got: dict[str, Any] = {}
    for label, group in (("xcomm", None), ("reference", ref)):
        try:
            got[label] = run(group)
        except Exception as e:  # noqa: BLE001 - compared below
            got[label] = e
    x, r = got["xcomm"], got["reference"]
    if isinstance(r, Exception):
        if not isinstance(x, Exception):
            problems.append(f"{what}: {REF_BACKEND} raised {type(r).__name__}, xcomm did not")
        return
    if isinstance(x, Exception):
        problems.append(f"{what}: xcomm raised {type(x).__name__}: {str(x).splitlines()[0][:160]}")
        return
    for i, (a, b) in enumerate(zip(x, r, strict=True)):
        if a.device != b.device or a.dtype != b.dtype or not torch.equal(a, b):
            problems.append(f"{what}[{i}]: differs ({a.device}/{a.dtype} vs {b.device}/{b.dtype})")


def _collectives(ctx: RankContext, n: int) -> list[str]:
    dev, ws, rank = _device(), ctx.world_size, ctx.rank
    ref = dist.new_group(backend=REF_BACKEND)
    problems: list[str] = []
    for dtype in FLOATS + INTS:
        for name, op in OPS.items():
            if ON_CPU and name == "avg" and not dtype.is_floating_point:
                continue  # gloo refuses; xcomm averages integers as NCCL does (test_collectives)
            for mode in ("sync", "async", "future"):

                def allreduce(group: Any, dtype=dtype, op=op, mode=mode) -> list[torch.Tensor]:
                    t = _input(ctx, dtype, n, 1, dev)
                    if mode == "sync":
                        dist.all_reduce(t, op=op, group=group)
                        return [t]
                    work = dist.all_reduce(t, op=op, group=group, async_op=True)
                    if mode == "async":
                        work.wait()
                        return [t]
                    return list(work.get_future().wait())

                _compare(problems, f"all_reduce {name} {dtype} {mode}", allreduce, ref)

        def broadcast(group: Any, dtype=dtype) -> list[torch.Tensor]:
            outs = []
            for root in sorted({0, ws - 1}):
                t = _input(ctx, dtype, n, 2, dev)
                dist.broadcast(t, src=root, group=group)
                outs.append(t)
            return outs

        def reduce(group: Any, dtype=dtype) -> list[torch.Tensor]:
            t = _input(ctx, dtype, n, 3, dev)
            dist.reduce(t, dst=ws - 1, op=dist.ReduceOp.SUM, group=group)
            return [t] if rank == ws - 1 else []

        def all_gather(group: Any, dtype=dtype) -> list[torch.Tensor]:
            t = _input(ctx, dtype, n, 4, dev)
            flat = torch.empty(n * ws, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(flat, t, group=group)
            parts = [torch.empty_like(t) for _ in range(ws)]
            dist.all_gather(parts, t, group=group)
            return [flat, *parts]

        def reduce_scatter(group: Any, dtype=dtype) -> list[torch.Tensor]:
            t = _input(ctx, dtype, n * ws, 5, dev)
            out = torch.empty(n, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, t, op=dist.ReduceOp.SUM, group=group)
            return [out]

        def all_to_all(group: Any, dtype=dtype) -> list[torch.Tensor]:
            t = _input(ctx, dtype, n * ws, 6, dev)
            out = torch.empty_like(t)
            dist.all_to_all_single(out, t, group=group)
            return [out]

        def gather_scatter(group: Any, dtype=dtype) -> list[torch.Tensor]:
            t = _input(ctx, dtype, n, 7, dev)
            parts = [torch.empty_like(t) for _ in range(ws)] if rank == 0 else None
            dist.gather(t, parts, dst=0, group=group)
            got = torch.empty_like(t)
            src = [_input(ctx, dtype, n, 8 + i, dev) for i in range(ws)] if rank == 0 else None
            dist.scatter(got, src, src=0, group=group)
            return [*(parts or []), got]

        for fn in (broadcast, reduce, all_gather, reduce_scatter, all_to_all, gather_scatter):
            _compare(problems, f"{fn.__name__} {dtype}", fn, ref)

    if ws == 2:

        def send_recv(group: Any) -> list[torch.Tensor]:
            t = _input(ctx, torch.float32, n, 9, dev)
            peer = 1 - rank
            if rank == 0:
                dist.send(t, peer, group=group)
                dist.recv(t, peer, group=group)
            else:
                got = torch.empty_like(t)
                dist.recv(got, peer, group=group)
                dist.send(got * 2, peer, group=group)
            return [t]

        _compare(problems, "send/recv", send_recv, ref)
    dist.barrier()
    return problems


@pytest.mark.parametrize("n", [17, 1 << 20], ids=["17", "1M"])
@pytest.mark.parametrize("world", WORLDS)
def test_every_collective_equals_the_reference(world: int, n: int) -> None:
    results = run_ranks(_collectives, _world(world), n, ref_group=False, env=ENV, timeout=TIMEOUT)
    problems = sorted({p for r in results for p in r})
    assert not problems, f"{len(problems)} mismatches:\n" + "\n".join(problems[:40])


# -- compression inside the backend --------------------------------------------

_CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _backend_casts(ctx: RankContext, n: int) -> list[str]:
    """``xcomm.Options(compression="bf16"/"fp16")`` on device tensors: the
    all_reduce and reduce_scatter_tensor results equal the cast, the
    reference's own low-precision SUM and the cast back, done by hand over
    the reference group; the result stays on the device and the group
    counts what it compressed."""
    import xcomm

    dev, ws = _device(), ctx.world_size
    ref = dist.new_group(backend=REF_BACKEND)
    problems: list[str] = []
    for method, low in _CASTS.items():
        group = dist.new_group(
            backend="xcomm", pg_options=xcomm.Options(compression=method, compression_min_bytes=0)
        )
        for name in ("sum", "avg"):
            op = OPS[name]
            for mode in ("sync", "async", "future"):
                x = _input(ctx, torch.float32, n, 11, dev)
                got = x.clone()
                work = dist.all_reduce(got, op=op, group=group, async_op=mode != "sync")
                if mode == "async":
                    work.wait()
                elif mode == "future":
                    got = work.get_future().wait()[0]
                wire = (x / ws if name == "avg" else x).to(low)
                dist.all_reduce(wire, group=ref)
                if got.device != dev or not torch.equal(got, wire.to(torch.float32)):
                    problems.append(f"all_reduce {method} {name} {mode}: differs from the cast")
            x = _input(ctx, torch.float32, n * ws, 12, dev)
            got = torch.empty(n, device=dev)
            dist.reduce_scatter_tensor(got, x, op=op, group=group)
            rows = x.reshape(ws, n).to(low)
            received = torch.empty_like(rows)
            dist.all_to_all_single(received, rows, group=ref)
            want = received[0].to(torch.float32)
            for j in range(1, ws):
                want.add_(received[j])  # rank order, in float32: as the backend sums
            if name == "avg":
                want.div_(ws)
            if got.device != dev or not torch.equal(got, want):
                problems.append(f"reduce_scatter_tensor {method} {name}: differs from the cast")
        stats = group._get_backend(dev).compression_stats
        if not 0 < stats["link_bytes_sent"] < stats["link_bytes_before"]:
            problems.append(f"{method}: the group counted no compressed bytes: {stats}")
    dist.barrier()
    return problems


def _backend_int8(ctx: RankContext, n: int) -> list[str]:
    """``xcomm.Options(compression="int8")`` on device tensors: all_reduce (sync,
    async, future; SUM and AVG; float32, float64 and a non-contiguous view)
    and reduce_scatter_tensor equal the same group's int8 on CPU copies bit
    for bit (the CUDA kernels compute the CPU codec's bits and NCCL only moves
    bytes), stay on the device, and are within int8's error of the exact
    result; the group counts compressed bytes for its device route."""
    import xcomm

    dev, ws = _device(), ctx.world_size
    cpu = torch.device("cpu")
    group = dist.new_group(
        backend="xcomm",
        pg_options=xcomm.Options(compression="int8", compression_min_bytes=0, int8_chunk_elems=256),
    )
    problems: list[str] = []

    def check(what: str, got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor) -> None:
        if got.device != dev or got.dtype != want.dtype:
            problems.append(f"{what}: {got.device}/{got.dtype}, expected {dev}/{want.dtype}")
        elif not torch.equal(got.cpu(), want):
            diff = (got.cpu() - want).abs().max().item()
            problems.append(f"{what}: differs from int8 on the CPU (max |diff| {diff:.3g})")
        # One chunk's scale is its max |x| / 127: each of ws rounding errors,
        # then the reduced shard's own, stays within ws + 1 such steps.
        bound = (ws + 1) * exact.abs().max().item() / 127
        if (got.cpu().double() - exact.double()).abs().max().item() > bound:
            problems.append(f"{what}: error beyond int8's rounding")

    for name in ("sum", "avg"):
        op = OPS[name]
        for dtype in (torch.float32, torch.float64):
            for mode in ("sync", "async", "future", "strided"):
                x = _input(ctx, dtype, 2 * n + 3, 21, cpu)
                want = x.clone()
                dist.all_reduce(want, op=op, group=group)  # the CPU route
                exact = x.clone()
                dist.all_reduce(exact, op=op)  # the default group, uncompressed
                if mode == "strided":
                    base = x.to(dev).repeat_interleave(2)
                    got = base[::2]  # a non-contiguous view of the same values
                    dist.all_reduce(got, op=op, group=group)
                else:
                    got = x.to(dev)
                    work = dist.all_reduce(got, op=op, group=group, async_op=mode != "sync")
                    if mode == "async":
                        work.wait()
                    elif mode == "future":
                        got = work.get_future().wait()[0]
                check(f"all_reduce int8 {name} {dtype} {mode}", got, want, exact)
        x = _input(ctx, torch.float32, n * ws, 22, cpu)
        want = torch.empty(n)
        dist.reduce_scatter_tensor(want, x, op=op, group=group)
        exact = torch.empty(n)
        dist.reduce_scatter_tensor(exact, x, op=op)
        got = torch.empty(n, device=dev)
        dist.reduce_scatter_tensor(got, x.to(dev), op=op, group=group)
        check(f"reduce_scatter_tensor int8 {name}", got, want, exact)
    if dev.type == "cuda":
        stats = group._get_backend(dev).compression_stats
        if not 0 < stats["link_bytes_sent"] < stats["link_bytes_before"]:
            problems.append(f"int8: the group counted no compressed bytes: {stats}")
    dist.barrier()
    return problems


def _backend_auto_on_device(ctx: RankContext, n: int) -> dict[str, Any]:
    """``compression="auto"`` on a CUDA tensor: reduced exactly (NCCL's own
    result, bit for bit) and said so, once: the warning, caught as a Python
    warning or on stderr (where c10's handler writes outside Python's)."""
    import tempfile
    import warnings

    import xcomm

    dev = _device()
    ref = dist.new_group(backend=REF_BACKEND)
    # shm=False: on one host auto means no compression at all (the sums
    # move through shared memory), and nothing would warn.
    group = dist.new_group(
        backend="xcomm",
        pg_options=xcomm.Options(compression="auto", compression_min_bytes=0, shm=False),
    )
    x = _input(ctx, torch.float32, n, 31, dev)
    got, want = x.clone(), x.clone()
    with tempfile.TemporaryFile(mode="w+") as err, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            dist.all_reduce(got, group=group)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        said = err.read() + "\n".join(str(w.message) for w in caught)
    dist.all_reduce(want, group=ref)
    dist.barrier()
    return {"equal": torch.equal(got, want), "said": said}


@pytest.mark.skipif(ON_CPU, reason="CPU tensors are compressed under auto")
@pytest.mark.parametrize("world", [2])
def test_backend_auto_leaves_device_tensors_exact_and_says_so(world: int) -> None:
    results = run_ranks(
        _backend_auto_on_device, _world(world), 1 << 12, ref_group=False, env=ENV, timeout=TIMEOUT
    )
    for r in results:
        assert r["equal"], "auto changed a CUDA tensor's allreduce result"
        assert "chooses for CPU tensors only" in r["said"], r["said"][-2000:]
        assert "reduced uncompressed by NCCL" in r["said"], r["said"][-2000:]


@pytest.mark.parametrize("world", [2])
def test_backend_casts_compress_device_tensors(world: int) -> None:
    """At world size 1 nothing is compressed (nothing crosses a link), so
    this needs two ranks: on one GPU, NCCL 2.30+."""
    results = run_ranks(
        _backend_casts, _world(world), 1 << 16, ref_group=False, env=ENV, timeout=TIMEOUT
    )
    problems = sorted({p for r in results for p in r})
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [2])
def test_backend_int8_compresses_device_tensors_on_the_device(world: int) -> None:
    """Needs two ranks (on one GPU: NCCL 2.30+) and xcomm's CUDA kernels."""
    from xcomm import _C

    if not ON_CPU and not _C.cuda_codecs:
        pytest.skip("xcomm was built without its CUDA kernels")
    results = run_ranks(
        _backend_int8, _world(world), 1 << 12, ref_group=False, env=ENV, timeout=TIMEOUT
    )
    problems = sorted({p for r in results for p in r})
    assert not problems, "\n".join(problems)


# -- DDP --------------------------------------------------------------------


def _make_model(dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    ).to(dev)


def _hook(name: str, group: Any, model: torch.nn.Module) -> tuple[Any, Any] | None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp

    import xcomm.hooks as xh

    return {
        "none": lambda: None,
        "torch_fp16": lambda: (group, default_hooks.fp16_compress_hook),
        "torch_bf16": lambda: (group, default_hooks.bf16_compress_hook),
        "torch_powersgd": lambda: (
            tp.PowerSGDState(group, matrix_approximation_rank=2, start_powerSGD_iter=2),
            tp.powerSGD_hook,
        ),
        "fp16_cast": lambda: (xh.CastState(group), xh.fp16_cast_hook),
        "bf16_cast": lambda: (xh.CastState(group), xh.bf16_cast_hook),
        "int8": lambda: (xh.Int8State(group, model=model), xh.int8_compress_hook),
        "topk": lambda: (xh.TopKState(group, density=0.1, model=model), xh.topk_hook),
        "randomk": lambda: (xh.RandomKState(group, density=0.1, model=model), xh.randomk_hook),
        "powersgd": lambda: (
            xh.PowerSGDState(group, matrix_approximation_rank=2, start_powerSGD_iter=2),
            xh.powersgd_hook,
        ),
        "auto": lambda: (xh.AutoState(group, model=model), xh.auto_hook),
    }[name]()


def _train(ctx: RankContext, dev: torch.device, hook: str, group: Any, steps: int) -> torch.Tensor:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(
        _make_model(dev),
        device_ids=[dev.index] if dev.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=0.25,  # several buckets
    )
    h = _hook(hook, group, model)
    if h is not None:
        model.register_comm_hook(*h)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + ctx.rank)
        x, y = torch.randn(32, 64, generator=g).to(dev), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y.to(dev)).backward()
        for p in model.parameters():
            assert p.grad is not None and p.grad.device == dev, (
                "the averaged gradient left the device"
            )
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def _ddp(ctx: RankContext, hooks: list[str], steps: int) -> dict[str, dict[str, Any]]:
    """Each hook over xcomm and over the reference, and uncompressed training."""
    dev = _device()
    ref = dist.new_group(backend=REF_BACKEND)
    out: dict[str, dict[str, Any]] = {}
    uncompressed = _train(ctx, dev, "none", ref, steps)
    for hook in hooks:
        out[hook] = {"uncompressed": uncompressed}
        for label, group in (("xcomm", None), ("reference", ref)):
            try:
                out[hook][label] = _train(ctx, dev, hook, group, steps)
            except Exception as e:  # noqa: BLE001 - reported
                out[hook][label] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            dist.barrier(group=group)
    return out


EXACT_HOOKS = ["none", "torch_fp16", "torch_bf16", "torch_powersgd"]
XCOMM_HOOKS = ["fp16_cast", "bf16_cast", "int8", "topk", "randomk", "powersgd", "auto"]
#: torch's bf16 hook refuses CPU tensors; torch's powerSGD_hook waits inside
#: future callbacks and deadlocks on CPU with several buckets over gloo itself.
GPU_ONLY = {"torch_bf16", "torch_powersgd"}
HOOKS = [h for h in EXACT_HOOKS + XCOMM_HOOKS if not (ON_CPU and h in GPU_ONLY)]


@functools.cache
def _ddp_runs(world: int) -> list[dict[str, dict[str, Any]]]:
    """One spawn trains every hook (a spawn per hook costs a CUDA and NCCL start each)."""
    return run_ranks(_ddp, world, HOOKS, 6, ref_group=False, env=ENV, timeout=3 * TIMEOUT)


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("world", WORLDS)
def test_ddp_on_the_device_equals_the_reference(world: int, hook: str) -> None:
    results = _ddp_runs(_world(world))
    for rank, runs in enumerate(results):
        r = runs[hook]
        for label in ("xcomm", "reference", "uncompressed"):
            assert isinstance(r[label], torch.Tensor), (
                f"rank {rank}, {label} with {hook}: {r[label]}"
            )
        # auto's choices follow timings, which differ between two runs: only its drift counts.
        assert hook == "auto" or torch.equal(r["xcomm"], r["reference"]), (
            f"rank {rank}: {hook} over xcomm differs from {hook} over {REF_BACKEND}: max |diff| "
            f"{(r['xcomm'] - r['reference']).abs().max().item():.3g}"
        )
        drift = (r["xcomm"] - r["uncompressed"]).norm() / r["uncompressed"].norm()
        assert drift < 0.05, f"rank {rank}: {hook} drifted {drift:.3f} from uncompressed"


def _powersgd_against_torch(ctx: RankContext, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """xcomm's and torch's PowerSGD hooks (rank 2, error feedback, warm
    start, one seed) train the same model on the device; one bucket, as
    torch's hook issues its collectives from future callbacks."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp
    from torch.nn.parallel import DistributedDataParallel as DDP

    import xcomm.hooks as xh

    dev = _device()
    config = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2, "random_seed": 7}
    out: dict[str, torch.Tensor] = {}
    for impl in ("torch", "xcomm"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 6 * 6, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 10),
        ).to(dev, dtype)
        model = DDP(net, device_ids=[dev.index] if dev.type == "cuda" else None)
        if impl == "torch":
            model.register_comm_hook(tp.PowerSGDState(None, **config), tp.powerSGD_hook)
        else:
            model.register_comm_hook(xh.PowerSGDState(None, **config), xh.powersgd_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(8):
            g = torch.Generator().manual_seed(1000 * step + ctx.rank)
            x = torch.randn(16, 3, 8, 8, generator=g).to(dev, dtype)
            y = torch.randint(0, 10, (16,), generator=g).to(dev)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[impl] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return out


@pytest.mark.parametrize("matmul", ["cublas", "xcomm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("world", WORLDS)
def test_powersgd_on_the_device_matches_torch_powersgd_hook(
    world: int, dtype: torch.dtype, matmul: str
) -> None:
    """The device route (cuBLAS matmuls, or with XCOMM_POWERSGD_MATMUL=xcomm
    xcomm's product kernels; the Gram-Schmidt and decompression kernels)
    computes torch's arithmetic in another summation order."""
    env = {**ENV, "XCOMM_POWERSGD_MATMUL": matmul}
    results = run_ranks(
        _powersgd_against_torch, _world(world), dtype, ref_group=False, env=env, timeout=TIMEOUT
    )
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-11}
    for r in results:
        torch.testing.assert_close(r["xcomm"], r["torch"], **tol)


# -- membership: shrink on the device ------------------------------------------


def _shrink_on_the_device(ctx: RankContext, fault: str) -> dict[str, Any]:
    """The last rank leaves (``fault="leave"``: after its last op) or is
    SIGKILLed while the others are inside a CUDA all_reduce (``"kill"``); the
    others shrink it out (``SHRINK_ABORT`` after the kill) through the group's
    own backend (torch 2.11-2.12 have no ``dist.shrink_group``) and their next
    all_reduce on the device equals the reference group's over the survivors.
    """
    import signal
    import time

    import xcomm

    dev, world = _device(), ctx.world_size
    victim = world - 1
    survivors = [r for r in range(world) if r != victim]
    # Made by every rank now (new_group is collective); it never holds the victim.
    ref = dist.new_group(ranks=survivors, backend=REF_BACKEND)
    # The size the pending op has below: NCCL (2.22+, NCCL_RUNTIME_CONNECT=1)
    # connects an algorithm's peers at its first use, in the issuing thread, and
    # such a connect to a dead peer blocked the survivors' all_reduce call
    # itself (on the H200, NCCL 2.28.9) before anything could abort it.
    t = torch.ones(1 << 16, device=dev)
    dist.all_reduce(t)
    assert t[0].item() == world, t
    if ctx.rank == victim:
        if fault == "kill":
            time.sleep(0.3)  # the others are inside their all_reduce by then
            os.kill(os.getpid(), signal.SIGKILL)
        return {"victim": True}
    out: dict[str, Any] = {"victim": False}
    backend = dist.group.WORLD._get_backend(dev)
    out["backend"] = type(backend).__name__
    pending = None
    if fault == "kill":
        pending = dist.all_reduce(torch.ones(1 << 16, device=dev), async_op=True)
        time.sleep(0.6)  # the victim is dead by then
    started = time.monotonic()
    shrunk = backend.shrink([victim], 1 if fault == "kill" else 0)
    out["shrink_s"] = time.monotonic() - started
    if pending is not None:
        started = time.monotonic()
        out["pending_error"] = error_of(pending.wait)
        out["pending_wait_s"] = time.monotonic() - started
    out["rank"], out["size"] = shrunk.rank(), shrunk.size()
    calls = xcomm.stats().get("ALLREDUCE", {}).get("calls", 0)
    n = 1 << 20
    got = torch.arange(n, dtype=torch.float32, device=dev) * (ctx.rank + 1) + ctx.rank
    want = got.clone()
    shrunk.allreduce([got]).wait()
    dist.all_reduce(want, group=ref)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    expected = sum(torch.arange(n, dtype=torch.float32) * (r + 1) + r for r in survivors)
    out["equal"] = torch.equal(got, want)
    out["expected_sum"] = torch.equal(got.cpu(), expected)
    out["device"] = str(got.device)
    deadline = time.monotonic() + 5.0
    while xcomm.stats()["ALLREDUCE"]["calls"] - calls < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # counted when the op completes
    out["allreduces"] = xcomm.stats()["ALLREDUCE"]["calls"] - calls
    shrunk.shutdown()
    return out


@pytest.mark.parametrize("fault", ["leave", "kill"])
def test_shrink_on_the_device_equals_a_group_of_the_survivors(fault: str) -> None:
    _world(2)  # skips where the GPU does not take several ranks
    world = 3
    results = run_ranks(
        _shrink_on_the_device,
        world,
        fault,
        ref_group=False,
        env=ENV,
        timeout=60.0,  # about 5 s when right; a hang is reported with the ranks' stacks
        may_die=[world - 1] if fault == "kill" else [],
    )
    for rank, r in enumerate(results[: world - 1]):
        assert r is not None and not r["victim"], (rank, r)
        assert r["backend"] == "XcommBackend", (rank, r)
        assert (r["rank"], r["size"]) == (rank, world - 1), (rank, r)
        assert r["device"].startswith(_device().type), (rank, r)
        assert r["equal"] and r["expected_sum"], (rank, r)
        assert r["allreduces"] == 1, (rank, r)  # the survivors' op ran on xcomm
        if fault == "kill":
            # SHRINK_ABORT fails the op the victim never joined, at once.
            assert r["pending_error"] is not None, (rank, r)
            assert r["pending_wait_s"] < 1.0, (rank, r)
        print(f"rank {rank}: {r}")


# -- timing at completion ------------------------------------------------------


def _timed_ops(ctx: RankContext) -> dict[str, float]:
    """Collectives queued behind ~0.3 s of GPU work: their stats and timeline
    spans must last as long (a CUDA future completes when its op is queued)."""
    import time

    import xcomm

    dev = _device()
    out: dict[str, float] = {}
    t = torch.ones(1 << 16, device=dev)
    torch.cuda.synchronize()
    for mode in ("async", "sync"):
        xcomm.reset_stats()
        xcomm.enable_timeline()
        torch.cuda._sleep(600_000_000)  # ~0.3 s at ~2 GHz, ahead of the allreduce
        if mode == "async":
            dist.all_reduce(t, async_op=True).wait()
        else:
            dist.all_reduce(t)
        torch.cuda.synchronize()
        deadline = time.monotonic() + 10.0
        while "ALLREDUCE" not in xcomm.stats() and time.monotonic() < deadline:
            time.sleep(0.01)  # recorded by a thread that waits for a CUDA event
        out[f"{mode} stats_s"] = xcomm.stats()["ALLREDUCE"]["time_on_wire_s"]
        spans = [e for e in xcomm.timeline_json()["traceEvents"] if e.get("name") == "ALLREDUCE"]
        out[f"{mode} span_s"] = spans[0]["dur"] * 1e-6 if spans else 0.0
        xcomm.disable_timeline()
    return out


@pytest.mark.skipif(ON_CPU, reason="times GPU work")
def test_stats_and_timeline_time_gpu_ops_at_completion() -> None:
    got = run_ranks(_timed_ops, 1, ref_group=False, env=ENV, timeout=TIMEOUT)[0]
    for what, seconds in got.items():
        assert seconds >= 0.1, f"{what}: {seconds:.4f} s for an op queued behind ~0.3 s: {got}"
