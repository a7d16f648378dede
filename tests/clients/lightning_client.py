"""A PyTorch Lightning training script, run as a real program by
test_client_lightning.py: ``python lightning_client.py BACKEND STRATEGY HOOK OUT``.

Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(
process_group_backend=BACKEND, ...)) fits a tiny regression model for two
epochs with a fixed seed; STRATEGY is ``ddp`` (Lightning re-launches this
script for rank 1) or ``ddp_spawn`` (it spawns both ranks); HOOK is ``none``
or an xcomm comm hook (``fp16``: fp16_cast_hook, ``int8``:
int8_compress_hook). Each rank writes OUT.rank<R>.pt: its final parameters,
the metrics logged with ``sync_dist=True``, and the backend of the group.
"""

from __future__ import annotations

import sys

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import xcomm  # noqa: F401 - registers the "xcomm" backend (also in ranks Lightning spawns)
from xcomm.hooks import CastState, Int8State, fp16_cast_hook, int8_compress_hook


class TinyRegressor(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))

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
        torch.save(
            {
                "params": {k: v.detach().clone() for k, v in self.state_dict().items()},
                "metrics": {
                    k: v.detach().clone() for k, v in self.trainer.callback_metrics.items()
                },
                "backend": dist.get_backend(),
                "world_size": dist.get_world_size(),
            },
            f"{self.out}.rank{self.global_rank}.pt",
        )


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = torch.stack([x[:, :3].sum(1), x[:, 3:].prod(1)], 1) + 0.1 * torch.randn(n, 2, generator=g)
    return TensorDataset(x, y)


def main(backend: str, strategy: str, hook: str, out: str) -> None:
    pl.seed_everything(7, workers=True)
    hooks = {
        "none": {},
        "fp16": {"ddp_comm_hook": fp16_cast_hook, "ddp_comm_state": CastState()},
        "int8": {
            "ddp_comm_hook": int8_compress_hook,
            "ddp_comm_state": Int8State(chunk_elems=32, start_iter=2),
        },
    }[hook]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(
            process_group_backend=backend,
            start_method="spawn" if strategy == "ddp_spawn" else "popen",
            **hooks,
        ),
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
        DataLoader(_data(64, 1), batch_size=8),
        DataLoader(_data(32, 2), batch_size=8),
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
