"""The digits task of the main job (``examples/train_ddp.py``).

The convergence benchmark (``python -m xcomm_bench convergence``) loads this
file too, to train the same thing once per reduction; the example itself
needs only ``xcomm``, torch and scikit-learn.

scikit-learn ships the 1797 8x8 images of handwritten digits, so training on
them needs no download. :func:`train_digits` runs one rank of DDP training
with any of xcomm's reductions and returns what it measured::

    >>> import torch.distributed as dist
    >>> from digits import DigitsConfig, train_digits  # examples/ on sys.path
    >>> dist.init_process_group("xcomm", ...)  # doctest: +SKIP
    >>> result = train_digits(dist.get_rank(), dist.get_world_size(),
    ...                       DigitsConfig(compression="int8"))  # doctest: +SKIP
    >>> result.final_accuracy  # doctest: +SKIP
    0.97
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from xcomm import hooks as xhooks
from xcomm.diloco import DiLoCo, nesterov_sgd
from xcomm.hooks.stats import CompressionStats, allreduce_bytes

__all__ = [
    "COMPRESSION",
    "DILOCO_COMPRESSION",
    "FSDP_COMPRESSION",
    "TORCH_HOOKS",
    "Digits",
    "DigitsConfig",
    "DigitsResult",
    "load_digits",
    "make_model",
    "register_compression",
    "register_torch_hook",
    "train_digits",
]

#: xcomm's DDP hooks, by name.
COMPRESSION = ["none", "fp16", "bf16", "int8", "topk", "randomk", "powersgd", "auto"]
#: xcomm's FSDP2 reduce-scatters (``wrapper="fsdp2"``), by name.
FSDP_COMPRESSION = ["none", "fp16", "bf16", "int8"]
#: xcomm's DiLoCo outer steps (``wrapper="diloco"``), by how they send pseudo-gradients.
DILOCO_COMPRESSION = ["none", "fp16", "bf16", "int8"]
#: torch's own DDP hooks, by name.
TORCH_HOOKS = ["none", "allreduce", "fp16", "powersgd"]


@dataclass
class Digits:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits(seed: int = 0) -> Digits:
    """The 1797 8x8 digit images that ship with scikit-learn, split 80/20."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_train = int(0.8 * len(x))
    return Digits(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def make_model() -> torch.nn.Module:
    """An MLP 64-256-256-10 (85k parameters)."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


def register_torch_hook(model: DDP, hook: str, powersgd_rank: int = 4) -> None:
    """Registers one of torch's hooks (:data:`TORCH_HOOKS`) on ``model``."""
    if hook == "none":
        return
    if hook == "allreduce":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=10
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(f"unknown torch hook {hook!r}; choose one of {TORCH_HOOKS}")


def register_compression(
    model: DDP,
    method: str,
    density: float = 0.05,
    powersgd_rank: int = 4,
    auto_link_gbit: float | None = None,
) -> CompressionStats | None:
    """Registers xcomm's hook for ``method`` (:data:`COMPRESSION`); returns its statistics.

    ``auto`` measures the link unless ``auto_link_gbit`` fixes it (to see
    what auto's choices do to accuracy on a link this machine does not have).
    """
    if method == "none":
        return None
    state: object
    hook: Callable
    if method in ("fp16", "bf16"):
        state = xhooks.CastState()
        hook = xhooks.fp16_cast_hook if method == "fp16" else xhooks.bf16_cast_hook
    elif method == "int8":
        state, hook = xhooks.Int8State(model=model), xhooks.int8_compress_hook
    elif method == "topk":
        state, hook = xhooks.TopKState(density=density, model=model), xhooks.topk_hook
    elif method == "randomk":
        state, hook = xhooks.RandomKState(density=density, model=model), xhooks.randomk_hook
    elif method == "powersgd":
        state = xhooks.PowerSGDState(
            process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=10
        )
        hook = xhooks.powersgd_hook
    elif method == "auto":
        link = None
        if auto_link_gbit is not None:
            link = xhooks.LinkModel(latency_s=1e-4, bandwidth_bytes_per_s=auto_link_gbit * 1.25e8)
        state = xhooks.AutoState(
            min_density=density, powersgd_rank=powersgd_rank, link=link, model=model
        )
        hook = xhooks.auto_hook
    else:
        raise ValueError(f"unknown compression {method!r}; choose one of {COMPRESSION}")
    model.register_comm_hook(state, hook)
    return state.stats  # type: ignore[attr-defined]


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


@dataclass
class DigitsConfig:
    """One training run. ``compression`` names an xcomm hook, ``hook`` a torch
    hook (at most one of the two); ``backend_compression`` is what the process
    group compresses itself (``xcomm.Options(compression=...)``), for the byte count.
    ``wrapper="fsdp2"`` shards every layer with ``fully_shard`` instead of DDP;
    ``compression`` then names the reduce-scatter (:data:`FSDP_COMPRESSION`).
    ``wrapper="diloco"`` trains without DDP, each rank on its part of every
    global batch, and averages the models every ``sync_every`` steps with
    :class:`xcomm.diloco.DiLoCo` (``compression`` in :data:`DILOCO_COMPRESSION`;
    ``fragments`` / ``overlap_steps`` stream it); the final model is agreed by
    one more outer step when the last step is not one. The outer optimizer is
    Nesterov SGD with lr 0.7 and momentum 0.5: DiLoCo's momentum 0.9 swung
    the accuracy of this small task by 1-3 pp between outer steps."""

    compression: str = "none"
    hook: str = "none"
    backend_compression: str | None = None
    density: float = 0.05
    powersgd_rank: int = 4
    auto_link_gbit: float | None = None
    wrapper: str = "ddp"
    sync_every: int = 20
    fragments: int = 1
    overlap_steps: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.5
    steps: int = 300
    batch_size: int = 64
    lr: float = 0.05
    seed: int = 0
    log_every: int = 0
    log: Callable[[str], None] = print


@dataclass
class DigitsResult:
    final_accuracy: float
    final_loss: float
    mean_step_ms: float
    wire_bytes_per_step: float
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (step, loss, acc)
    #: auto only: each bucket's method at the end.
    chosen: str = ""
    #: Seconds from the first step to the trained (for DiLoCo: agreed) model.
    train_seconds: float = 0.0


def _wire_bytes(stats: CompressionStats | None, grad_bytes: int, world: int, step: int) -> float:
    """Bytes one rank sent so far: the hook's count, or a ring allreduce of every gradient."""
    if stats is not None:
        return float(stats.link_bytes_sent)
    pg_stats = _backend_compression_stats()
    if pg_stats and pg_stats["calls"]:
        return float(pg_stats["link_bytes_sent"])
    return float(allreduce_bytes(grad_bytes, world) * step)


def _backend_compression_stats() -> dict | None:
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):
        return None
    return getattr(backend, "compression_stats", None)


def train_digits(rank: int, world_size: int, cfg: DigitsConfig) -> DigitsResult:
    """Trains on digits with DDP over the default group; every rank returns the same numbers."""
    if cfg.hook != "none" and cfg.compression != "none":
        raise ValueError("choose either a torch hook or an xcomm compression hook, not both")
    if cfg.batch_size % world_size:
        raise ValueError(f"batch_size {cfg.batch_size} must divide by world size {world_size}")
    torch.manual_seed(cfg.seed)
    data = load_digits(cfg.seed)
    diloco = None
    if cfg.wrapper == "fsdp2":
        model, stats = _fsdp2_model(cfg)
    elif cfg.wrapper == "diloco":
        model, diloco = _diloco_model(cfg)
        stats = diloco.stats
    elif cfg.wrapper == "ddp":
        model = DDP(make_model())
        register_torch_hook(model, cfg.hook, cfg.powersgd_rank)
        stats = register_compression(
            model, cfg.compression, cfg.density, cfg.powersgd_rank, cfg.auto_link_gbit
        )
    else:
        raise ValueError(f"unknown wrapper {cfg.wrapper!r}; choose 'ddp', 'fsdp2' or 'diloco'")
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    per_rank = cfg.batch_size // world_size
    n_train = len(data.x_train)

    step_times: list[float] = []
    history: list[tuple[int, float, float]] = []
    wire_before = 0.0
    loss = torch.zeros(())
    begin = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        # Each global batch is split across ranks, so the run does the same
        # arithmetic whatever the world size.
        start = ((step - 1) * cfg.batch_size) % (n_train - cfg.batch_size)
        lo = start + rank * per_rank
        x, y = data.x_train[lo : lo + per_rank], data.y_train[lo : lo + per_rank]
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if diloco is not None:
            diloco.step()
        step_times.append(time.perf_counter() - t0)
        if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.steps):
            acc = accuracy(model, data.x_test, data.y_test)
            history.append((step, loss.item(), acc))
            recent = step_times[-cfg.log_every :]
            wire_now = _wire_bytes(stats, grad_bytes, world_size, step)
            per_step = (wire_now - wire_before) / len(recent)
            wire_before = wire_now
            if rank == 0:
                cfg.log(
                    f"step {step:4d}  loss {loss.item():.4f}  test acc {acc:.4f}  "
                    f"time/step {1000 * sum(recent) / len(recent):.2f} ms  "
                    f"wire/step {per_step / 1024:.1f} KiB"
                )
    if diloco is not None:
        if any(f.pending is not None for f in diloco.fragments) or cfg.steps % cfg.sync_every:
            diloco.sync()  # evaluate the agreed model, not rank 0's local one
        diloco.close()
    train_seconds = time.perf_counter() - begin
    wire_total = _wire_bytes(stats, grad_bytes, world_size, cfg.steps)
    return DigitsResult(
        final_accuracy=accuracy(model, data.x_test, data.y_test),
        final_loss=loss.item(),
        mean_step_ms=1000 * sum(step_times) / len(step_times),
        wire_bytes_per_step=wire_total / cfg.steps,
        history=history,
        chosen=_auto_choice(model),
        train_seconds=train_seconds,
    )


def _fsdp2_model(cfg: DigitsConfig) -> tuple[torch.nn.Module, CompressionStats]:
    """The model with every layer and the root under ``fully_shard``, and the
    reduce-scatter ``cfg.compression`` names ("none": FSDP2's own, counted)."""
    from torch.distributed.fsdp import fully_shard

    if cfg.hook != "none" or cfg.compression not in FSDP_COMPRESSION:
        raise ValueError(
            f"fsdp2 takes compression in {FSDP_COMPRESSION} and no torch hook, "
            f"got {cfg.compression!r} / {cfg.hook!r}"
        )
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    state = xhooks.compress_reduce_scatter(model, cfg.compression, min_bytes=0)
    return model, state.stats


def _diloco_model(cfg: DigitsConfig) -> tuple[torch.nn.Module, DiLoCo]:
    """The model, trained locally, and the DiLoCo that averages it."""
    if cfg.hook != "none" or cfg.compression not in DILOCO_COMPRESSION:
        raise ValueError(
            f"diloco takes compression in {DILOCO_COMPRESSION} and no torch hook, "
            f"got {cfg.compression!r} / {cfg.hook!r}"
        )
    model = make_model()
    diloco = DiLoCo(
        model,
        sync_every=cfg.sync_every,
        method=cfg.compression,
        fragments=cfg.fragments,
        overlap_steps=cfg.overlap_steps,
        outer_optimizer=nesterov_sgd(cfg.outer_lr, cfg.outer_momentum),
    )
    return model, diloco


def _auto_choice(model: DDP) -> str:
    """The methods an auto hook chose, bucket by bucket ("" without one)."""
    for _hook, state in getattr(model, "_comm_hooks", []):
        if isinstance(state, xhooks.AutoState):
            return ",".join(state.methods_by_bucket())
    return ""
