"""GPU benchmark of xcomm's CUDA path (``python -m xcomm_bench gpu``).

What ``scripts/gpu_check.sh`` runs on the GPU machine, one rank, one GPU:

1. the device: name, driver, torch, CUDA and NCCL versions;
2. copy bandwidth: ``dst.copy_(src)`` of a 64 MB float32 bucket on the GPU,
   timed with CUDA events, and each codec's encode + decode (with error
   feedback) on the same bucket beside it: xcomm's codecs (``_C``) and the
   same math written in plain torch ops (device-generic ATen: what the GPU
   reaches without a kernel of ours). Rates are bucket bytes / time, as in
   ``python -m xcomm_bench codecs``, so "/ copy" reads as "this codec
   processes a bucket at x of the speed the GPU copies it";
3. PowerSGD's two products, P = M Q and Q = M^T P, on one 2048 x 2048
   float32 matrix at rank 4 (``--matrix``): cuBLAS (``torch.mm``) against
   xcomm's kernels (``XCOMM_POWERSGD_MATMUL=xcomm``), each beside a copy of
   M, which both products read once;
4. DDP steps on real buckets at world size 1 over the xcomm backend (CUDA
   tensors go to its inner NCCL group), with no hook, torch's hooks and
   xcomm's hooks: the median step time, and the hook's cost per step (step
   time minus the no-hook step time). At world size 1 the collectives move
   nothing, so that difference is the hook's compute: the figure the issue
   compares between xcomm's PowerSGD and torch's ``powerSGD_hook``. xcomm's
   PowerSGD runs twice: with cuBLAS's products, and with its own product
   kernels (``XCOMM_POWERSGD_MATMUL=xcomm``, the row "..., xcomm matmul").

A method that raises on CUDA tensors is reported with its error, not
skipped: the table shows what runs on a GPU today.

``--profile`` shows where the time goes instead: the GPU time of each
codec's kernels, and of DDP steps with torch's and xcomm's PowerSGD, int8
and top-k hooks, kernel by kernel beyond the no-hook step (the hooks'
compute on the device), with the launches per step and the wall time.

Example::

    python -m xcomm_bench gpu --out bench-results/gpu
    python -m xcomm_bench gpu --device cpu --numel 1M --steps 3   # smoke test, no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import codecs

__all__ = ["main"]


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], list[float]]:
    """Seconds per call of ``fn``: CUDA events on a GPU, wall clock on a CPU."""

    def run(fn: Callable[[], object], reps: int) -> list[float]:
        fn()  # warm-up (allocations, cuBLAS/cuRAND handles)
        out = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 1000)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return out

    return run


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    if device.type != "cuda":
        return info
    info["name"] = torch.cuda.get_device_name(device)
    info["cuda"] = torch.version.cuda
    nccl = torch.cuda.nccl.version()
    info["nccl"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["driver"] = f"unknown ({e})"
    return info


def _xcomm_codecs(
    flat: torch.Tensor, out: torch.Tensor, k: int, world: int
) -> dict[str, Callable[[], Callable[[], object]]]:
    """xcomm's codecs as one rank runs them in its hooks (encode + decode with
    error feedback, network left out), by row name. Each entry makes its codec
    when called, so a codec that refuses the device fails its own row only."""
    from xcomm import _C

    steps = iter(range(10**9))

    def int8() -> Callable[[], object]:
        c, fb = _C.Int8Codec(codecs.CHUNK), _C.ErrorFeedback()
        return lambda: codecs.xcomm_int8(c, fb, flat, world, out)

    def topk() -> Callable[[], object]:
        c = _C.TopKCodec(False, True, 4096, 0)
        return lambda: codecs.xcomm_topk(c, flat, k, world, out)

    def randomk() -> Callable[[], object]:
        c = _C.RandomKCodec(0, True)
        return lambda: codecs.xcomm_randomk(c, flat, next(steps), world, out)

    return {"int8 + EF": int8, "top-k 1% + EF": topk, "random-k 1% + EF": randomk}


#: The row of xcomm's top-k with XCOMM_TOPK_SELECT=radix (four passes over the
#: bucket; the default, sampled selection reads it once).
RADIX = "xcomm, radix select"
RADIX_ENV = {"XCOMM_TOPK_SELECT": "radix"}


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """Sets ``values`` in the environment (xcomm's C++ reads these switches per
    call) for the duration, and puts back what was there."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure_codecs(device: torch.device, numel: int, reps: int, world: int = 2) -> list[dict]:
    """GB/s of each codec's encode + decode beside the copy bandwidth."""
    gen = torch.Generator().manual_seed(1)
    flat = torch.randn(numel, generator=gen).to(device)
    out = torch.empty_like(flat)
    residual = torch.zeros_like(flat)
    k = max(1, math.ceil(codecs.DENSITY * numel))
    half = torch.empty(numel, dtype=torch.float16, device=device)
    bf16 = torch.empty(numel, dtype=torch.bfloat16, device=device)
    rgen = torch.Generator(device=device).manual_seed(2)

    def torch_randomk() -> None:
        # torch.randperm on the device: codecs.torch_randomk draws on the CPU.
        acc = flat + residual
        idx = torch.randperm(acc.numel(), generator=rgen, device=device)[:k]
        residual.copy_(acc.index_fill_(0, idx, 0))
        out.zero_()
        out.index_copy_(0, idx, acc[idx])

    xcomm = _xcomm_codecs(flat, out, k, world)

    methods: list[tuple[str, str, Callable[[], Callable[[], object]]]] = [
        ("copy (reference)", "torch", lambda: lambda: out.copy_(flat)),
        ("fp16 cast", "torch", lambda: lambda: (half.copy_(flat), out.copy_(half))),
        ("bf16 cast", "torch", lambda: lambda: (bf16.copy_(flat), out.copy_(bf16))),
        ("int8 + EF", "xcomm", xcomm["int8 + EF"]),
        ("int8 + EF", "torch ops", lambda: lambda: codecs.torch_int8(flat, residual, world, out)),
        ("top-k 1% + EF", "xcomm", xcomm["top-k 1% + EF"]),
        # The radix selection over every entry (four passes over the bucket).
        ("top-k 1% + EF", RADIX, xcomm["top-k 1% + EF"]),
        (
            "top-k 1% + EF",
            "torch ops",
            lambda: lambda: codecs.torch_topk(flat, residual, k, world, out),
        ),
        ("random-k 1% + EF", "xcomm", xcomm["random-k 1% + EF"]),
        ("random-k 1% + EF", "torch ops", lambda: torch_randomk),
    ]
    timer = _timer(device)
    nbytes = 4 * numel
    rows: list[dict] = []
    copy_gbs = None
    for name, impl, make in methods:
        row: dict[str, Any] = {"method": name, "impl": impl, "numel": numel}
        try:
            with _env(RADIX_ENV if impl == RADIX else {}):
                ts = timer(make(), reps)
        except Exception as e:  # noqa: BLE001 - reported as the row's result
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            continue
        sec = statistics.median(ts)
        row["ms"] = 1000 * sec
        row["gb_s"] = nbytes / sec / 1e9
        if copy_gbs is None:
            copy_gbs = row["gb_s"]
        row["ratio"] = row["gb_s"] / copy_gbs
        rows.append(row)
    return rows


#: Environment of xcomm's product kernels (read by xcomm's C++ per call).
MATMUL_ENV = {"XCOMM_POWERSGD_MATMUL": "xcomm"}


def measure_products(
    device: torch.device, rows: int, cols: int, rank: int, reps: int
) -> list[dict]:
    """PowerSGD's two products on one ``rows x cols`` float32 matrix M, the
    time of each against a copy of M: cuBLAS (``torch.mm``, what the codec
    runs by default) and xcomm's kernels (``XCOMM_POWERSGD_MATMUL=xcomm``).
    Both read M once, so "/ copy" reads as "this product streams M at x of
    the speed the GPU copies it"; ``vs cuBLAS`` is cuBLAS's time over this
    row's."""
    from xcomm import _C

    gen = torch.Generator().manual_seed(3)
    m = torch.randn(rows, cols, generator=gen).to(device)
    q = torch.randn(cols, rank, generator=gen).to(device)
    p = torch.randn(rows, rank, generator=gen).to(device)
    m_out, p_out, q_out = torch.empty_like(m), torch.empty_like(p), torch.empty_like(q)
    finite = torch.ones((), dtype=torch.bool, device=device)

    def ours(ran: bool) -> None:
        if not ran:
            raise RuntimeError("xcomm's product kernels declined (they need a GPU)")

    methods: list[tuple[str, str, Callable[[], object], dict[str, str]]] = [
        ("copy of M (reference)", "torch", lambda: m_out.copy_(m), {}),
        ("P = M Q", "cuBLAS", lambda: torch.mm(m, q, out=p_out), {}),
        ("P = M Q", "xcomm", lambda: ours(_C._powersgd_project(p_out, m, q)), MATMUL_ENV),
        ("Q = M^T P", "cuBLAS", lambda: torch.mm(m.t(), p, out=q_out), {}),
        (
            "Q = M^T P",
            "xcomm",
            lambda: ours(_C._powersgd_project_back(q_out, m, p, finite)),
            MATMUL_ENV,
        ),
    ]
    timer = _timer(device)
    out: list[dict] = []
    copy_ms = None
    cublas_ms: dict[str, float] = {}
    for name, impl, fn, env in methods:
        row: dict[str, Any] = {
            "product": name,
            "impl": impl,
            "rows": rows,
            "cols": cols,
            "rank": rank,
        }
        try:
            with _env(env):
                row["ms"] = 1000 * statistics.median(timer(fn, reps))
        except Exception as e:  # noqa: BLE001 - reported as the row's result
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            out.append(row)
            continue
        copy_ms = row["ms"] if copy_ms is None else copy_ms
        row["ratio"] = copy_ms / row["ms"]
        if impl == "cuBLAS":
            cublas_ms[name] = row["ms"]
        elif name in cublas_ms:
            row["vs_cublas"] = cublas_ms[name] / row["ms"]
        out.append(row)
    return out


def time_rows(events: Iterable[Any], per: float, device: bool) -> dict[str, tuple[float, float]]:
    """``key -> (us, count)`` per step or call from ``prof.key_averages()``.

    On a GPU only the device's own rows count (kernels, memcpys, memsets):
    an op's self device time is the time of the kernels it launched, which
    have rows of their own, and a kernel launched outside any op (xcomm's,
    from C++) is billed to the enclosing scope (``AccumulateGrad``, a
    module's forward) as well. Summing every row counts those kernels
    twice. On the CPU: each op's self time.

    Example::

        >>> from types import SimpleNamespace as E
        >>> from torch.autograd import DeviceType
        >>> op = E(key="aten::mm", device_type=DeviceType.CPU, self_device_time_total=9.0, count=1)
        >>> kernel = E(key="sgemm", device_type=DeviceType.CUDA, self_device_time_total=9.0, count=1)
        >>> time_rows([op, kernel], per=1, device=True)
        {'sgemm': (9.0, 1.0)}
    """
    from torch.autograd import DeviceType

    rows: dict[str, tuple[float, float]] = {}
    for e in events:
        if device:
            if getattr(e, "device_type", None) == DeviceType.CPU:
                continue
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
        else:
            us = e.self_cpu_time_total
        if us > 0:
            rows[e.key] = (us / per, e.count / per)
    return rows


def busy_us(events: Iterable[Any]) -> float:
    """Microseconds in which the device ran anything: the union of the
    device's own events' intervals (kernels, memcpys, memsets; from
    ``prof.events()``). Against the wall time it tells a device-bound step
    (busy near the wall) from one whose time goes to the host: launches,
    Python, callbacks, waits.

    Example::

        >>> from types import SimpleNamespace as E
        >>> from torch.autograd import DeviceType
        >>> def ev(start, end, kind=DeviceType.CUDA):
        ...     return E(device_type=kind, time_range=E(start=start, end=end))
        >>> busy_us([ev(0, 10), ev(5, 12), ev(20, 25), ev(0, 100, DeviceType.CPU)])
        17.0
    """
    from torch.autograd import DeviceType

    spans = sorted(
        (float(e.time_range.start), float(e.time_range.end))
        for e in events
        if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU
    )
    total, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def profile_codecs(device: torch.device, numel: int, world: int = 2, calls: int = 5) -> str:
    """Where each xcomm codec's time goes: GPU time per kernel (torch.profiler),
    per call of the encode + decode measured by :func:`measure_codecs`."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(1)
    flat = torch.randn(numel, generator=gen).to(device)
    out = torch.empty_like(flat)
    k = max(1, math.ceil(codecs.DENSITY * numel))
    makers = _xcomm_codecs(flat, out, k, world)
    runs = [(name, make(), False) for name, make in makers.items()]
    runs.append(("top-k 1% + EF, radix select", makers["top-k 1% + EF"](), True))
    parts = []
    for name, fn, radix in runs:
        with _env(RADIX_ENV if radix else {}):
            fn()
            torch.cuda.synchronize(device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize(device)
        rows = sorted(
            ((us, n, key) for key, (us, n) in time_rows(prof.key_averages(), calls, True).items()),
            reverse=True,
        )
        total = sum(r[0] for r in rows)
        lines = [f"{name}: {total:.1f} us of GPU time per call ({calls} calls)"]
        lines += [f"  {us:8.1f} us  x{n:<5.1f} {key[:110]}" for us, n, key in rows[:16]]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _model(device: torch.device, width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(device)


#: xcomm's PowerSGD with its own kernels for P = M Q and Q = M^T P.
XCOMM_MATMUL = "xcomm powersgd_hook r4, xcomm matmul"
#: Environment a hook's rows run under (read by xcomm's C++ per call).
HOOK_ENV: dict[str, dict[str, str]] = {XCOMM_MATMUL: MATMUL_ENV}


def _hooks() -> dict[str, Callable[[dist.ProcessGroup | None, torch.nn.Module], Any]]:
    """name -> (group, model) -> (state, hook) or None (no hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp

    import xcomm.hooks as xh

    def powersgd(g: dist.ProcessGroup | None, m: torch.nn.Module) -> Any:
        return xh.PowerSGDState(
            g, matrix_approximation_rank=4, start_powerSGD_iter=2
        ), xh.powersgd_hook

    return {
        "none": lambda g, m: None,
        "torch fp16_compress_hook": lambda g, m: (g, default_hooks.fp16_compress_hook),
        "torch powerSGD_hook r4": lambda g, m: (
            tp.PowerSGDState(g, matrix_approximation_rank=4, start_powerSGD_iter=2),
            tp.powerSGD_hook,
        ),
        "xcomm powersgd_hook r4": powersgd,
        XCOMM_MATMUL: powersgd,  # with xcomm's product kernels instead of cuBLAS (HOOK_ENV)
        "xcomm fp16_cast_hook": lambda g, m: (xh.CastState(g), xh.fp16_cast_hook),
        "xcomm bf16_cast_hook": lambda g, m: (xh.CastState(g), xh.bf16_cast_hook),
        "xcomm int8_compress_hook": lambda g, m: (xh.Int8State(g, model=m), xh.int8_compress_hook),
        "xcomm topk_hook 1%": lambda g, m: (xh.TopKState(g, model=m), xh.topk_hook),
        "xcomm randomk_hook 1%": lambda g, m: (xh.RandomKState(g, model=m), xh.randomk_hook),
        "xcomm auto_hook": lambda g, m: (xh.AutoState(g, model=m), xh.auto_hook),
    }


def _ddp_step(
    device: torch.device, width: int, depth: int, batch: int, make: Callable[..., Any]
) -> tuple[torch.nn.Module, Callable[[], None]]:
    """A DDP model at world size 1 over the default group with the hook ``make``
    registers, and one training step of it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = torch.randn(batch, width, device=device)
    model = DDP(
        _model(device, width, depth),
        device_ids=[device.index] if device.type == "cuda" else None,
    )
    hook = make(None, model)
    if hook is not None:
        model.register_comm_hook(*hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()

    return model, step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_ddp(
    device: torch.device, width: int, depth: int, batch: int, steps: int, warmup: int = 4
) -> list[dict]:
    """Median DDP step time per hook at world size 1 over the default group."""

    def time_hook(name: str, make: Callable[..., Any]) -> dict[str, Any]:
        row: dict[str, Any] = {"hook": name}
        try:
            with _env(HOOK_ENV.get(name, {})):
                model, step = _ddp_step(device, width, depth, batch, make)
                for _ in range(warmup):  # DDP rebuilds buckets; the hooks start compressing
                    step()
                ts = []
                for _ in range(steps):
                    _sync(device)
                    t0 = time.perf_counter()
                    step()
                    _sync(device)
                    ts.append(time.perf_counter() - t0)
            row["ms"] = 1000 * statistics.median(ts)
            row["params_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        except Exception as e:  # noqa: BLE001 - reported as the row's result
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
        return row

    hooks = _hooks()
    time_hook("none", hooks["none"])  # the first DDP of the process pays for start-up
    rows = [time_hook(name, make) for name, make in hooks.items()]
    base_ms = next((r["ms"] for r in rows if r["hook"] == "none" and "ms" in r), None)
    for r in rows:
        if base_ms is not None and "ms" in r:
            r["hook_ms"] = r["ms"] - base_ms
    return rows


#: The hooks whose step profile --profile shows (PowerSGD: the issue's ratio).
PROFILED_HOOKS = [
    "none",
    "torch powerSGD_hook r4",
    "xcomm powersgd_hook r4",
    XCOMM_MATMUL,
    "xcomm int8_compress_hook",
    "xcomm topk_hook 1%",
]


def profile_ddp(
    device: torch.device, width: int, depth: int, batch: int, steps: int = 10, warmup: int = 4
) -> str:
    """Where a DDP step's time goes with each hook (torch.profiler): the
    device time per step of every kernel (on a GPU; op self time on the CPU),
    the launches per step, and the same beyond the no-hook step, kernel by
    kernel. The device time beyond the no-hook step is the hook's compute on
    the GPU; the wall time beyond it adds the host's share (dispatch, Python,
    future callbacks), which a launch-bound step shows instead. On a GPU the
    summary also gives the time per step in which the device ran anything
    (:func:`busy_us`): near the wall time, the step is device-bound; far
    below it, the host or a wait holds the step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    hooks = _hooks()
    per_kernel: dict[str, dict[str, tuple[float, float]]] = {}
    beyond_none: dict[str, float] = {}
    parts: list[str] = []
    summary = [
        "hook | device us/step | beyond none | launches/step | wall ms/step (profiled)"
        + (" | device busy ms/step" if cuda else "")
    ]
    for name in PROFILED_HOOKS:
        try:
            with _env(HOOK_ENV.get(name, {})):
                _, step = _ddp_step(device, width, depth, batch, hooks[name])
                for _ in range(warmup):
                    step()
                _sync(device)
                t0 = time.perf_counter()
                with profile(activities=activities) as prof:
                    for _ in range(steps):
                        step()
                    _sync(device)
                wall_ms = 1000 * (time.perf_counter() - t0) / steps
        except Exception as e:  # noqa: BLE001 - reported as the hook's result
            summary.append(f"{name} | fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        kernels = time_rows(prof.key_averages(), steps, cuda)
        per_kernel[name] = kernels
        total = sum(us for us, _ in kernels.values())
        launches = sum(n for _, n in kernels.values())
        base = per_kernel.get("none", {})
        beyond = total - sum(us for us, _ in base.values())
        beyond_none[name] = beyond
        row = f"{name} | {total:.0f} | {beyond:+.0f} | {launches:.0f} | {wall_ms:.2f}"
        if cuda:  # how much of the wall time the device was busy at all
            row += f" | {busy_us(prof.events()) / steps / 1000:.2f}"
        summary.append(row)
        if name == "none":
            continue
        extra = sorted(
            (
                (us - base.get(k, (0.0, 0.0))[0], n - base.get(k, (0.0, 0.0))[1], k)
                for k, (us, n) in kernels.items()
            ),
            reverse=True,
        )
        lines = [f"{name}: device time beyond the no-hook step, by kernel (us/step, launches/step)"]
        lines += [f"  {us:8.1f} us  x{n:<5.1f} {k[:110]}" for us, n, k in extra[:20] if us > 0]
        parts.append("\n".join(lines))
    head = (
        f"DDP at world size 1: {depth} x Linear({width}), batch {batch}, {steps} profiled "
        f"steps after {warmup}; {'GPU kernel' if cuda else 'CPU op self'} time"
    )
    theirs = beyond_none.get("torch powerSGD_hook r4")
    for label, hook in (("xcomm", "xcomm powersgd_hook r4"), ("xcomm matmul", XCOMM_MATMUL)):
        ours = beyond_none.get(hook)
        if ours is not None and theirs:
            # The bar: xcomm's PowerSGD compute at most half of torch's.
            summary.append(
                f"PowerSGD compute, {label} / torch (device time beyond none): {ours / theirs:.2f}"
            )
    return "\n\n".join([head, "\n".join(summary), *parts])


def format_markdown(
    info: dict, codec_rows: list[dict], product_rows: list[dict], ddp_rows: list[dict], cfg: dict
) -> str:
    lines = [
        "device: " + ", ".join(f"{k} {v}" for k, v in info.items()),
        "",
        (
            f"codecs: float32 bucket of {cfg['numel']} elements "
            f"({4 * cfg['numel'] / 2**20:.0f} MiB), encode + decode, median of "
            f"{cfg['reps']}; rate = bucket bytes / time"
        ),
        "",
        "| method | impl | ms | GB/s | / copy |",
        "|---|---|---:|---:|---:|",
    ]
    for r in codec_rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['impl']} | fails: {r['error']} | | |")
        else:
            lines.append(
                f"| {r['method']} | {r['impl']} | {r['ms']:.3f} | {r['gb_s']:.1f} | {r['ratio']:.2f} |"
            )
    lines += [
        "",
        (
            f"PowerSGD's products: float32 M of {cfg['rows']} x {cfg['cols']}, rank "
            f"{cfg['rank']}, median of {cfg['reps']}; / copy = copy of M's time / this time"
        ),
        "",
        "| product | impl | ms | / copy | vs cuBLAS |",
        "|---|---|---:|---:|---:|",
    ]
    for r in product_rows:
        if "error" in r:
            lines.append(f"| {r['product']} | {r['impl']} | fails: {r['error']} | | |")
        else:
            vs = f"{r['vs_cublas']:.2f}" if "vs_cublas" in r else ""
            lines.append(
                f"| {r['product']} | {r['impl']} | {r['ms']:.4f} | {r['ratio']:.2f} | {vs} |"
            )
    lines += [
        "",
        (
            f"DDP at world size 1 over xcomm: {cfg['depth']} x Linear({cfg['width']}), "
            f"batch {cfg['batch']}, median of {cfg['steps']} steps"
        ),
        "",
        "| hook | step ms | hook ms per step |",
        "|---|---:|---:|",
    ]
    for r in ddp_rows:
        if "error" in r:
            lines.append(f"| {r['hook']} | fails: {r['error']} | |")
        else:
            lines.append(f"| {r['hook']} | {r['ms']:.2f} | {r.get('hook_ms', float('nan')):.2f} |")
    return "\n".join(lines)


@contextlib.contextmanager
def _world_of_one() -> Iterator[None]:
    """The default process group: xcomm, this process alone."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "xcomm", init_method="file://" + os.path.join(tmp, "store"), rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def _size(text: str) -> int:
    return codecs._parse_size(text)


def _matrix(text: str) -> tuple[int, int, int]:
    """``"ROWSxCOLSxRANK"`` as three positive integers, or a usage error."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"--matrix wants ROWSxCOLSxRANK, three positive integers (e.g. 2048x2048x4); got {text!r}"
        )
    rows, cols, rank = (int(p) for p in parts)
    return rows, cols, rank


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m xcomm_bench gpu", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test)")
    p.add_argument("--numel", type=_size, default=16 << 20, help="codec bucket elements (16M)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--matrix",
        type=_matrix,
        default=(2048, 2048, 4),
        help="rows x cols x rank of the PowerSGD products' matrix (2048x2048x4)",
    )
    p.add_argument("--out", type=Path, default=None, help="folder for gpu.json and gpu.md")
    p.add_argument(
        "--profile",
        action="store_true",
        help=(
            "only profile: the codecs' kernels (GPU time per kernel) and DDP steps with "
            "each PowerSGD hook, int8 and top-k (device time per step, by kernel); "
            "profile.txt in --out"
        ),
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("xcomm_bench gpu: no GPU visible (torch.cuda.is_available() is False)")
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    import xcomm  # noqa: F401 - registers the backend

    if args.profile:
        texts = []
        if device.type == "cuda":
            texts.append(profile_codecs(device, args.numel))
        with _world_of_one():
            texts.append(profile_ddp(device, args.width, args.depth, args.batch))
        text = "\n\n".join(texts)
        print(text, flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "profile.txt").write_text(text + "\n")
        return 0
    cfg = {k: getattr(args, k) for k in ("numel", "reps", "width", "depth", "batch", "steps")}
    cfg["rows"], cfg["cols"], cfg["rank"] = args.matrix
    info = device_info(device)
    print(json.dumps(info), flush=True)
    codec_rows = measure_codecs(device, args.numel, args.reps)
    product_rows = measure_products(device, cfg["rows"], cfg["cols"], cfg["rank"], args.reps)
    with _world_of_one():
        ddp_rows = measure_ddp(device, args.width, args.depth, args.batch, args.steps)
    text = format_markdown(info, codec_rows, product_rows, ddp_rows, cfg)
    print(text, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.json").write_text(
            json.dumps(
                {
                    "info": info,
                    "config": cfg,
                    "codecs": codec_rows,
                    "products": product_rows,
                    "ddp": ddp_rows,
                },
                indent=1,
            )
        )
        (args.out / "gpu.md").write_text(text + "\n")
    return 0
