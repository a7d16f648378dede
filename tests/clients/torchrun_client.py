"""A training script for ``torchrun --max-restarts=1``, run by test_client_torchrun.py:
``torchrun ... torchrun_client.py BACKEND OUTDIR``.

First attempt (TORCHELASTIC_RESTART_COUNT=0): both ranks initialise the group
and all-reduce once, then rank 1 raises (rank 0 is left waiting in a barrier
until the elastic agent stops it). Second attempt: a few DDP SGD steps and an
all_gather_object; each rank writes OUTDIR/rank<R>.pt.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main(backend: str, outdir: str) -> None:
    if backend == "xcomm":
        import xcomm  # noqa: F401

    rank = int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group(backend)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(os.path.join(outdir, f"attempt{attempt}_rank{rank}.txt"), "w") as f:
        f.write(f"{t.item()}\n")
    if attempt == 0:
        if rank == 1:
            raise RuntimeError("injected failure on rank 1, first attempt")
        dist.barrier()  # never completes: the agent stops this worker and restarts both

    torch.manual_seed(5)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, "attempt": attempt})
    torch.save(
        {
            "params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
            "gathered": gathered,
            "allreduce": t,
            "backend": dist.get_backend(),
            "attempt": attempt,
            "group_rank": int(os.environ["GROUP_RANK"]),
        },
        os.path.join(outdir, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
