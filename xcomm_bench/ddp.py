"""End-to-end DDP benchmark: time and bytes per step for each gradient reduction.

For every model (an MLP of ~20M parameters, a small CNN, a small
transformer; synthetic data), every reduction and every link rate, the ranks
train with DDP and measure:

* **time/step**: wall time of ``zero_grad + forward + backward + optimizer
  step`` (DDP's backward returns once every bucket is reduced), per step the
  slowest rank's time, p50 over the timed steps;
* **bytes/step (accounted)**: the traffic the reduction's collectives put on
  one rank's link, counted as :mod:`xcomm.hooks.stats` does (a ring
  allreduce of ``b`` bytes costs ``2 (n-1)/n * b``, an allgather ``(n-1) *
  b_own``): xcomm's hooks count it themselves; for torch's hooks and plain
  DDP it is computed the same way from what they send;
* **link tx/step (measured)**: in the emulated cluster, bytes the node's veth
  transmitted per timed step (payload plus TCP/IP headers and ACKs), read
  from ``/sys/class/net/<if>/statistics/tx_bytes``, mean over ranks;
* **speedup**: ``time(none) / time(reduction)``, for the same model and rate,
  measured by the same processes in the same run;
* **CPU/step**: CPU time of a rank's process (all its threads) per step,
  mean over ranks, p50 over steps: what a step costs when a core is free,
  whatever else runs on the host.

Reductions: ``none`` (DDP's own allreduce), xcomm's hooks ``fp16``,
``int8``, ``topk``, ``powersgd`` (:mod:`xcomm.hooks`) and torch's built-ins
``torch-fp16`` (``default_hooks.fp16_compress_hook``) and ``torch-powersgd``
(``powerSGD_hook.powerSGD_hook``). Both PowerSGDs use the same rank
(default 4) and ``start_powerSGD_iter=2``. ``auto`` is xcomm's ``auto_hook``
(choosing by time per step, ``objective="step_time"``);
``backend-bf16``, ``backend-int8`` and ``backend-auto`` register no hook:
DDP runs on a group made with ``xcomm.Options(compression=...)``, whose
backend compresses the allreduces itself (no error feedback; accounted bytes
are the group's ``compression_stats``). ``unchecked`` is ``none`` on a
group made with ``xcomm.Options(check_collectives=False)``: what the rank
agreement check of a group without shared memory costs a step (``none``
runs with it wherever the group has it).

Warm-up: the first ``warmup`` steps (default 3: DDP rebuilds its buckets
after step 1, PowerSGD compresses from step 3 and allocates its state then)
are not timed. With ``interleave`` (default) every reduction's model is
built first, and the timed steps run in ``rounds`` rounds, each reduction
taking its turn for a block of its steps (at least :data:`MIN_BLOCK`), so a
burst of load from other processes on the host hits all of them alike.
With ``min_seconds``, the contenders of each comparison (the autos, and the
static reductions within :data:`CONTENDER_FACTOR` of the fastest) run
enough timed steps that the fastest's take that long; the others keep
``steps``. Each result keeps every timed step's time, and the auto tables
give a 90% block-bootstrap interval of auto / fastest (:func:`ratio_interval`).

Each link rate gets its own emulated cluster (``nodes`` network namespaces,
veth + bridge + tbf, needs root; see :mod:`xcomm_bench.cluster`); ``nodes=0``
runs the ranks on loopback (``--smoke`` does so with tiny models, for tests),
with xcomm's shared-memory path off unless ``XCOMM_SHM`` is set (torch's
``powerSGD_hook`` currently times out on it).

Example::

    python -m xcomm_bench ddp --rates 0.1gbit,1gbit,10gbit --out bench-results/ddp
    python -m xcomm_bench ddp --models mlp --rates 1gbit --reductions none,powersgd,torch-powersgd
    python -m xcomm_bench ddp --smoke   # loopback, tiny models, seconds
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .launch import module_command, run_ranks

__all__ = [
    "ALL_MODELS",
    "DEFAULT_REDUCTIONS",
    "EXTRA_MODELS",
    "MODELS",
    "REDUCTIONS",
    "DDPBenchConfig",
    "DDPResult",
    "build_model",
    "format_table",
    "launch",
    "plot_speedup",
    "run_rank",
]

#: Models, in report order: the default sweep.
MODELS: tuple[str, ...] = ("mlp", "cnn", "transformer")
#: Families outside the default sweep, run when ``--models`` names them: an
#: embedding table whose dense gradients are almost all exact zeros, and a
#: deep narrow MLP (many small buckets' worth of layers). auto was tuned on
#: :data:`MODELS` only; these check it on gradients it never saw.
EXTRA_MODELS: tuple[str, ...] = ("embedding", "deep")
#: Every model ``--models`` accepts, in report order.
ALL_MODELS: tuple[str, ...] = MODELS + EXTRA_MODELS
#: Reductions, in report order; ``none`` is the baseline of the speedups.
REDUCTIONS: tuple[str, ...] = (
    "none",
    "fp16",
    "int8",
    "topk",
    "powersgd",
    "torch-fp16",
    "torch-powersgd",
    "auto",
    "backend-bf16",
    "backend-int8",
    "backend-auto",
    "unchecked",
)
#: What a run compares unless told otherwise (``unchecked`` only matters on
#: groups without shared memory, and is asked for by name).
DEFAULT_REDUCTIONS: tuple[str, ...] = tuple(r for r in REDUCTIONS if r != "unchecked")
#: The static reductions each auto is compared with: the hook's against every
#: other reduction of the run, the backend's against what it chooses from.
_AUTO_PEERS: dict[str, tuple[str, ...] | None] = {
    "auto": None,
    "backend-auto": ("none", "backend-bf16", "backend-int8"),
}


#: Groups whose backend compresses, one per ``backend-*`` reduction, made once
#: (in the same order on every rank) and shared by every model.
_BACKEND_GROUPS: dict[str, Any] = {}


def _own_group(reduction: str) -> bool:
    """Whether the reduction runs DDP on a group of its own (see ``_backend_group``)."""
    return reduction.startswith("backend-") or reduction == "unchecked"


def _backend_group(reduction: str, group: Any) -> Any:
    if reduction not in _BACKEND_GROUPS:
        import xcomm

        if reduction == "unchecked":
            options = xcomm.Options(check_collectives=False)
        else:
            options = xcomm.Options(compression=reduction.removeprefix("backend-"))
        _BACKEND_GROUPS[reduction] = dist.new_group(
            dist.get_process_group_ranks(group), backend="xcomm", pg_options=options
        )
    return _BACKEND_GROUPS[reduction]


#: Reductions whose steps are compressed only after ``start_iter`` plain steps.
_START_ITER = 2


# ----------------------------------------------------------------------------- models


class _TinyLM(torch.nn.Module):
    """Token embedding + transformer encoder + vocabulary head (a small causal-free LM)."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d_model))
        layer = torch.nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens) + self.pos[: tokens.shape[1]])
        return self.head(h).flatten(0, 1)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model and its synthetic batch.

    Attributes:
        name: One of :data:`ALL_MODELS`.
        build: Returns a fresh module.
        batch: ``batch(generator) -> (inputs, targets)`` for one rank's step.
    """

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def build_model(name: str, *, smoke: bool = False, batch_size: int | None = None) -> ModelSpec:
    """The benchmark's models; ``smoke`` shrinks them to a few thousand parameters.

    * ``mlp``: 784 -> 5 x 2048 -> 1000 with ReLU, 20.4M parameters, batch 16.
    * ``cnn``: 3 conv(3x3)+ReLU+maxpool blocks (32, 64, 128 channels) on
      3x32x32 images, then 2048 -> 512 -> 10; 1.15M parameters, batch 16.
    * ``transformer``: vocabulary 4096, d_model 256, 4 heads, 2 layers,
      sequence 32; 3.7M parameters, batch 8 sequences.
    * ``embedding``: ``EmbeddingBag(200_000, 64)`` (mean of bags of 32
      uniform ids) -> 256 -> 10 with ReLU; 12.8M parameters, batch 16. Its
      gradients are dense (DDP reduces the whole table) and ~99.7% exact
      zeros: a step touches at most 512 of the 200,000 rows.
    * ``deep``: 24 x (Linear(512, 512) + ReLU), then 512 -> 10; 6.3M
      parameters, batch 16.

    Example::

        >>> spec = build_model("embedding", smoke=True)
        >>> x, y = spec.batch(torch.Generator().manual_seed(0))
        >>> spec.build()(x).shape == (y.shape[0], 10)
        True
    """
    if name == "mlp":
        dims = [32, 64, 64, 10] if smoke else [784, 2048, 2048, 2048, 2048, 2048, 1000]
        bs = batch_size or (8 if smoke else 16)

        def build() -> torch.nn.Module:
            layers: list[torch.nn.Module] = []
            for i, (a, b) in enumerate(itertools.pairwise(dims)):
                layers.append(torch.nn.Linear(a, b))
                if i < len(dims) - 2:
                    layers.append(torch.nn.ReLU())
            return torch.nn.Sequential(*layers)

        def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(bs, dims[0], generator=g), torch.randint(
                dims[-1], (bs,), generator=g
            )

        return ModelSpec(name, build, batch)
    if name == "cnn":
        chans = [3, 4, 8, 8] if smoke else [3, 32, 64, 128]
        hidden = 16 if smoke else 512
        side = 8 if smoke else 32
        bs = batch_size or (4 if smoke else 16)

        def build() -> torch.nn.Module:
            layers: list[torch.nn.Module] = []
            for a, b in itertools.pairwise(chans):
                layers += [
                    torch.nn.Conv2d(a, b, 3, padding=1),
                    torch.nn.ReLU(),
                    torch.nn.MaxPool2d(2),
                ]
            flat = chans[-1] * (side // 8) ** 2
            layers += [
                torch.nn.Flatten(),
                torch.nn.Linear(flat, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, 10),
            ]
            return torch.nn.Sequential(*layers)

        def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(bs, 3, side, side, generator=g), torch.randint(
                10, (bs,), generator=g
            )

        return ModelSpec(name, build, batch)
    if name == "transformer":
        vocab, d, heads, layers_n, seq = (64, 16, 2, 1, 8) if smoke else (4096, 256, 4, 2, 32)
        bs = batch_size or (2 if smoke else 8)

        def build() -> torch.nn.Module:
            return _TinyLM(vocab, d, heads, layers_n, seq)

        def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            tokens = torch.randint(vocab, (bs, seq), generator=g)
            return tokens, torch.randint(vocab, (bs * seq,), generator=g)

        return ModelSpec(name, build, batch)
    if name == "embedding":
        rows, dim, hidden, bag = (1000, 8, 16, 4) if smoke else (200_000, 64, 256, 32)
        bs = batch_size or (4 if smoke else 16)

        def build() -> torch.nn.Module:
            return torch.nn.Sequential(
                torch.nn.EmbeddingBag(rows, dim, mode="mean"),
                torch.nn.Linear(dim, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, 10),
            )

        def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            # A 2-D input is one bag per row, all of the same length.
            ids = torch.randint(rows, (bs, bag), generator=g)
            return ids, torch.randint(10, (bs,), generator=g)

        return ModelSpec(name, build, batch)
    if name == "deep":
        width, depth = (16, 4) if smoke else (512, 24)
        bs = batch_size or (4 if smoke else 16)

        def build() -> torch.nn.Module:
            layers: list[torch.nn.Module] = []
            for _ in range(depth):
                layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
            layers.append(torch.nn.Linear(width, 10))
            return torch.nn.Sequential(*layers)

        def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(bs, width, generator=g), torch.randint(10, (bs,), generator=g)

        return ModelSpec(name, build, batch)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(ALL_MODELS)}")


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass
class DDPBenchConfig:
    """Everything that defines a DDP benchmark run (also its command line, :meth:`to_argv`).

    Attributes:
        models: Subset of :data:`ALL_MODELS` (default :data:`MODELS`).
        reductions: Subset of :data:`REDUCTIONS`; ``none`` is added (it is the baseline).
        rates: Link rates, one emulated cluster each (e.g. ``["0.1gbit", "1gbit"]``);
            ignored on loopback (``nodes=0``).
        nodes: Emulated nodes (0 = loopback, no root needed).
        ranks_per_node: Ranks per node.
        steps: Timed steps per (model, reduction, rate).
        warmup: Untimed steps first (>= 3: bucket rebuild, then PowerSGD's first step).
        rounds: Rounds the timed steps are split into when interleaving.
        min_seconds: More timed steps for the contenders of each comparison
            where ``steps`` of the fastest reduction (timed on its last
            warm-up step, the slowest rank's) would take less than this: a
            point whose steps take 25 ms gets as many seconds of samples as
            one whose steps take 150 ms (:func:`_timed_steps`). The same
            counts on every rank. 0: ``steps`` for every reduction.
        interleave: Build all reductions' models, then time them round-robin.
        powersgd_rank: ``matrix_approximation_rank`` of both PowerSGDs.
        topk_density: Fraction of entries top-k sends.
        backend: Process-group backend DDP reduces over (``xcomm`` or ``gloo``).
        bucket_cap_mb: DDP's bucket size.
        threads: torch threads per rank (default: cores / total ranks, >= 1).
        smoke: Tiny models (a test's few seconds).
        out: Folder for ``ddp.{csv,json,md,png}``; ``None`` writes nothing.
        plot: Write the PNG.
        progress: tqdm bar on rank 0.
        label: Free text stored in the JSON.
        pg_timeout_s: Process-group timeout.
    """

    models: list[str] = dataclasses.field(default_factory=lambda: list(MODELS))
    reductions: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_REDUCTIONS))
    rates: list[str] = dataclasses.field(default_factory=lambda: ["0.1gbit", "1gbit", "10gbit"])
    nodes: int = 2
    ranks_per_node: int = 1
    steps: int = 8
    warmup: int = 3
    rounds: int = 2
    min_seconds: float = 0.0
    interleave: bool = True
    powersgd_rank: int = 4
    topk_density: float = 0.01
    backend: str = "xcomm"
    bucket_cap_mb: float = 25.0
    threads: int | None = None
    smoke: bool = False
    out: str | None = "bench-results/ddp"
    plot: bool = True
    progress: bool = True
    label: str = ""
    pg_timeout_s: float = 900.0

    def validate(self) -> None:
        """Raises ValueError with a clear message for an inconsistent config."""
        bad = [m for m in self.models if m not in ALL_MODELS]
        if bad or not self.models:
            raise ValueError(f"unknown models {bad}; known: {', '.join(ALL_MODELS)}")
        bad = [r for r in self.reductions if r not in REDUCTIONS]
        if bad or not self.reductions:
            raise ValueError(f"unknown reductions {bad}; known: {', '.join(REDUCTIONS)}")
        if self.warmup < _START_ITER + 1:
            raise ValueError(
                f"warmup must be >= {_START_ITER + 1} (DDP rebuilds buckets after step 1, "
                f"PowerSGD starts at step {_START_ITER + 1}), got {self.warmup}"
            )
        if self.steps < 1 or self.rounds < 1:
            raise ValueError(f"steps and rounds must be >= 1, got {self.steps}, {self.rounds}")
        if not self.min_seconds >= 0:
            raise ValueError(f"min_seconds must be >= 0, got {self.min_seconds}")
        if self.nodes < 0 or self.ranks_per_node < 1:
            raise ValueError("nodes must be >= 0 and ranks_per_node >= 1")
        if self.world_size < 2:
            raise ValueError("DDP needs at least 2 ranks (nodes x ranks_per_node)")
        if self.powersgd_rank < 1:
            raise ValueError(f"powersgd_rank must be >= 1, got {self.powersgd_rank}")
        if not 0 < self.topk_density <= 1:
            raise ValueError(f"topk_density must be in (0, 1], got {self.topk_density}")
        if self.nodes:
            from .cluster.netns import parse_rate

            if not self.rates:
                raise ValueError("give at least one rate for the emulated cluster")
            for r in self.rates:
                parse_rate(r)

    @property
    def world_size(self) -> int:
        """Total ranks (loopback: ``ranks_per_node``, at least 2)."""
        return (self.nodes or 1) * self.ranks_per_node

    @property
    def ordered_reductions(self) -> list[str]:
        """The reductions to run, ``none`` first, in :data:`REDUCTIONS` order."""
        wanted = set(self.reductions) | {"none"}
        return [r for r in REDUCTIONS if r in wanted]

    def to_argv(self) -> list[str]:
        """The ``ddp`` command-line arguments that rebuild this config."""
        argv = [
            "--models", ",".join(self.models),
            "--reductions", ",".join(self.reductions),
            "--rates", ",".join(self.rates),
            "--nodes", str(self.nodes),
            "--ranks-per-node", str(self.ranks_per_node),
            "--steps", str(self.steps),
            "--warmup", str(self.warmup),
            "--rounds", str(self.rounds),
            "--min-seconds", repr(self.min_seconds),
            "--powersgd-rank", str(self.powersgd_rank),
            "--topk-density", repr(self.topk_density),
            "--backend", self.backend,
            "--bucket-cap-mb", repr(self.bucket_cap_mb),
            "--pg-timeout", repr(self.pg_timeout_s),
        ]  # fmt: skip
        if not self.interleave:
            argv.append("--no-interleave")
        if self.threads is not None:
            argv += ["--threads", str(self.threads)]
        if self.smoke:
            argv.append("--smoke")
        argv += ["--no-out"] if self.out is None else ["--out", self.out]
        if not self.plot:
            argv.append("--no-plot")
        if not self.progress:
            argv.append("--no-progress")
        if self.label:
            argv += ["--label", self.label]
        return argv


@dataclasses.dataclass(frozen=True)
class DDPResult:
    """One (model, rate, reduction) measurement.

    ``time_ms`` is the p50 over timed steps of the slowest rank's step time;
    ``bytes_per_step`` the accounted link traffic of one rank;
    ``link_tx_per_step`` the measured veth tx bytes (NaN on loopback);
    ``speedup`` is ``time_ms(none) / time_ms`` in the same run.
    """

    model: str
    params: int
    rate: str
    reduction: str
    steps: int
    time_ms: float
    time_ms_p25: float
    time_ms_p75: float
    bytes_per_step: float
    link_tx_per_step: float
    speedup: float
    final_loss: float
    cpu_ms: float = math.nan
    #: auto only: the method of each bucket at the end, e.g. "powersgd,powersgd".
    chosen: str = ""
    #: auto only: why, at the end (the hook's ``explain()``; the backend's
    #: agreed inputs and last choice).
    explain: str = ""
    #: Every timed step's time (ms, the slower rank's), in the order run; in
    #: the JSON only (not the CSV).
    step_ms: list[float] = dataclasses.field(default_factory=list)
    #: The hook's auto only: which timed steps ran a measuring round.
    round_steps: list[bool] = dataclasses.field(default_factory=list)
    #: The hook's auto only: which timed steps ran every bucket uncompressed
    #: (a trial of its whole-step check, its verdict, or its choice), so the
    #: cost of its check can be read from the steps.
    uncompressed_steps: list[bool] = dataclasses.field(default_factory=list)
    #: The hook's auto only: each change of its per-bucket methods during the
    #: timed steps, ``{"step": i, "chosen": "...", "explain": "..."}`` (``i``
    #: the timed step after which it was seen), so an excursion to a slower
    #: method can be told from noise and its reason read; in the JSON only.
    changes: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (a JSON/CSV row)."""
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- one rank


class _InOrder:
    """State of :func:`_in_order_hook`: runs ``hook`` on one bucket at a time.

    torch's ``powerSGD_hook`` issues its P and Q allreduces from future
    callbacks. With several buckets, a callback of bucket i and the hook call
    of bucket i+1 race, and ranks can issue the collectives in different
    orders: on Gloo (and xcomm, which delegates to it) that is a collective
    mismatch and the process aborts ("Received data size doesn't match
    expected size"); measured here on the ~20M-parameter MLP (4 buckets).
    Starting bucket i+1's hook once bucket i's future is done keeps the order
    identical on every rank (xcomm's hooks do the same internally with
    ``IssueOrder``).
    """

    def __init__(self, state: Any, hook: Callable[..., torch.futures.Future]) -> None:
        self.state = state
        self.hook = hook
        self.tail: torch.futures.Future | None = None


# No annotations: DDP checks a hook's annotations at run time, and this
# module's are strings (``from __future__ import annotations``).
def _in_order_hook(wrapper, bucket):  # type: ignore[no-untyped-def]
    out: torch.futures.Future = torch.futures.Future()
    prev, wrapper.tail = wrapper.tail, out

    def finish(f: torch.futures.Future) -> None:
        try:
            out.set_result(f.value())
        except Exception as e:  # noqa: BLE001 - handed to DDP through the future
            out.set_exception(e)

    def start(f: torch.futures.Future | None = None) -> None:
        try:
            if f is not None:
                f.value()  # the previous bucket failed: fail this one too
            wrapper.hook(wrapper.state, bucket).add_done_callback(finish)
        except Exception as e:  # noqa: BLE001
            out.set_exception(e)

    if prev is None:
        start()
    else:
        prev.add_done_callback(start)  # runs at once when prev is already done
    return out


def _allreduce_bytes(nbytes: float, world: int) -> float:
    return 2 * (world - 1) * nbytes / world


class _Runner:
    """One DDP model with one reduction registered; runs steps and counts bytes."""

    def __init__(
        self, spec: ModelSpec, reduction: str, cfg: DDPBenchConfig, group: Any, rank: int
    ) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(1234)  # same initial weights on every rank, every reduction
        self.reduction = reduction
        if _own_group(reduction):
            group = _backend_group(reduction, group)
        self.module = spec.build()
        self.params = sum(p.numel() for p in self.module.parameters())
        self.grad_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters())
        self.model = DDP(
            self.module,
            process_group=group,
            bucket_cap_mb=cfg.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )
        self.world = group.size()
        self.state = self._register(reduction, cfg, group)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.gen = torch.Generator().manual_seed(100 + rank)
        self.batch = spec.batch
        self.times: list[float] = []
        self.rounds: list[bool] = []  # auto: which timed steps ran a measuring round
        self.uncompressed: list[bool] = []  # auto: which timed steps ran every bucket "none"
        self.changes: list[dict[str, Any]] = []  # auto: its method changes (DDPResult.changes)
        self.last_warm = math.inf  # the last untimed step's seconds
        self.cpu: list[float] = []
        self.accounted = 0.0
        self.tx = 0
        self.loss = math.nan

    def _register(self, reduction: str, cfg: DDPBenchConfig, group: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

        from xcomm import hooks as xhooks

        m = self.model
        if reduction in ("none", "unchecked"):
            return None
        if reduction.startswith("backend-"):
            return group._get_backend(torch.device("cpu"))  # its compression_stats count
        if reduction == "fp16":
            state: Any = xhooks.CastState(process_group=group)
            m.register_comm_hook(state, xhooks.fp16_cast_hook)
        elif reduction == "int8":
            state = xhooks.Int8State(process_group=group, start_iter=_START_ITER)
            m.register_comm_hook(state, xhooks.int8_compress_hook)
        elif reduction == "topk":
            state = xhooks.TopKState(
                process_group=group, density=cfg.topk_density, start_iter=_START_ITER
            )
            m.register_comm_hook(state, xhooks.topk_hook)
        elif reduction == "powersgd":
            state = xhooks.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=cfg.powersgd_rank,
                start_powerSGD_iter=_START_ITER,
            )
            m.register_comm_hook(state, xhooks.powersgd_hook)
        elif reduction == "auto":
            state = xhooks.AutoState(
                process_group=group,
                methods=("none", "fp16", "int8", "topk", "powersgd"),
                min_density=cfg.topk_density,
                powersgd_rank=cfg.powersgd_rank,
                start_iter=_START_ITER,
                # This benchmark compares time per step: auto is asked for the
                # fastest step (its default objective, time to accuracy, would
                # trade a faster step for fewer steps: time_to_accuracy.py).
                objective="step_time",
            )
            m.register_comm_hook(state, xhooks.auto_hook)
        elif reduction == "torch-fp16":
            state = group
            m.register_comm_hook(group, default_hooks.fp16_compress_hook)
        elif reduction == "torch-powersgd":
            state = torch_psgd.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=cfg.powersgd_rank,
                start_powerSGD_iter=_START_ITER,
            )
            state = _InOrder(state, torch_psgd.powerSGD_hook)
            m.register_comm_hook(state, _in_order_hook)
        else:
            raise ValueError(f"unknown reduction {reduction!r}")
        return state

    def _accounted_total(self) -> float:
        """Link bytes the reduction has sent so far, counted as xcomm.hooks.stats does."""
        s = self.state.state if isinstance(self.state, _InOrder) else self.state
        if self.reduction in ("fp16", "int8", "topk", "powersgd", "auto"):
            return float(s.stats.link_bytes_sent)
        if self.reduction.startswith("backend-"):
            return float(self.state.compression_stats["link_bytes_sent"])
        if self.reduction == "torch-powersgd":
            # Elements torch's hook sent while compressing (P, Q and the
            # uncompressed tensors, each in an allreduce), float32. Timed steps
            # all compress: the warm-up covers the plain ones.
            return _allreduce_bytes(4 * s.total_numel_after_compression, self.world)
        return 0.0

    def _per_step_formula(self) -> float:
        if self.reduction in ("none", "unchecked"):
            return _allreduce_bytes(self.grad_bytes, self.world)
        if self.reduction == "torch-fp16":
            return _allreduce_bytes(self.grad_bytes / 2, self.world)
        return 0.0

    def step(self) -> tuple[float, float]:
        """One training step: (wall seconds, CPU seconds of all this process's threads)."""
        x, y = self.batch(self.gen)
        c0, t0 = time.process_time(), time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        self.loss = float(loss.detach())
        return dt, dc

    def run(self, steps: int, timed: bool, ifname: str | None) -> None:
        tx0 = _tx_bytes(ifname)
        acc0 = self._accounted_total()
        due = getattr(self.state, "next_round", None)  # AutoState only
        for _ in range(steps):
            dt, dc = self.step()
            if timed:
                self.times.append(dt)
                self.cpu.append(dc)
                if due is not None:
                    # A round moves next_round past the step it was due at.
                    self.rounds.append(self.state.next_round > due)
                    due = self.state.next_round
                    ran = set(self.state.ran.values())
                    self.uncompressed.append(bool(ran) and ran <= {"none"})
                    self._note_change()
            else:
                self.last_warm = dt
        if timed:
            self.accounted += self._accounted_total() - acc0 + steps * self._per_step_formula()
            self.tx += _tx_bytes(ifname) - tx0

    def _note_change(self) -> None:
        """Records auto's methods and ``explain()`` when they differ from the last
        recorded (the first timed step always records)."""
        chosen = _chosen(self.state)
        if not self.changes or self.changes[-1]["chosen"] != chosen:
            step = len(self.times) - 1
            self.changes.append({"step": step, "chosen": chosen, "explain": _explain(self.state)})


def _tx_bytes(ifname: str | None) -> int:
    if not ifname:
        return 0
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes", encoding="ascii") as f:
            return int(f.read())
    except OSError:
        return 0


def _split(total: int, parts: int) -> list[int]:
    """``total`` steps in ``parts`` parts as evenly as they go (a part may get 0)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


#: The fewest steps a runner runs back to back in a round. auto times its
#: steps from one to the next and sizes its probes from the median of the
#: last five: in blocks of one or two, most of those would span other
#: runners' blocks.
MIN_BLOCK = 4


def _blocks(total: int, rounds: int) -> list[int]:
    """A runner's ``total`` timed steps over ``rounds`` rounds: per round, how
    many it runs. Blocks of at least :data:`MIN_BLOCK` steps (where it has
    that many), spread evenly over the rounds.

    Example::

        >>> _blocks(13, 3), _blocks(9, 4), _blocks(2, 3)
        ([5, 4, 4], [5, 0, 4, 0], [2, 0, 0])
    """
    k = max(1, min(rounds, total // MIN_BLOCK))
    out = [0] * rounds
    for i, n in enumerate(_split(total, k)):
        out[i * rounds // k] = n
    return out


def _schedule(
    spec: ModelSpec,
    cfg: DDPBenchConfig,
    group: Any,
    rank: int,
    timed_steps: Callable[[list[_Runner]], list[int]],
) -> Iterator[tuple[_Runner, int, bool]]:
    """Yields (runner, steps, timed) blocks in the order they must run (same on
    every rank); ``timed_steps(runners)`` gives each runner's timed steps once
    the runners are warm."""
    reductions = cfg.ordered_reductions
    if cfg.interleave:
        runners = [_Runner(spec, r, cfg, group, rank) for r in reductions]
        for runner in runners:
            yield runner, cfg.warmup, False
        chunks = [_blocks(n, cfg.rounds) for n in timed_steps(runners)]
        for i in range(cfg.rounds):
            for runner, chunk in zip(runners, chunks):
                if chunk[i]:
                    yield runner, chunk[i], True
    else:
        for r in reductions:
            runner = _Runner(spec, r, cfg, group, rank)
            yield runner, cfg.warmup, False
            yield runner, timed_steps([runner])[0], True


#: A reduction whose warm-up step took at most this many times the fastest
#: static one's of its comparison is a contender (it gets ``min_seconds``).
CONTENDER_FACTOR = 2.0


def _families(reductions: Sequence[str]) -> list[tuple[list[str], str | None]]:
    """The comparisons the report makes: (static reductions, the auto compared
    with them) for the hook's auto (every static reduction) and the backend's
    (what it chooses from); a run without autos still times its fastest."""
    hook = [r for r in reductions if r not in _AUTO_PEERS]
    fams: list[tuple[list[str], str | None]] = [(hook, "auto" if "auto" in reductions else None)]
    if "backend-auto" in reductions:
        peers = _AUTO_PEERS["backend-auto"]
        assert peers is not None
        fams.append(([r for r in reductions if r in peers], "backend-auto"))
    return fams


def _timed_steps(cfg: DDPBenchConfig, runners: list[_Runner], coord: Any) -> list[int]:
    """Each runner's timed steps: ``cfg.steps``, and for the contenders of each
    comparison (its auto, and the static reductions whose last warm-up step
    took at most :data:`CONTENDER_FACTOR` x the fastest one's, the slowest
    rank's readings) enough that the fastest one's take ``cfg.min_seconds``.

    The points the report compares (auto against the fastest static choice)
    get many samples; a reduction several times slower than the fastest (no
    compression on a slow link: seconds a step) keeps ``cfg.steps``.
    """
    counts = [cfg.steps] * len(runners)
    if cfg.min_seconds <= 0:
        return counts
    warm = torch.tensor([r.last_warm for r in runners], dtype=torch.float64)
    dist.all_reduce(warm, op=dist.ReduceOp.MAX, group=coord)
    took = dict(zip((r.reduction for r in runners), warm.tolist()))
    for statics, auto in _families([r.reduction for r in runners]):
        if not statics:
            continue
        fastest = max(min(took[r] for r in statics), 1e-6)
        n = max(cfg.steps, math.ceil(cfg.min_seconds / fastest))
        for i, runner in enumerate(runners):
            r = runner.reduction
            if r == auto or (r in statics and took[r] <= CONTENDER_FACTOR * fastest):
                counts[i] = max(counts[i], n)
    return counts


def run_model(
    spec: ModelSpec,
    cfg: DDPBenchConfig,
    *,
    rate: str,
    group: Any,
    coord: Any,
    rank: int,
    bar: Any,
) -> list[DDPResult]:
    """Measures every reduction on one model; returns the same results on every rank."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") if cfg.nodes else None
    done: dict[str, _Runner] = {}

    def timed_steps(runners: list[_Runner]) -> list[int]:
        steps = _timed_steps(cfg, runners, coord)
        extra = sum(steps) - cfg.steps * len(runners)
        if extra:  # the bar planned cfg.steps per reduction
            bar.total += extra
            bar.refresh()
        return steps

    for runner, steps, timed in _schedule(spec, cfg, group, rank, timed_steps):
        bar.set_postfix_str(f"{spec.name} {runner.reduction}", refresh=True)
        dist.barrier(group=coord)
        runner.run(steps, timed, ifname)
        bar.update(steps)
        done[runner.reduction] = runner
    reductions = cfg.ordered_reductions
    world = dist.get_world_size(coord)
    # One row per reduction (their step counts differ): the slower rank's
    # time of each step, the ranks' mean CPU time.
    times, cpu = [], []
    for r in reductions:
        t = torch.tensor(done[r].times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=coord)
        times.append(t)
        c = torch.tensor(done[r].cpu, dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.SUM, group=coord)
        cpu.append(c / world)
    sums = torch.tensor(
        [[done[r].accounted, float(done[r].tx)] for r in reductions], dtype=torch.float64
    )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=coord)
    sums /= world
    rows = []
    base = None
    for i, r in enumerate(reductions):
        t = sorted(times[i].tolist())
        p50 = statistics.median(t) * 1e3
        if r == "none":
            base = p50
        q = statistics.quantiles(t, n=4, method="inclusive") if len(t) >= 2 else [t[0]] * 3
        rows.append(
            DDPResult(
                model=spec.name,
                params=done[r].params,
                rate=rate,
                reduction=r,
                steps=len(t),
                time_ms=p50,
                time_ms_p25=q[0] * 1e3,
                time_ms_p75=q[2] * 1e3,
                bytes_per_step=float(sums[i, 0]) / len(t),
                link_tx_per_step=float(sums[i, 1]) / len(t) if ifname else math.nan,
                speedup=math.nan,
                final_loss=done[r].loss,
                cpu_ms=statistics.median(cpu[i].tolist()) * 1e3,
                chosen=_chosen(done[r].state),
                explain=_explain(done[r].state),
                step_ms=[x * 1e3 for x in times[i].tolist()],
                round_steps=done[r].rounds,
                uncompressed_steps=done[r].uncompressed,
                changes=done[r].changes,
            )
        )
    assert base is not None
    return [dataclasses.replace(row, speedup=base / row.time_ms) for row in rows]


def _explain(state: Any) -> str:
    from xcomm import _C

    if hasattr(state, "explain"):  # AutoState
        return str(state.explain())
    if isinstance(state, _C.XcommBackend) and "auto" in state.compression_stats:
        a = state.compression_stats["auto"]
        rounds = (
            f"rounds {a['rounds']} (next at choice {a['next_round']}, probe {a['probe_bytes']} B)"
        )
        return f"{rounds}; inputs {a['inputs']}; last: {a['last']}"
    return ""


def _chosen(state: Any) -> str:
    """auto's choice: each bucket's method (the hook), or ``method*count`` per
    method over every allreduce (the backend's ``compression="auto"``)."""
    by_bucket = getattr(state, "methods_by_bucket", None)  # AutoState only
    if by_bucket is not None:
        return ",".join(by_bucket())
    from xcomm import _C

    backend_auto = (
        state.compression_stats.get("auto") if isinstance(state, _C.XcommBackend) else None
    )
    if backend_auto:
        return ",".join(f"{m}*{n}" for m, n in backend_auto["chosen"].items() if n)
    return ""


def run_rank(cfg: DDPBenchConfig, rate: str) -> int:
    """Body of one rank started with the ``env://`` variables set.

    Rank 0 writes ``<out>/ddp-<rate>.json`` (the parent merges them).
    """
    from tqdm import tqdm

    import xcomm  # noqa: F401 - registers the "xcomm" backend

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // world))
    timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)
    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout
    )
    try:
        coord = dist.group.WORLD
        group = dist.new_group(backend=cfg.backend, timeout=timeout)
        specs = [build_model(m, smoke=cfg.smoke) for m in cfg.models]
        n_red = len(cfg.ordered_reductions)
        bar = tqdm(
            total=len(specs) * n_red * (cfg.warmup + cfg.steps),
            desc=f"ddp {rate}",
            unit="step",
            disable=not cfg.progress or rank != 0,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        results: list[DDPResult] = []
        with bar:
            for spec in specs:
                results += run_model(
                    spec, cfg, rate=rate, group=group, coord=coord, rank=rank, bar=bar
                )
        if rank == 0 and cfg.out is not None:
            out = Path(cfg.out)
            out.mkdir(parents=True, exist_ok=True)
            part = {"rate": rate, "load": _loadavg(), "results": [r.as_dict() for r in results]}
            (out / f"ddp-{_slug(rate)}.json").write_text(json.dumps(part, indent=1))
        if rank == 0 and cfg.out is None:
            print(format_table(results), flush=True)
        return 0
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- launching


def _slug(rate: str) -> str:
    return rate.replace(".", "p").replace("/", "_")


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def _rank_command(cfg: DDPBenchConfig, rate: str) -> list[str]:
    return module_command(
        "xcomm_bench", "ddp", "--launcher", "env", "--rate-label", rate, *cfg.to_argv()
    )


def _run_rate(cfg: DDPBenchConfig, rate: str, timeout: float | None) -> int:
    if cfg.nodes:
        return run_ranks(
            _rank_command(cfg, rate), cfg.world_size, nodes=cfg.nodes, rate=rate, timeout=timeout
        )
    # Loopback puts both ranks on one host, where xcomm would use shared
    # memory; this benchmark is about the network (the emulated cluster's
    # nodes are separate hosts anyway). XCOMM_SHM=1 measures the
    # shared-memory path.
    env = {"XCOMM_SHM": os.environ.get("XCOMM_SHM", "0")}
    return run_ranks(_rank_command(cfg, rate), cfg.world_size, env=env, timeout=timeout)


def launch(cfg: DDPBenchConfig, *, timeout: float | None = None) -> int:
    """Runs the benchmark: one set of ranks per rate, then the merged report.

    Returns:
        0 on success, else the first failing exit status.
    """
    cfg.validate()
    if cfg.out is None and len(cfg.rates) > 1 and cfg.nodes:
        raise ValueError("several rates need --out (each rate's ranks write their part there)")
    rates = cfg.rates if cfg.nodes else ["loopback"]
    meta = _metadata(cfg)
    for rate in rates:
        meta["load_before"][rate] = _loadavg()
        rc = _run_rate(cfg, rate, timeout)
        if rc != 0:
            print(f"xcomm_bench ddp: ranks at {rate} failed with exit status {rc}", file=sys.stderr)
            return rc
    if cfg.out is None:
        return 0
    out = Path(cfg.out)
    results: list[DDPResult] = []
    for rate in rates:
        part = json.loads((out / f"ddp-{_slug(rate)}.json").read_text())
        meta["load_after"][rate] = part.get("load", [])
        results += [DDPResult(**r) for r in part["results"]]
    print(format_table(results), flush=True)
    paths = write_reports(out, results, meta, plot_png=cfg.plot and cfg.nodes > 0)
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    return 0


def _metadata(cfg: DDPBenchConfig) -> dict[str, Any]:
    from .collectives import _cpu_model

    return {
        "tool": "python -m xcomm_bench ddp",
        "argv": cfg.to_argv(),
        "config": dataclasses.asdict(cfg),
        "world_size": cfg.world_size,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "kernel": os.uname().release,
        "torch": torch.__version__,
        "load_before": {},
        "load_after": {},
    }


# ----------------------------------------------------------------------------- reports


def _mb(x: float) -> str:
    return "-" if math.isnan(x) else f"{x / 1e6:.2f}"


def _rows(results: Sequence[DDPResult]) -> tuple[list[str], list[list[str]]]:
    header = [
        "model", "params", "rate", "reduction", "time/step ms (p50)", "p25-p75",
        "CPU ms/step", "MB/step (accounted)", "link tx MB/step (measured)", "speedup vs none",
    ]  # fmt: skip
    rows = [
        [
            r.model,
            f"{r.params / 1e6:.2f}M",
            r.rate,
            r.reduction,
            f"{r.time_ms:.1f}",
            f"{r.time_ms_p25:.0f}-{r.time_ms_p75:.0f}",
            "-" if math.isnan(r.cpu_ms) else f"{r.cpu_ms:.0f}",
            _mb(r.bytes_per_step),
            _mb(r.link_tx_per_step),
            f"{r.speedup:.2f}",
        ]
        for r in results
    ]
    return header, rows


def format_table(results: Sequence[DDPResult]) -> str:
    """Aligned text table (one row per model, rate, reduction)."""
    header, rows = _rows(results)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def format_markdown(results: Sequence[DDPResult]) -> str:
    """The same table in Markdown."""
    header, rows = _rows(results)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plot_speedup(path: Path, results: Sequence[DDPResult], *, title: str = "") -> Path:
    """Speedup vs link rate (log x), one panel per model, a line per reduction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from .cluster.netns import parse_rate

    models = [m for m in ALL_MODELS if any(r.model == m for r in results)]
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for red in REDUCTIONS:
            pts = sorted(
                (parse_rate(r.rate) / 1e9, r.speedup)
                for r in results
                if r.model == model and r.reduction == red
            )
            if not pts:
                continue
            style = "--" if red.startswith("torch-") else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=red)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.set_xlabel("link rate (Gbit/s)")
        params = next(r.params for r in results if r.model == model)
        ax.set_title(f"{model} ({params / 1e6:.1f}M params)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("speedup vs uncompressed DDP")
    axes[0][-1].legend(fontsize="x-small")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _rate_bits(rate: str) -> float:
    """The rate in bit/s; 0 for a run without a rate ("loopback")."""
    from .cluster.netns import parse_rate

    try:
        return float(parse_rate(rate))
    except ValueError:
        return 0.0


def ratio_interval(
    a: Sequence[float], b: Sequence[float], rounds: int, *, reps: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """A 90% interval for ``median(a) / median(b)`` by a block bootstrap.

    A runner's steps of one round run back to back and share the host's
    load of that moment (on 2 cores one block's median moves by ~10%
    against the next), so each series is cut into the blocks it ran in
    (:func:`_blocks` over ``rounds``) and whole blocks are drawn with
    replacement; steps drawn one by one would give too narrow an interval.

    Example::

        >>> ratio_interval([2.0] * 8, [1.0] * 8, rounds=4)
        (2.0, 2.0)
    """
    import random

    def cut(x: Sequence[float]) -> list[list[float]]:
        sizes = [n for n in _blocks(len(x), rounds) if n]
        starts = itertools.accumulate([0, *sizes[:-1]])
        return [list(x[s : s + k]) for s, k in zip(starts, sizes)]

    rng = random.Random(seed)
    ca, cb = cut(a), cut(b)
    ratios = []
    for _ in range(reps):
        ra = [v for _ in ca for v in rng.choice(ca)]
        rb = [v for _ in cb for v in rng.choice(cb)]
        ratios.append(statistics.median(ra) / statistics.median(rb))
    ratios.sort()
    return ratios[int(0.05 * (reps - 1))], ratios[int(0.95 * (reps - 1))]


def auto_vs_best(
    results: Sequence[DDPResult], auto_name: str = "auto", *, rounds: int = 0
) -> list[dict[str, Any]]:
    """Per (model, rate): an auto's step time against the fastest static
    reduction (for the hook, every other non-auto reduction of the same run;
    for ``backend-auto``, none and the backend's bf16 and int8) and against
    none. With ``rounds`` (the run's) and per-step times, also a 90% interval
    of auto / fastest (:func:`ratio_interval`); else NaN."""
    peers = _AUTO_PEERS[auto_name]
    out = []
    points = sorted(
        {(r.model, r.rate) for r in results},
        key=lambda mr: (
            ALL_MODELS.index(mr[0]) if mr[0] in ALL_MODELS else 99,
            _rate_bits(mr[1]),
        ),
    )
    for model, rate in points:
        group = [r for r in results if r.model == model and r.rate == rate]
        auto = next((r for r in group if r.reduction == auto_name), None)
        statics = [
            r
            for r in group
            if r.reduction not in _AUTO_PEERS and (peers is None or r.reduction in peers)
        ]
        none = next((r for r in group if r.reduction == "none"), None)
        if auto is None or not statics or none is None:
            continue
        best = min(statics, key=lambda r: r.time_ms)
        lo = hi = math.nan
        if rounds and auto.step_ms and best.step_ms:
            lo, hi = ratio_interval(auto.step_ms, best.step_ms, rounds)
        out.append(
            {
                "model": model,
                "rate": rate,
                "auto_ms": auto.time_ms,
                "auto_steps": auto.steps,
                "best": best.reduction,
                "best_ms": best.time_ms,
                "best_steps": best.steps,
                "auto_over_best": auto.time_ms / best.time_ms,
                "interval": (lo, hi),
                "auto_over_none": auto.time_ms / none.time_ms,
                "chosen": auto.chosen,
            }
        )
    return out


def format_auto_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """auto against the best static reduction, one line per (model, rate)."""
    lines = [
        (
            "| model | rate | auto ms/step | auto chose (per bucket) | fastest static "
            "| its ms/step | timed steps (auto, fastest) | auto / fastest | 90% interval "
            "| auto / none |"
        ),
        "|---|---|---:|---|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        counts: dict[str, int] = {}
        for item in filter(None, r["chosen"].split(",")):
            name, _, n = item.partition("*")
            counts[name] = counts.get(name, 0) + int(n or 1)
        chosen = ", ".join(f"{m} x{n}" for m, n in counts.items())
        lo, hi = r.get("interval", (math.nan, math.nan))
        interval = "-" if math.isnan(lo) else f"{lo:.3f}-{hi:.3f}"
        steps = f"{r.get('auto_steps', '?')}, {r.get('best_steps', '?')}"
        lines.append(
            f"| {r['model']} | {r['rate']} | {r['auto_ms']:.1f} | {chosen} | {r['best']} "
            f"| {r['best_ms']:.1f} | {steps} | {r['auto_over_best']:.3f} | {interval} "
            f"| {r['auto_over_none']:.3f} |"
        )
    return "\n".join(lines)


def plot_auto_vs_best(path: Path, rows: Sequence[dict[str, Any]], *, title: str = "") -> Path:
    """auto's step time over the fastest static reduction's, against link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    models = list(dict.fromkeys(r["model"] for r in rows))
    for i, model in enumerate(models):
        pts = [r for r in rows if r["model"] == model and _rate_bits(r["rate"]) > 0]
        # Each model a little apart along x, so the intervals do not overlap.
        x = [_rate_bits(r["rate"]) / 1e9 * 1.06 ** (i - (len(models) - 1) / 2) for r in pts]
        y = [r["auto_over_best"] for r in pts]
        lo = [r.get("interval", (math.nan, math.nan))[0] for r in pts]
        hi = [r.get("interval", (math.nan, math.nan))[1] for r in pts]
        if all(math.isfinite(v) for v in lo + hi):
            err = [[v - a for v, a in zip(y, lo)], [b - v for v, b in zip(y, hi)]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{model} (90% interval)")
        else:
            ax.plot(x, y, marker="o", label=model)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(1.05, color="red", lw=0.8, ls="--", label="5% over the fastest")
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Gbit/s)")
    ax.set_ylabel("auto time/step / fastest static")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="x-small")
    if title:
        ax.set_title(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def load_results(path: str | Path) -> tuple[list[DDPResult], dict[str, Any]]:
    """Reads a ``ddp.json`` back: (results, metadata)."""
    data = json.loads(Path(path).read_text())
    return [DDPResult(**r) for r in data["results"]], data["meta"]


def write_reports(
    out: Path, results: Sequence[DDPResult], meta: dict[str, Any], *, plot_png: bool = True
) -> list[Path]:
    """Writes ``ddp.csv``, ``ddp.json``, ``ddp.md`` and (``plot_png``) ``ddp.png``."""
    import csv

    out.mkdir(parents=True, exist_ok=True)
    lists = (
        "step_ms",
        "round_steps",
        "uncompressed_steps",
        "changes",
    )  # per-step lists: the JSON has them
    fields = [f.name for f in dataclasses.fields(DDPResult) if f.name not in lists]
    with open(out / "ddp.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow(r.as_dict())
    (out / "ddp.json").write_text(
        json.dumps({"meta": meta, "results": [r.as_dict() for r in results]}, indent=1)
    )
    (out / "ddp.md").write_text(format_markdown(results) + "\n", encoding="utf-8")
    paths = [out / "ddp.csv", out / "ddp.json", out / "ddp.md"]
    if plot_png:
        cfg = meta.get("config", {})
        title = (
            f"DDP, {cfg.get('nodes')} emulated nodes x {cfg.get('ranks_per_node')} rank, "
            f"backend {cfg.get('backend')}, PowerSGD rank {cfg.get('powersgd_rank')}"
        )
        paths.append(plot_speedup(out / "ddp.png", results, title=title))
    for name, stem in (("auto", "ddp-auto"), ("backend-auto", "ddp-backend-auto")):
        rounds = int(meta.get("config", {}).get("rounds", 0) or 0)
        auto = auto_vs_best(results, name, rounds=rounds)
        if not auto:
            continue
        (out / f"{stem}.md").write_text(format_auto_markdown(auto) + "\n", encoding="utf-8")
        paths.append(out / f"{stem}.md")
        if plot_png and any(_rate_bits(r["rate"]) > 0 for r in auto):
            paths.append(
                plot_auto_vs_best(
                    out / f"{stem}.png", auto, title=f"{name} vs the fastest static reduction"
                )
            )
    return paths
