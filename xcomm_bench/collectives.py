"""nccl-tests-style sweep of collectives over several backends side by side.

Each rank creates one process group per benchmarked backend over all ranks
(plus a gloo group that only coordinates), then for every message size, op
and backend, in that nesting order so the backends are measured side by side:

1. ``warmup`` untimed iterations per backend;
2. ``iters`` timed samples per backend, the backends taking turns (one
   sample each, round-robin, so a burst of load from other processes hits
   all of them alike; ``interleave=False`` takes each backend's samples in
   one run). A sample is one untimed op (it lines the ranks up on that
   backend, so no rank's time includes waiting for a peer still busy with
   another backend), then ``block`` back-to-back ops timed together, as
   nccl-tests does; its time is the mean per op. A measurement's time is the
   p50 over samples of the slowest rank's time;
3. one untimed check iteration per backend on a known pattern; ``correct``
   is true only if the output is exact on every rank.

Iterations scale down with size: ``iters = clamp(iter_bytes // size,
min_iters, max_iters)``, ``warmup = clamp(iters // 4, 1, max_warmup)`` and
``block = clamp(block_bytes // size, 1, max_block)`` (``max_block=1`` times
every op on its own).

Ranks are started by :func:`launch`: on loopback (``nodes=0``) or in an
emulated cluster (``nodes>=1``, needs root); or by anything that sets the
torch.distributed ``env://`` variables (``launcher="env"``).

Example::

    >>> from xcomm_bench.collectives import SweepConfig, launch
    >>> cfg = SweepConfig(backends=["xcomm", "gloo"], nproc=2, max_bytes=1 << 20,
    ...                   out="bench-results/collectives")
    >>> launch(cfg)  # doctest: +SKIP
    0
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .launch import module_command, run_ranks
from .metrics import OPS, algbw, busbw, percentile
from .ops import Case, make_case

__all__ = [
    "BackendSpec",
    "Measurement",
    "SweepConfig",
    "default_backends",
    "iteration_counts",
    "launch",
    "message_sizes",
    "metadata",
    "parse_list",
    "parse_size",
    "run_rank",
    "run_sweep",
]

MiB = 1 << 20
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
}


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A backend to benchmark and the device its tensors live on.

    Parsed from ``"name"`` or ``"name:device"``; the default device is
    ``cuda`` for nccl and ``cpu`` otherwise (``xcomm:cuda`` puts xcomm's
    tensors on the GPU). xcomm takes variants after ``+``, each an
    ``xcomm.Options`` setting (see ``VARIANTS``): ``xcomm+noshm+unchecked``
    is xcomm with ``shm=False, check_collectives=False``.
    """

    name: str
    device: str
    variants: tuple[str, ...] = ()

    VARIANTS: ClassVar[dict[str, dict[str, Any]]] = {
        "noshm": {"shm": False},
        "unchecked": {"check_collectives": False},
        "uncarried": {"carry_small_ops": False},
    }

    @classmethod
    def parse(cls, text: str) -> BackendSpec:
        """``BackendSpec.parse("xcomm:cuda") == BackendSpec("xcomm", "cuda")``."""
        head, _, device = text.strip().partition(":")
        name, *variants = head.split("+")
        if not name:
            raise ValueError(f"empty backend name in {text!r}")
        if variants and name != "xcomm":
            raise ValueError(f"backend {name!r}: only xcomm takes +variants, got {text!r}")
        for v in variants:
            if v not in cls.VARIANTS:
                raise ValueError(
                    f"unknown variant {v!r} in {text!r}; known: {sorted(cls.VARIANTS)}"
                )
        if not device:
            device = "cuda" if name == "nccl" else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"backend {name!r}: device must be cpu or cuda, got {device!r}")
        return cls(name, device, tuple(variants))

    @property
    def label(self) -> str:
        """``name`` (with its variants) for the default device, else ``name:device``."""
        default = "cuda" if self.name == "nccl" else "cpu"
        name = "+".join((self.name, *self.variants))
        return name if self.device == default else f"{name}:{self.device}"

    def pg_options(self) -> Any:
        """The ``pg_options`` its group is made with (None: the backend's defaults)."""
        if not self.variants:
            return None
        import xcomm

        settings: dict[str, Any] = {}
        for v in self.variants:
            settings.update(self.VARIANTS[v])
        return xcomm.Options(**settings)


@dataclasses.dataclass
class SweepConfig:
    """Everything that defines a sweep; also the command line (see :meth:`to_argv`).

    Attributes:
        backends: Backends to compare, e.g. ``["xcomm", "gloo"]`` (see
            :class:`BackendSpec` for ``name:device``).
        ops: Ops to run, a subset of :data:`xcomm_bench.metrics.OPS`.
        nproc: World size (total ranks).
        min_bytes / max_bytes / factor: Sizes ``min, min*f, ...`` up to max.
        max_iters / min_iters / iter_bytes / max_warmup: Iteration policy (module doc).
        dtype: Element type, one of float32, float64, float16, bfloat16, int32.
        out: Folder for CSV/JSON/PNG/Markdown (rank 0 writes); ``None`` for none.
        baseline: Backend the ratios are taken against.
        nodes: 0 = ranks on loopback; N >= 1 = an emulated cluster of N nodes
            (``nproc`` must be a multiple of N).
        rate: Link rate of the emulated cluster, e.g. ``"1gbit"``.
        plot: Write the PNG plot.
        progress: Show a tqdm bar on rank 0.
        pg_timeout_s: Timeout of the process groups.
        threads: torch intra-op threads per rank (default: cores / ranks per node).
        label: Free text stored in the JSON metadata (e.g. "loopback").
        interleave: Time the backends round-robin, one sample each in
            turn (default), rather than each backend's samples in a row.
        block_bytes / max_block: A sample times ``clamp(block_bytes // size,
            1, max_block)`` back-to-back ops together.
    """

    backends: list[str] = dataclasses.field(default_factory=lambda: default_backends())
    ops: list[str] = dataclasses.field(default_factory=lambda: list(OPS))
    nproc: int = 2
    min_bytes: int = 8
    max_bytes: int = 256 * MiB
    factor: float = 2.0
    max_iters: int = 20
    min_iters: int = 3
    iter_bytes: int = 512 * MiB
    max_warmup: int = 5
    dtype: str = "float32"
    out: str | None = "bench-results/collectives"
    baseline: str = "gloo"
    nodes: int = 0
    rate: str | None = None
    plot: bool = True
    progress: bool = True
    pg_timeout_s: float = 600.0
    threads: int | None = None
    label: str = ""
    interleave: bool = True
    block_bytes: int = 64 * MiB
    max_block: int = 32

    def validate(self) -> None:
        """Raises ValueError with a clear message for an inconsistent config."""
        if not self.backends:
            raise ValueError("no backends given")
        for b in self.backends:
            BackendSpec.parse(b)
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise ValueError(f"unknown ops {unknown}; known: {', '.join(OPS)}")
        if self.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.nproc}")
        if not 1 <= self.min_bytes <= self.max_bytes:
            raise ValueError(
                f"need 1 <= min_bytes <= max_bytes, got {self.min_bytes}, {self.max_bytes}"
            )
        if self.factor <= 1:
            raise ValueError(f"factor must be > 1, got {self.factor}")
        if not 1 <= self.min_iters <= self.max_iters:
            raise ValueError(
                f"need 1 <= min_iters <= max_iters, got {self.min_iters}, {self.max_iters}"
            )
        if self.max_block < 1 or self.block_bytes < 1:
            raise ValueError(
                f"need max_block >= 1 and block_bytes >= 1, got {self.max_block}, "
                f"{self.block_bytes}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.nodes < 0:
            raise ValueError(f"nodes must be >= 0, got {self.nodes}")
        if self.nodes and self.nproc % self.nodes:
            raise ValueError(f"nproc ({self.nproc}) must be a multiple of nodes ({self.nodes})")
        if self.rate is not None:
            if not self.nodes:
                raise ValueError("--rate needs an emulated cluster (--nodes N)")
            from .cluster.netns import parse_rate

            parse_rate(self.rate)

    def to_argv(self) -> list[str]:
        """The ``collectives`` command-line arguments that rebuild this config."""
        options = {
            "--backends": ",".join(self.backends),
            "--ops": ",".join(self.ops),
            "--nproc": str(self.nproc),
            "--min-bytes": str(self.min_bytes),
            "--max-bytes": str(self.max_bytes),
            "--factor": repr(self.factor),
            "--iters": str(self.max_iters),
            "--min-iters": str(self.min_iters),
            "--iter-bytes": str(self.iter_bytes),
            "--warmup": str(self.max_warmup),
            "--dtype": self.dtype,
            "--baseline": self.baseline,
            "--nodes": str(self.nodes),
            "--pg-timeout": repr(self.pg_timeout_s),
            "--block-bytes": str(self.block_bytes),
            "--max-block": str(self.max_block),
        }
        argv = [token for pair in options.items() for token in pair]
        if self.out is None:
            argv.append("--no-out")
        else:
            argv += ["--out", self.out]
        if self.rate is not None:
            argv += ["--rate", self.rate]
        if not self.plot:
            argv.append("--no-plot")
        if not self.progress:
            argv.append("--no-progress")
        if self.threads is not None:
            argv += ["--threads", str(self.threads)]
        if self.label:
            argv += ["--label", self.label]
        if not self.interleave:
            argv.append("--no-interleave")
        return argv


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One (backend, op, size) result, as aggregated over ranks.

    Times are microseconds per op; for each sample (``block`` back-to-back
    ops) the slowest rank's time counts. Bandwidths are GB/s (1e9 bytes)
    computed from the p50 time.
    """

    backend: str
    op: str
    nbytes: int
    count: int
    dtype: str
    world_size: int
    iters: int
    warmup: int
    time_us: float
    time_us_mean: float
    time_us_min: float
    time_us_max: float
    algbw_gbps: float
    busbw_gbps: float
    correct: bool
    block: int = 1

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON/CSV row)."""
        return dataclasses.asdict(self)


def default_backends() -> list[str]:
    """``xcomm`` and ``gloo``, plus ``nccl`` when torch sees a GPU."""
    backends = ["xcomm", "gloo"]
    if torch.cuda.is_available() and dist.is_nccl_available():
        backends.append("nccl")
    return backends


def message_sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """``min, min*factor, ...`` up to ``max`` (inclusive), as whole bytes.

    >>> message_sizes(8, 64, 2)
    [8, 16, 32, 64]
    """
    sizes: list[int] = []
    s = float(min_bytes)
    while round(s) <= max_bytes:
        if not sizes or round(s) > sizes[-1]:
            sizes.append(round(s))
        s *= factor
    return sizes


def iteration_counts(nbytes: int, cfg: SweepConfig) -> tuple[int, int]:
    """``(warmup, iters)`` for a message of ``nbytes`` (see the module doc).

    >>> iteration_counts(8, SweepConfig(backends=["gloo"]))
    (5, 20)
    >>> iteration_counts(256 << 20, SweepConfig(backends=["gloo"]))
    (1, 3)
    """
    iters = max(cfg.min_iters, min(cfg.max_iters, cfg.iter_bytes // max(1, nbytes)))
    warmup = max(1, min(cfg.max_warmup, iters // 4))
    return warmup, iters


def block_ops(nbytes: int, cfg: SweepConfig) -> int:
    """Back-to-back ops timed together in one sample of a message of ``nbytes``.

    >>> block_ops(4096, SweepConfig(backends=["gloo"]))
    32
    >>> block_ops(64 << 20, SweepConfig(backends=["gloo"]))
    1
    """
    return max(1, min(cfg.max_block, cfg.block_bytes // max(1, nbytes)))


def _sync_fn(device: str) -> Callable[[], None]:
    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


@dataclasses.dataclass
class _Target:
    """One backend's view of a measurement: its group, the buffers, how to sync."""

    spec: BackendSpec
    group: Any
    case: Case
    sync: Callable[[], None]

    def timed_block(self, ops: int) -> float:
        """Seconds per op of ``ops`` back-to-back ops, after one untimed op
        that lines the ranks up on this backend."""
        self.case.run(self.group)
        self.sync()
        t0 = time.perf_counter()
        for _ in range(ops):
            self.case.run(self.group)
        self.sync()
        return (time.perf_counter() - t0) / ops


def _measure(
    targets: list[_Target], coord: Any, warmup: int, iters: int, block: int, interleave: bool
) -> list[tuple[list[float], bool]]:
    """Times one (op, size) on every backend; returns, per target, the
    per-sample seconds per op of the slowest rank and whether all ranks were right."""
    for t in targets:
        t.case.reset()
        for _ in range(warmup):
            t.case.run(t.group)
        t.sync()
    times = torch.zeros(len(targets), iters, dtype=torch.float64)
    if interleave:  # round-robin: a burst of load hits every backend alike
        dist.barrier(group=coord)
        for i in range(iters):
            for j, t in enumerate(targets):
                times[j, i] = t.timed_block(block)
    else:
        for j, t in enumerate(targets):
            dist.barrier(group=coord)
            for i in range(iters):
                times[j, i] = t.timed_block(block)
    oks = torch.zeros(len(targets), dtype=torch.int32)
    for j, t in enumerate(targets):
        t.case.prepare_check()
        t.sync()
        dist.barrier(group=coord)
        t.case.run(t.group)
        t.sync()
        oks[j] = int(t.case.check())
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=coord)
    dist.all_reduce(oks, op=dist.ReduceOp.MIN, group=coord)
    return [(times[j].tolist(), bool(oks[j].item())) for j in range(len(targets))]


def run_sweep(
    cfg: SweepConfig, *, rank: int, world_size: int, local_rank: int = 0
) -> list[Measurement]:
    """Runs the sweep in an initialised default process group (any backend).

    Every rank must call it with the same config. Returns the measurements
    (the same list on every rank).
    """
    from tqdm import tqdm

    cfg.validate()
    specs = [BackendSpec.parse(b) for b in cfg.backends]
    if any(s.device == "cuda" for s in specs):
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
    timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)
    coord = dist.new_group(backend="gloo", timeout=timeout)
    groups = {
        s: dist.new_group(backend=s.name, timeout=timeout, pg_options=s.pg_options()) for s in specs
    }
    dtype = _DTYPES[cfg.dtype]
    sizes = message_sizes(cfg.min_bytes, cfg.max_bytes, cfg.factor)
    results: list[Measurement] = []
    bar = tqdm(
        total=len(sizes) * len(cfg.ops) * len(specs),
        disable=not cfg.progress or rank != 0,
        desc="collectives",
        unit="meas",
        file=sys.stderr,
        dynamic_ncols=True,
    )
    with bar:
        for nbytes in sizes:
            warmup, iters = iteration_counts(nbytes, cfg)
            for op in cfg.ops:
                bar.set_postfix_str(f"{op} {_human_bytes(nbytes)}", refresh=False)
                cases = {
                    dev: make_case(
                        op, nbytes, rank=rank, world_size=world_size, dtype=dtype, device=dev
                    )
                    for dev in dict.fromkeys(s.device for s in specs)
                }
                targets = [
                    _Target(s, groups[s], cases[s.device], _sync_fn(s.device)) for s in specs
                ]
                block = block_ops(nbytes, cfg)
                measured = _measure(targets, coord, warmup, iters, block, cfg.interleave)
                for t, (times, ok) in zip(targets, measured, strict=True):
                    p50 = percentile(times, 50)
                    results.append(
                        Measurement(
                            backend=t.spec.label,
                            op=op,
                            nbytes=t.case.nbytes,
                            count=t.case.count,
                            dtype=cfg.dtype,
                            world_size=world_size,
                            iters=iters,
                            warmup=warmup,
                            time_us=p50 * 1e6,
                            time_us_mean=sum(times) / len(times) * 1e6,
                            time_us_min=min(times) * 1e6,
                            time_us_max=max(times) * 1e6,
                            algbw_gbps=algbw(t.case.nbytes, p50),
                            busbw_gbps=busbw(t.case.nbytes, p50, op, world_size),
                            correct=ok,
                            block=block,
                        )
                    )
                bar.update(len(specs))
                del cases, targets
    return results


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n} B"


def metadata(cfg: SweepConfig, world_size: int) -> dict[str, Any]:
    """Describes the run: config, machine, versions (stored in the JSON)."""
    try:
        import xcomm

        xcomm_version = getattr(xcomm, "__version__", "?")
    except Exception:  # noqa: BLE001 - metadata only: a broken build still gets a report
        xcomm_version = "not importable"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "tool": "python -m xcomm_bench collectives",
        "argv": cfg.to_argv(),
        "config": dataclasses.asdict(cfg),
        "world_size": world_size,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "xcomm": xcomm_version,
        "git_commit": commit,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_rank(cfg: SweepConfig) -> int:
    """Body of one rank started with the ``env://`` variables set.

    Initialises torch.distributed (a gloo default group), runs the sweep and,
    on rank 0, prints the table and writes the report files.
    """
    import xcomm  # noqa: F401 - registers the "xcomm" backend

    from . import report

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=cfg.pg_timeout_s),
    )
    try:
        results = run_sweep(cfg, rank=rank, world_size=world_size, local_rank=local_rank)
        if rank == 0:
            print(report.format_table(results, baseline=cfg.baseline), flush=True)
            if cfg.out is not None:
                paths = report.write_all(
                    Path(cfg.out),
                    results,
                    metadata(cfg, world_size),
                    baseline=cfg.baseline,
                    plot_png=cfg.plot,
                )
                print("wrote " + ", ".join(str(p) for p in paths), flush=True)
        bad = [m for m in results if not m.correct]
        if bad:
            print(
                f"rank {rank}: {len(bad)} measurements FAILED the correctness check",
                file=sys.stderr,
            )
            return 1
        return 0
    finally:
        dist.destroy_process_group()


def _rank_command(cfg: SweepConfig) -> list[str]:
    return module_command("xcomm_bench", "collectives", "--launcher", "env", *cfg.to_argv())


def launch(cfg: SweepConfig, *, timeout: float | None = None) -> int:
    """Starts ``cfg.nproc`` ranks (loopback, or an emulated cluster when ``cfg.nodes``) and waits.

    Returns:
        0 when every rank succeeded (including the correctness checks), 124
        when ``timeout`` killed them, else the first non-zero exit status.
    """
    cfg.validate()
    return run_ranks(_rank_command(cfg), cfg.nproc, nodes=cfg.nodes, rate=cfg.rate, timeout=timeout)


def parse_size(text: str) -> int:
    """Parses ``"8"``, ``"64K"``, ``"256M"``, ``"1G"`` (binary units) into bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    try:
        value = float(t) * mult
    except ValueError as e:
        raise ValueError(
            f"cannot parse size {text!r}: use bytes or K/M/G (binary), e.g. 256M"
        ) from e
    return int(value)


def parse_list(text: str) -> list[str]:
    """Splits a comma-separated option value."""
    return [t.strip() for t in text.split(",") if t.strip()]
