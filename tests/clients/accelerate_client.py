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

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from client_common import make_hook, regression_data, save_rank_result, tiny_net
from torch import nn
from torch.utils.data import DataLoader

STEPS_PER_EPOCH = 4
EPOCHS = 2


def main(backend: str, hook: str, out: str) -> None:
    if backend == "xcomm":
        import xcomm  # noqa: F401 - registers the backend

        dist.init_process_group("xcomm")  # before Accelerator: it keeps this group
    accelerator = Accelerator(cpu=True)
    set_seed(7)
    model = tiny_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(regression_data(16 * STEPS_PER_EPOCH, 1), batch_size=8, shuffle=False)
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
    save_rank_result(
        out,
        accelerator.process_index,
        accelerator.unwrap_model(model).state_dict(),
        loss=mean_loss.detach().clone(),
        accelerate_backend=accelerator.state.backend,
        distributed_type=str(accelerator.distributed_type),
        is_ddp=isinstance(model, nn.parallel.DistributedDataParallel),
        hook_calls=0 if made is None else int(made[0].stats.calls),
    )
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main(*sys.argv[1:4])
