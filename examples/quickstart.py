"""xcomm in five minutes: the one-line switch, a compression hook, ``auto``,
``xcomm.stats()`` and the timeline, on 2 local CPU ranks.

    python examples/quickstart.py            # int8 hook
    python examples/quickstart.py --auto     # auto chooses per bucket

docs/quickstart.md walks through it and shows what it prints.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import xcomm  # registers the "xcomm" backend
from xcomm import hooks


def run(rank: int, world_size: int, port: int, use_auto: bool, timeline: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # 1. The switch: "xcomm" where you had "gloo" (or "nccl").
    dist.init_process_group("xcomm", rank=rank, world_size=world_size)

    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    ddp = DDP(model, bucket_cap_mb=1)
    # 2. A compression hook: int8 with error feedback, or auto's choice per bucket.
    state: hooks.AutoState | hooks.Int8State
    if use_auto:
        state = hooks.AutoState()
        ddp.register_comm_hook(state, hooks.auto_hook)
    else:
        state = hooks.Int8State()
        ddp.register_comm_hook(state, hooks.int8_compress_hook)

    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    x = torch.randn(512, 256, generator=data)
    teacher = torch.randn(256, 10, generator=torch.Generator().manual_seed(42))
    y = (x @ teacher).argmax(1)  # a task the model can learn
    xcomm.reset_stats()
    xcomm.enable_timeline()  # 3. a Chrome/Perfetto trace of every op
    for step in range(30):
        batch = slice((step * 32) % 512, (step * 32) % 512 + 32)
        loss = torch.nn.functional.cross_entropy(ddp(x[batch]), y[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 10 == 9:
            print(f"step {step + 1}: loss {loss.item():.3f}")
    xcomm.save_timeline(f"{timeline}.rank{rank}.json", pid=rank)

    if rank == 0:
        # 4. What this rank handed to each op, and the time the ops took.
        for op, s in sorted(xcomm.stats().items()):
            print(
                f"{op}: {s['calls']} calls, {s['bytes_in']} bytes, "
                f"{s['time_on_wire_s'] * 1e3:.1f} ms on the wire"
            )
        # The hook's own count: link bytes of its collectives against an
        # uncompressed allreduce of the same gradients.
        print(f"hook: {state.stats.ratio:.2f}x fewer link bytes than an uncompressed allreduce")
        if isinstance(state, hooks.AutoState):
            print(state.explain())
        print(f"timeline: {timeline}.rank0.json (open it in https://ui.perfetto.dev)")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--auto", action="store_true", help="auto_hook instead of int8")
    parser.add_argument("--timeline", default="quickstart-timeline")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(2, port, args.auto, args.timeline), nprocs=2)


if __name__ == "__main__":
    main()
