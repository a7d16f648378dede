"""Trains a classifier on scikit-learn's digits with DDP over xcomm.

Run it on two local ranks either way::

    python examples/train_ddp.py                       # spawns 2 ranks itself
    torchrun --nproc-per-node 2 examples/train_ddp.py  # ranks from torchrun

It prints the loss, the test accuracy, the time per step and the bytes each
rank puts on the wire per step, so the same script compares backends
(``--backend gloo``), torch's DDP comm hooks (``--hook``), xcomm's
compression hooks (``--compression``) and compression inside the backend
(``--backend-compression``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import xcomm  # registers the "xcomm" backend
from digits import COMPRESSION, TORCH_HOOKS, DigitsConfig, train_digits  # examples/digits.py


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    cfg = DigitsConfig(
        compression=args.compression,
        hook=args.hook,
        backend_compression=args.backend_compression,
        density=args.density,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        log_every=args.log_every,
        log=lambda line: print(line, flush=True),
    )
    result = train_digits(rank, world_size, cfg)
    if rank == 0:
        print(
            f"done: backend={args.backend} hook={args.hook} compression={args.compression} "
            f"backend_compression={args.backend_compression} world_size={world_size} "
            f"steps={args.steps} final test accuracy {result.final_accuracy:.4f}  "
            f"mean time/step {result.mean_step_ms:.2f} ms  "
            f"wire/step {result.wire_bytes_per_step / 1024:.1f} KiB",
            flush=True,
        )


def run_rank(rank: int, world_size: int, args: argparse.Namespace, init_method: str) -> None:
    timeout = datetime.timedelta(seconds=args.timeout)
    kwargs = {"timeout": timeout}
    if args.backend == "xcomm":
        kwargs = {
            "pg_options": xcomm.Options(
                timeout=timeout,
                compression=None
                if args.backend_compression == "none"
                else args.backend_compression,
            )
        }
    elif args.backend_compression != "none":
        raise SystemExit("--backend-compression needs --backend xcomm")
    dist.init_process_group(
        args.backend, init_method=init_method, rank=rank, world_size=world_size, **kwargs
    )
    try:
        train(rank, world_size, args)
    finally:
        dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="xcomm", help="xcomm (default) or gloo, to compare")
    p.add_argument(
        "--hook",
        default="none",
        choices=TORCH_HOOKS,
        help="a torch DDP comm hook to register (default: DDP's own allreduce)",
    )
    p.add_argument(
        "--compression",
        default="none",
        choices=COMPRESSION,
        help="xcomm's gradient compression hook (default: none)",
    )
    p.add_argument(
        "--backend-compression",
        default="none",
        choices=["none", "fp16", "bf16", "int8"],
        help="compress allreduce inside the xcomm backend (xcomm.Options(compression=...))",
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(run_rank, args=(args.world_size, args, init_method), nprocs=args.world_size)


if __name__ == "__main__":
    main()
