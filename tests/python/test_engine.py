"""xcomm.GradientBucketer, xcomm.stats() and xcomm's timeline.

References:

* unbucketed: the same training with every gradient averaged after
  ``backward()`` by one allreduce per parameter over the gloo reference group;
* DDP over gloo (``process_group=ctx.ref``) on the same model, seed and data,
  with the default reduction, and with the same compression hook;
* the math for the statistics (bytes of known tensors) and the Chrome
  trace-event format for the timeline.

World size 2: the sum of two floats is order-independent, so parameters must
be bitwise identical (``torch.equal``).
"""

from __future__ import annotations

import copy
import json
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import xcomm
import xcomm.scheduler
from ddp_helpers import small_mlp
from dist_harness import Mismatches, RankContext, assert_no_mismatches, run_ranks
from xcomm import trace
from xcomm._bucket_paths import BucketerGradBucket, ChunkedPath, HookPath, LauncherPath
from xcomm.hooks import CastState, Int8State, fp16_cast_hook, int8_compress_hook

STEPS = 6
LR = 0.05


def _convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, 4),
    )


MODELS = {"mlp": (small_mlp, (8, 12)), "convnet": (_convnet, (4, 2, 9, 9))}


def _batch(rank: int, step: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    return torch.randn(shape, generator=g), torch.randn(shape[0], 4, generator=g)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _train(
    ctx: RankContext, base: nn.Module, shape: tuple[int, ...], mode: str
) -> list[torch.Tensor]:
    """Trains a copy of ``base``; ``mode`` picks how gradients are averaged."""
    model = copy.deepcopy(base)
    bucketer = None
    opt = None
    if mode == "unbucketed":
        for p in model.parameters():
            dist.broadcast(p.data, src=0, group=ctx.ref)
        opt = _sgd(model.parameters())
    elif mode.startswith("ddp"):
        model = DDP(model, process_group=ctx.ref, bucket_cap_mb=0.002)
        if mode == "ddp-fp16":
            model.register_comm_hook(CastState(process_group=ctx.ref), fp16_cast_hook)
        elif mode == "ddp-int8":
            model = DDP(copy.deepcopy(base), process_group=ctx.ref, bucket_cap_mb=25)
            model.register_comm_hook(Int8State(process_group=ctx.ref), int8_compress_hook)
        opt = _sgd(model.parameters())
    elif mode == "bucketer":  # several buckets, one optimizer
        bucketer = xcomm.GradientBucketer(model, bucket_cap_mb=0.002)
        assert len(bucketer.buckets) > 2, bucketer.bucket_layout()
        assert isinstance(bucketer._path, LauncherPath)  # CPU, no hook: the C++ launcher
        opt = _sgd(model.parameters())
    elif mode == "bucketer-step":  # per-bucket optimizers stepped as buckets land
        bucketer = xcomm.GradientBucketer(model, bucket_cap_mb=0.002, optimizer_factory=_sgd)
    elif mode in ("bucketer-fifo", "bucketer-priority"):  # chunked, scheduler thread
        bucketer = xcomm.GradientBucketer(
            model, bucket_cap_mb=0.002, schedule=mode.split("-")[1], chunk_mb=0.0005
        )
        assert isinstance(bucketer._path, ChunkedPath)
        assert len(bucketer._path.scheduler.chunks) > len(bucketer.buckets)
        opt = _sgd(model.parameters())
    elif mode == "bucketer-fp16":
        bucketer = xcomm.GradientBucketer(
            model, bucket_cap_mb=0.002, compression=(fp16_cast_hook, CastState())
        )
        assert isinstance(bucketer._path, HookPath)
        opt = _sgd(model.parameters())
    elif mode == "bucketer-int8":  # one bucket, laid out as DDP's single bucket
        bucketer = xcomm.GradientBucketer(
            model, bucket_cap_mb=25, compression=(int8_compress_hook, Int8State())
        )
        opt = _sgd(model.parameters())
    else:
        raise ValueError(mode)
    for step in range(STEPS):
        x, y = _batch(ctx.rank, step, shape)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        else:
            bucketer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if mode == "unbucketed":
            for p in model.parameters():
                p.grad.mul_(1.0 / ctx.world_size)
                dist.all_reduce(p.grad, group=ctx.ref)
        if bucketer is not None and opt is None:
            bucketer.step()
        else:
            if bucketer is not None:
                bucketer.synchronize()
            opt.step()
    if bucketer is not None:
        bucketer.detach()
    module = model.module if isinstance(model, DDP) else model
    return [p.detach().clone() for p in module.parameters()]


def _rank_identical(ctx: RankContext, pairs: list[tuple[str, str]]) -> list[str]:
    m = Mismatches(ctx)
    for name, (build, shape) in MODELS.items():
        torch.manual_seed(100 + ctx.rank)  # different per rank: the bucketer must broadcast
        base = build()
        cache: dict[str, list[torch.Tensor]] = {}
        for got_mode, ref_mode in pairs:
            label = f"{name}: {got_mode} vs {ref_mode}"
            with m.case(label):
                for mode in (got_mode, ref_mode):
                    if mode not in cache:
                        cache[mode] = _train(ctx, base, shape, mode)
                for i, (a, b) in enumerate(zip(cache[got_mode], cache[ref_mode], strict=True)):
                    if not torch.equal(a, b):
                        diff = (a - b).abs().max().item()
                        m.fail(
                            label,
                            f"parameter {i} {tuple(a.shape)} differs (max |diff| {diff:.3g})",
                        )
    return m.items


def test_bucketer_identical_to_unbucketed_and_ddp() -> None:
    """Bucketed (several buckets; also per-bucket optimizers) == unbucketed == DDP, bitwise."""
    pairs = [
        ("bucketer", "unbucketed"),
        ("bucketer", "ddp"),
        ("bucketer-step", "unbucketed"),
        ("bucketer-fifo", "unbucketed"),
        ("bucketer-priority", "unbucketed"),
    ]
    assert_no_mismatches(run_ranks(_rank_identical, 2, pairs, timeout=120))


def test_bucketer_with_compression_identical_to_ddp_hook() -> None:
    """The bucketer with xcomm's fp16 and int8 hooks == DDP with the same hook, bitwise."""
    pairs = [("bucketer-fp16", "ddp-fp16"), ("bucketer-int8", "ddp-int8")]
    assert_no_mismatches(run_ranks(_rank_identical, 2, pairs, timeout=120))


def _rank_compression_differs(ctx: RankContext) -> bool:
    # Guards the test above against a hook that is silently not applied.
    torch.manual_seed(5)
    build, shape = MODELS["mlp"]
    base = build()
    return not all(
        torch.equal(a, b)
        for a, b in zip(
            _train(ctx, base, shape, "bucketer-int8"),
            _train(ctx, base, shape, "bucketer"),
        )
    )


def test_bucketer_compression_is_applied() -> None:
    assert all(run_ranks(_rank_compression_differs, 2))


def _rank_priority_order(ctx: RankContext, priority: bool, depth: int) -> dict[str, Any]:
    # Three buckets of 10, 6 and 4 elements in chunks of 4 (16 bytes):
    # chunks 0-2 | 3-4 | 5. All buckets are marked ready before the thread
    # may run, so after the first chunk (sent before anything is known about
    # the other ranks) every chunk is known to be ready everywhere.
    sizes = (10, 6, 4)
    buffers = [
        torch.randn(n, generator=ctx.generator(salt=i), dtype=torch.float32)
        for i, n in enumerate(sizes)
    ]
    expected = [b.clone() for b in buffers]
    for e in expected:
        dist.all_reduce(e, group=ctx.ref)
    landed: list[int] = []
    errors: list[BaseException] = []
    sched = xcomm.scheduler.ChunkScheduler(
        buffers,
        16,
        priority,
        None,
        lambda b, _issued_us: landed.append(b),
        errors.append,
        max_in_flight=depth,
    )
    sched.mark_ready(list(range(len(sizes))))  # all at once, before the thread may choose
    sched.join()
    return {
        "order": sched.order,
        "landed": landed,
        "errors": [repr(e) for e in errors],
        "equal": all(torch.equal(a, b) for a, b in zip(buffers, expected, strict=True)),
    }


@pytest.mark.parametrize(
    ("priority", "depth", "order", "landed"),
    [
        (False, 1, [0, 1, 2, 3, 4, 5], [0, 1, 2]),
        (False, 2, [0, 1, 2, 3, 4, 5], [0, 1, 2]),
        # After chunk 0 lands, all chunks are known ready everywhere: the last bucket goes first.
        (True, 1, [0, 5, 3, 4, 1, 2], [2, 1, 0]),
        # Two in flight: chunks 0 and 1 are chosen before anything is known.
        (True, 2, [0, 1, 5, 3, 4, 2], [2, 1, 0]),
    ],
)
def test_chunk_scheduler_order_and_results(
    priority: bool, depth: int, order: list[int], landed: list[int]
) -> None:
    """FIFO sends chunks in order; priority sends the last bucket (the first layers) first.

    Either way the reduced buffers equal gloo's allreduce of the same buffers,
    and every rank sends the same order.
    """
    for r in run_ranks(_rank_priority_order, 2, priority, depth):
        assert r["errors"] == []
        assert r["order"] == order
        assert r["landed"] == landed
        assert r["equal"]


def _rank_priority_with_backend_compression(ctx: RankContext) -> dict[str, Any]:
    """Trains the MLP with the bucketer over an xcomm group that compresses every
    allreduce to fp16 (``xcomm.Options``): once chunked in priority order, once
    bucket by bucket, once over an uncompressed group."""
    torch.manual_seed(0)
    base = small_mlp()
    fp16 = dist.new_group(
        backend="xcomm", pg_options=xcomm.Options(compression="fp16", compression_min_bytes=0)
    )
    exact = dist.new_group(backend="xcomm")
    results = {}
    for name, group, schedule in (
        ("priority-fp16", fp16, "priority"),
        ("immediate-fp16", fp16, "immediate"),
        ("priority-exact", exact, "priority"),
    ):
        model = copy.deepcopy(base)
        bucketer = xcomm.GradientBucketer(
            model, process_group=group, bucket_cap_mb=0.002, schedule=schedule, chunk_mb=0.0005
        )
        opt = _sgd(model.parameters())
        for step in range(STEPS):
            x, y = _batch(ctx.rank, step, (8, 12))
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            bucketer.synchronize()
            opt.step()
        bucketer.detach()
        results[name] = [p.detach().clone() for p in model.parameters()]
    results["fp16_calls"] = fp16._get_backend(torch.device("cpu")).compression_stats["calls"]
    return results


def test_priority_chunks_with_backend_compression() -> None:
    """schedule="priority" over a group with Options(compression="fp16"): every
    chunk is cast on the scheduler thread while the previous one is on the wire.
    The cast is elementwise, so the result is bitwise that of compressing whole
    buckets (schedule="immediate"), and differs from the uncompressed run."""
    for r in run_ranks(_rank_priority_with_backend_compression, 2):
        assert r["fp16_calls"] > 0
        for a, b in zip(r["priority-fp16"], r["immediate-fp16"], strict=True):
            assert torch.equal(a, b)
        assert any(
            not torch.equal(a, b)
            for a, b in zip(r["priority-fp16"], r["priority-exact"], strict=True)
        )


def _rank_scheduler_callback_error(ctx: RankContext) -> dict[str, Any]:
    errors: list[BaseException] = []
    landed: list[int] = []

    def on_landed(bucket: int, _issued_us: int) -> None:
        landed.append(bucket)
        raise ValueError(f"boom in bucket {bucket}")

    buffers = [torch.ones(8), torch.ones(8)]
    sched = xcomm.scheduler.ChunkScheduler(buffers, 16, False, None, on_landed, errors.append)
    sched.mark_ready([0, 1])
    sched.join()
    return {"landed": landed, "errors": [(type(e).__name__, str(e)) for e in errors]}


def test_chunk_scheduler_reports_a_failing_callback_and_stops() -> None:
    """An exception on the scheduler's thread reaches on_error as the same
    Python exception, and the thread stops (bucket 1 never lands)."""
    for r in run_ranks(_rank_scheduler_callback_error, 2):
        assert r["landed"] == [0]
        assert r["errors"] == [("ValueError", "boom in bucket 0")]


def _seen_by_hook(state: list[Any], bucket: Any) -> torch.futures.Future:
    """A comm hook that records what it got and averages like DDP's default."""
    state.append(
        {
            "type": type(bucket),
            "index": bucket.index(),
            "is_last": bucket.is_last(),
            "shapes": [tuple(g.shape) for g in bucket.gradients()],
            "params": [tuple(p.shape) for p in bucket.parameters()],
        }
    )
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


def _rank_hook_bucket(ctx: RankContext) -> dict[str, Any]:
    torch.manual_seed(3)
    model = small_mlp()
    seen: list[dict[str, Any]] = []
    b = xcomm.GradientBucketer(model, bucket_cap_mb=0.002, compression=(_seen_by_hook, seen))
    x, y = _batch(ctx.rank, 0, (8, 12))
    nn.functional.mse_loss(model(x), y).backward()
    b.synchronize()
    layout = [[tuple(p.shape) for p in bucket.params] for bucket in b.buckets]
    b.detach()
    return {"seen": seen, "layout": layout}


def test_hook_gets_a_grad_bucket_per_bucket() -> None:
    """A comm hook gets every bucket once, in index order, as a BucketerGradBucket whose
    parameters and gradient views follow the bucket's layout; only the last is_last()."""
    for r in run_ranks(_rank_hook_bucket, 2):
        seen, layout = r["seen"], r["layout"]
        assert [s["index"] for s in seen] == list(range(len(layout)))
        assert all(s["type"] is BucketerGradBucket for s in seen)
        assert [s["is_last"] for s in seen] == [False] * (len(layout) - 1) + [True]
        assert [s["params"] for s in seen] == layout
        assert [s["shapes"] for s in seen] == layout


def test_bucket_view_is_a_deprecated_alias() -> None:
    """xcomm.bucketer.BucketView (the old name of BucketerGradBucket) still works, with a warning."""
    with pytest.warns(DeprecationWarning, match="BucketerGradBucket"):
        alias = xcomm.bucketer.BucketView
    assert alias is xcomm.bucketer.BucketerGradBucket is BucketerGradBucket
    assert "BucketView" not in xcomm.bucketer.__all__
    with pytest.raises(AttributeError):
        _ = xcomm.bucketer.NoSuchName


# --------------------------------------------------------------------- errors


def _expect(exc: type[BaseException], match: str, fn: Any) -> None:
    with pytest.raises(exc, match=match):
        fn()


def _rank_errors(ctx: RankContext) -> bool:
    model = small_mlp()
    for bad in (0, -1.0, float("nan"), float("inf"), True, "4"):
        _expect(
            ValueError,
            "bucket_cap_mb must be a finite number > 0",
            lambda bad=bad: xcomm.GradientBucketer(model, bucket_cap_mb=bad),
        )
    frozen = small_mlp().requires_grad_(False)
    _expect(
        ValueError,
        "no parameters with requires_grad=True",
        lambda: xcomm.GradientBucketer(frozen),
    )
    _expect(
        ValueError,
        "no parameters with requires_grad=True",
        lambda: xcomm.GradientBucketer(nn.ReLU()),
    )
    _expect(
        ValueError,
        r"\(hook, state\) pair",
        lambda: xcomm.GradientBucketer(model, compression=fp16_cast_hook),
    )
    _expect(TypeError, "must be a torch.nn.Module", lambda: xcomm.GradientBucketer(object()))
    _expect(
        ValueError,
        "a comm hook cannot compress",
        lambda: xcomm.GradientBucketer(
            model, schedule="priority", compression=(fp16_cast_hook, CastState())
        ),
    )

    b = xcomm.GradientBucketer(model, bucket_cap_mb=0.001)
    _expect(
        RuntimeError,
        "already has a GradientBucketer attached",
        lambda: xcomm.GradientBucketer(model),
    )
    _expect(RuntimeError, r"synchronize\(\) was called before backward", b.synchronize)
    _expect(RuntimeError, r"step\(\) needs optimizer_factory", b.step)

    x, y = _batch(ctx.rank, 0, (8, 12))
    nn.functional.mse_loss(model(x), y).backward()
    b.synchronize()
    _expect(RuntimeError, r"synchronize\(\) was called before backward", b.synchronize)

    # Backward twice without synchronize: a clear error from inside backward.
    b.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    _expect(
        RuntimeError,
        "became ready twice",
        lambda: nn.functional.mse_loss(model(x), y).backward(),
    )
    b.detach()

    # no_sync() accumulates locally; the next synced backward reduces the sum.
    b2 = xcomm.GradientBucketer(model, bucket_cap_mb=0.001, optimizer_factory=_sgd)
    _expect(RuntimeError, r"step\(\) was called before backward", b2.step)
    b2.zero_grad()
    with b2.no_sync():
        nn.functional.mse_loss(model(x), y).backward()
    local = [p.grad.clone() for p in model.parameters()]
    nn.functional.mse_loss(model(x), y).backward()
    b2.synchronize()
    expected = [2 * g.clone() for g in local]
    for e in expected:
        e.mul_(1.0 / ctx.world_size)
        dist.all_reduce(e, group=ctx.ref)
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    b2.detach()

    # A parameter that gets no gradient: named in the error at synchronize().
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 2)
            self.unused = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    heads = TwoHeads()
    b3 = xcomm.GradientBucketer(heads)
    heads(torch.ones(1, 4)).sum().backward()
    _expect(
        RuntimeError,
        r"2 parameter\(s\) received no gradient.*unused.weight",
        b3.synchronize,
    )
    b3.detach()
    b3.detach()  # idempotent
    xcomm.GradientBucketer(heads).detach()  # re-attach after detach works
    return True


def test_bucketer_bad_input_errors() -> None:
    assert all(run_ranks(_rank_errors, 2))


# ----------------------------------------------------------- stats and trace


def _rank_stats(ctx: RankContext) -> dict[str, Any]:
    xcomm.reset_stats()
    assert xcomm.stats() == {}
    t = torch.ones(1000)
    for _ in range(3):
        dist.all_reduce(t)
    dist.broadcast(torch.ones(10, dtype=torch.float64), src=0)
    after_ops = xcomm.stats()
    # The bucketer with the fp16 hook: half the bytes on the wire.
    model = small_mlp()
    b = xcomm.GradientBucketer(
        model, bucket_cap_mb=0.002, compression=(fp16_cast_hook, CastState())
    )
    xcomm.reset_stats()
    x, y = _batch(ctx.rank, 0, (8, 12))
    nn.functional.mse_loss(model(x), y).backward()
    b.synchronize()
    n_buckets = len(b.buckets)
    n_bytes = sum(p.numel() * 4 for p in model.parameters())
    b.detach()
    after_bucketer = xcomm.stats()

    # Concurrent records from threads: exact totals.
    xcomm.reset_stats()

    def hammer() -> None:
        for _ in range(2000):
            xcomm.opstats.record_op("threads", 4, 1, 0.001, 0.002)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {
        "ops": after_ops,
        "bucketer": after_bucketer,
        "n_buckets": n_buckets,
        "n_bytes": n_bytes,
        "threads": xcomm.stats()["threads"],
    }


def test_stats_count_ops_bytes_ratio_and_reset() -> None:
    for r in run_ranks(_rank_stats, 2):
        ar = r["ops"]["ALLREDUCE"]
        assert ar["calls"] == 3 and ar["failures"] == 0
        assert ar["bytes_in"] == ar["bytes_on_wire"] == 3 * 4000
        assert ar["compression_ratio"] == 1.0 and ar["time_on_wire_s"] > 0
        assert r["ops"]["BROADCAST"]["bytes_in"] == 80
        bk = r["bucketer"]["bucket_allreduce[fp16_cast_hook]"]
        assert bk["calls"] == r["n_buckets"] and bk["bytes_in"] == r["n_bytes"]
        assert bk["compression_ratio"] == pytest.approx(2.0, rel=1e-3)
        # The backend saw the fp16 tensors the hook sent: half the bytes.
        assert r["bucketer"]["ALLREDUCE"]["bytes_in"] == r["n_bytes"] // 2
        th = r["threads"]
        assert (th["calls"], th["bytes_in"], th["bytes_on_wire"]) == (8000, 32000, 8000)
        assert th["compression_ratio"] == 4.0
        assert th["time_on_wire_s"] == pytest.approx(16.0)


def _rank_trace(ctx: RankContext) -> dict[str, Any]:
    model = small_mlp()
    b = xcomm.GradientBucketer(model, bucket_cap_mb=0.002, optimizer_factory=_sgd)
    xcomm.enable_timeline()
    for step in range(2):
        x, y = _batch(ctx.rank, step, (8, 12))
        b.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        b.step()
    path = f"{ctx.tmpdir}/trace{ctx.rank}.json"
    xcomm.save_timeline(path, pid=ctx.rank)
    xcomm.disable_timeline()
    with open(path) as f:
        data = json.load(f)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        nn.functional.mse_loss(model(x), y).backward()
        b.step()
    names = {e.name for e in prof.events()}
    n_buckets = len(b.buckets)
    b.detach()
    return {"trace": data, "n_buckets": n_buckets, "profiler_names": sorted(names)}


def test_timeline_is_valid_chrome_trace_with_every_bucket_span() -> None:
    results = run_ranks(_rank_trace, 2)
    for rank, r in enumerate(results):
        data = r["trace"]
        assert trace.validate_trace(data) == []
        events = data["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        assert all(e["pid"] == rank for e in events)
        tracks = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
        for i in range(r["n_buckets"]):
            for stage, track in (
                ("encode", xcomm.bucketer.TRACK_ENCODE),
                ("transfer", xcomm.bucketer.TRACK_TRANSFER),
                ("decode", xcomm.bucketer.TRACK_DECODE),
                ("step", xcomm.bucketer.TRACK_OPTIM),
            ):
                mine = [e for e in spans if e["name"] == f"bucket {i} {stage}"]
                assert len(mine) == 2, (i, stage, len(mine))  # one per training step
                assert all(e["tid"] == tracks[track] for e in mine)
        # Every backend collective is on the timeline too.
        assert any(e["name"] == "ALLREDUCE" and e["cat"] == "transfer" for e in spans)
        # Transfer of a bucket starts after its encode started and ends before its decode ends.
        by_name = {}
        for e in spans:
            by_name.setdefault(e["name"], []).append(e)
        enc, tr, dec = (
            by_name["bucket 0 encode"][0],
            by_name["bucket 0 transfer"][0],
            by_name["bucket 0 decode"][0],
        )
        assert enc["ts"] <= tr["ts"] <= dec["ts"] and tr["ts"] + tr["dur"] <= dec["ts"] + dec["dur"]
        # xcomm's spans in torch.profiler
        assert "xcomm::bucket0::encode" in r["profiler_names"]
        assert "xcomm::bucket0::transfer" in r["profiler_names"]
        assert "xcomm::bucket0::optimizer_step" in r["profiler_names"]


def test_trace_validator_rejects_malformed_traces() -> None:
    good = {"traceEvents": [{"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 1, "dur": 2}]}
    assert trace.validate_trace(good) == []
    assert trace.validate_trace({"events": []})
    for broken in (
        {"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 1},  # no dur
        {"name": "a", "ph": "Q", "pid": 0, "tid": 1, "ts": 1, "dur": 1},  # bad phase
        {
            "name": "a",
            "ph": "X",
            "pid": "0",
            "tid": 1,
            "ts": 1,
            "dur": 1,
        },  # pid a string
        {"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": -5, "dur": 1},  # negative ts
        {
            "name": "thread_name",
            "ph": "M",
            "pid": 0,
            "tid": 1,
            "args": {},
        },  # no args.name
    ):
        assert trace.validate_trace({"traceEvents": [broken]}), broken
    with pytest.raises(ValueError, match="ends"):
        trace.add_span("x", "c", "t", 10, 5)
