"""A PyTorch Lightning training script, run as a real program by
test_client_lightning.py: ``python lightning_client.py BACKEND LAUNCH HOOK OUT``.

``Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(
process_group_backend=BACKEND, ...))`` fits a tiny regression model for two
epochs with a fixed seed. LAUNCH is ``ddp`` (Lightning re-launches this
script for rank 1) or ``ddp_spawn`` (it spawns both ranks). HOOK is ``none``
or an xcomm comm hook (``fp16``: fp16_cast_hook, ``int8``:
int8_compress_hook, ``powersgd``: powersgd_hook).

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only on CUDA,
so on the CPU this script registers it the public way every backend accepts:
a callback calls ``register_comm_hook`` on the DDP model at ``on_fit_start``
(after Lightning wrapped the model, before the first backward).

Each rank writes OUT.rank<R>.pt: its final parameters, the metrics logged
with ``sync_dist=True``, the backend of the group and how many times the
hook ran on that rank (``hook_calls``; 0 without a hook).
"""

from __future__ import annotations

import sys
from typing import Any

import pytorch_lightning as pl
import torch
from client_common import make_hook, regression_data, save_rank_result, tiny_net
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

import xcomm  # noqa: F401 - registers the "xcomm" backend (also in ranks Lightning spawns)


class RegisterCommHook(pl.Callback):
    """Registers ``hook`` on Lightning's DDP model before the first backward."""

    def __init__(self, state: Any, hook: Any) -> None:
        self.state, self.hook = state, hook

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ddp = trainer.strategy.model
        assert isinstance(ddp, nn.parallel.DistributedDataParallel), type(ddp)
        ddp.register_comm_hook(self.state, self.hook)


def hook_calls(trainer: pl.Trainer) -> int:
    """How many buckets the registered hook reduced on this rank."""
    for cb in trainer.callbacks:
        if isinstance(cb, RegisterCommHook):
            return int(cb.state.stats.calls)
    return 0


class TinyRegressor(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.net = tiny_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("train_max", loss, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_fit_end(self) -> None:
        metrics = {k: v.detach().clone() for k, v in self.trainer.callback_metrics.items()}
        save_rank_result(
            self.out,
            self.global_rank,
            self.state_dict(),
            metrics=metrics,
            hook_calls=hook_calls(self.trainer),
        )


def main(backend: str, launch: str, hook: str, out: str) -> None:
    pl.seed_everything(7, workers=True)
    made = make_hook(hook)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(
            process_group_backend=backend,
            start_method="spawn" if launch == "ddp_spawn" else "popen",
        ),
        callbacks=[] if made is None else [RegisterCommHook(*made)],
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        num_sanity_val_steps=0,
    )
    model = TinyRegressor(out)
    trainer.fit(
        model,
        DataLoader(regression_data(64, 1), batch_size=8),
        DataLoader(regression_data(32, 2), batch_size=8),
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
