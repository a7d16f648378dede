"""A Hugging Face ``accelerate`` training script, run as a real program by
test_client_accelerate.py under a launcher that starts 2 ranks
(``torchrun --nproc-per-node=2`` or ``accelerate launch --multi_gpu
--num_processes=2``): ``accelerate_client.py BACKEND HOOK OUT``.

With BACKEND ``xcomm`` it follows the recipe the README gives: make the
default group on xcomm before ``Accelerator(...)`` (accelerate refuses
``InitProcessGroupKwargs(backend="xcomm")`` and, on the CPU, makes a gloo
group unless one exists), then register the hook on the model
``accelerator.prepare`` returns (a ``DistributedDataParallel``). With
``gloo`` (the reference) accelerate makes its own group. HOOK is ``none`` or
an xcomm comm hook (``fp16``, ``int8``, ``powersgd``).

Each rank writes OUT.rank<R>.pt: final parameters, the mean loss, the group's
backend, what accelerate reports as its backend and distributed type, and how
many times the hook ran on that rank.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS_PER_EPOCH = 4
EPOCHS = 2


def make_hook(name: str) -> tuple[Any, Any] | None:
    from xcomm import hooks

    if name == "none":
        return None
    if name == "fp16":
        return hooks.CastState(), hooks.fp16_cast_hook
    if name == "int8":
        return hooks.Int8State(chunk_elems=32, start_iter=2), hooks.int8_compress_hook
    if name == "powersgd":
        state = hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        return state, hooks.powersgd_hook
    raise ValueError(f"unknown hook {name!r}")


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = torch.stack([x[:, :3].sum(1), x[:, 3:].prod(1)], 1) + 0.1 * torch.randn(n, 2, generator=g)
    return TensorDataset(x, y)


def main(backend: str, hook: str, out: str) -> None:
    if backend == "xcomm":
        import xcomm  # noqa: F401 - registers the backend

        dist.init_process_group("xcomm")  # before Accelerator: it keeps this group
    accelerator = Accelerator(cpu=True)
    set_seed(7)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(_data(16 * STEPS_PER_EPOCH, 1), batch_size=8, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    made = make_hook(hook)
    if made is not None:
        model.register_comm_hook(*made)  # model is the DDP accelerate made
    losses = []
    for _ in range(EPOCHS):
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            losses.append(loss.detach())
    mean_loss = accelerator.reduce(torch.stack(losses).mean(), reduction="mean")
    torch.save(
        {
            "params": {
                k: v.detach().clone()
                for k, v in accelerator.unwrap_model(model).state_dict().items()
            },
            "loss": mean_loss.detach().clone(),
            "backend": dist.get_backend(),
            "accelerate_backend": accelerator.state.backend,
            "distributed_type": str(accelerator.distributed_type),
            "is_ddp": isinstance(model, nn.parallel.DistributedDataParallel),
            "world_size": dist.get_world_size(),
            "hook_calls": 0 if made is None else int(made[0].stats.calls),
        },
        f"{out}.rank{accelerator.process_index}.pt",
    )
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main(*sys.argv[1:4])
