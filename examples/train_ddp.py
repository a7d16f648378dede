"""Trains a classifier on scikit-learn's digits with DDP over xcomm.

Run it on two local ranks either way::

    python examples/train_ddp.py                       # spawns 2 ranks itself
    torchrun --nproc-per-node 2 examples/train_ddp.py  # ranks from torchrun

It prints the loss, the test accuracy and the time per step, so the same
script compares backends (``--backend gloo``) and DDP comm hooks (``--hook``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import xcomm  # noqa: F401  (registers the "xcomm" backend)
from xcomm import hooks as xhooks
from xcomm.hooks.stats import CompressionStats, allreduce_bytes

COMPRESSION = ["none", "fp16", "bf16", "int8", "topk", "randomk", "powersgd"]


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
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


def register_hook(model: DDP, hook: str) -> None:
    if hook == "none":
        return
    if hook == "allreduce":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=10
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(f"unknown hook {hook!r}")


def register_compression(
    model: DDP, method: str, density: float, rank: int
) -> CompressionStats | None:
    """Registers xcomm's hook for `method`; returns its statistics."""
    if method == "none":
        return None
    if method in ("fp16", "bf16"):
        state = xhooks.CastState()
        hook = xhooks.fp16_cast_hook if method == "fp16" else xhooks.bf16_cast_hook
    elif method == "int8":
        state, hook = xhooks.Int8State(), xhooks.int8_compress_hook
    elif method == "topk":
        state, hook = xhooks.TopKState(density=density), xhooks.topk_hook
    elif method == "randomk":
        state, hook = xhooks.RandomKState(density=density), xhooks.randomk_hook
    elif method == "powersgd":
        state = xhooks.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=10
        )
        hook = xhooks.powersgd_hook
    else:
        raise ValueError(f"unknown compression {method!r}")
    model.register_comm_hook(state, hook)
    return state.stats


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    data = load_digits(args.seed)
    model = DDP(make_model())
    if args.hook != "none" and args.compression != "none":
        raise ValueError("choose either --hook (torch's) or --compression (xcomm's), not both")
    register_hook(model, args.hook)
    stats = register_compression(model, args.compression, args.density, rank)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    per_rank = args.batch_size // world_size
    n_train = len(data.x_train)

    step_times: list[float] = []
    wire_before = 0
    for step in range(1, args.steps + 1):
        # Each global batch is split across ranks, so the run does the same
        # arithmetic whatever the world size.
        start = ((step - 1) * args.batch_size) % (n_train - args.batch_size)
        lo = start + rank * per_rank
        x, y = data.x_train[lo : lo + per_rank], data.y_train[lo : lo + per_rank]
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        step_times.append(time.perf_counter() - t0)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            recent = step_times[-args.log_every :]
            # Link traffic per step: the hook's count, or a ring allreduce of every gradient.
            wire_now = stats.bytes_on_wire if stats else allreduce_bytes(grad_bytes, world_size) * step
            per_step = (wire_now - wire_before) / len(recent)
            wire_before = wire_now
            print(
                f"step {step:4d}  loss {loss.item():.4f}  "
                f"test acc {accuracy(model, data.x_test, data.y_test):.4f}  "
                f"time/step {1000 * sum(recent) / len(recent):.2f} ms  "
                f"wire/step {per_step / 1024:.1f} KiB",
                flush=True,
            )
    if rank == 0:
        mean_ms = 1000 * sum(step_times) / len(step_times)
        print(
            f"done: backend={args.backend} hook={args.hook} compression={args.compression} "
            f"world_size={world_size} "
            f"steps={args.steps} final test accuracy "
            f"{accuracy(model, data.x_test, data.y_test):.4f}  mean time/step {mean_ms:.2f} ms",
            flush=True,
        )


def run_rank(rank: int, world_size: int, args: argparse.Namespace, init_method: str) -> None:
    dist.init_process_group(
        args.backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    try:
        train(rank, world_size, args)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="xcomm", help="xcomm (default) or gloo, to compare")
    p.add_argument(
        "--hook", default="none", choices=["none", "allreduce", "fp16", "powersgd"],
        help="a torch DDP comm hook to register (default: DDP's own allreduce)",
    )
    p.add_argument(
        "--compression", default="none", choices=COMPRESSION,
        help="xcomm's gradient compression hook (default: none)",
    )
    p.add_argument("--density", type=float, default=0.05, help="top-k / random-k density")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn without torchrun")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(run_rank, args=(args.world_size, args, init_method), nprocs=args.world_size)


if __name__ == "__main__":
    main()
