"""Lightning Trainer and Fabric with ``xcomm.lightning``'s strategies, run as
a real program by test_client_lightning_strategy.py:
``python lightning_strategy_client.py FRAMEWORK BACKEND LAUNCH HOOK OUT``.

FRAMEWORK is ``trainer`` or ``fabric``; LAUNCH ``ddp`` (Lightning re-runs
this script for rank 1) or ``ddp_spawn``; HOOK an xcomm comm hook (``fp16``,
``int8``, ``powersgd``). With BACKEND ``xcomm`` the run uses
``XcommStrategy`` / ``XcommFabricStrategy`` with the hook and
``xcomm.Options(fusion_threshold_bytes=65536)``; with ``gloo`` (the
reference) Lightning's own ``DDPStrategy(process_group_backend="gloo")``, the
hook registered by hand on the DDP model (a callback at ``on_fit_start`` for
the Trainer, Fabric's ``model._forward_module`` for Fabric).

This script imports xcomm only inside ``main()``, as a user may: a rank
Lightning spawns never runs ``main()``, and must get the backend registered
from unpickling the strategy and the hook state.

Each rank writes OUT.rank<R>.pt: final parameters, the synced loss, the
backend, how many times the hook ran on that rank and (xcomm) the group's
fusion threshold from ``xcomm.group_plan()``.
"""

from __future__ import annotations

import sys
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from client_common import make_hook, regression_data, save_rank_result, tiny_net
from lightning_fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

FUSION_BYTES = 65536
EPOCHS = 2


def hook_of(name: str) -> tuple[Any, Any]:
    """``make_hook(name)``, which must name a hook (this client always runs one)."""
    made = make_hook(name)
    assert made is not None, "this client runs with a hook"
    return made


def _group_fusion() -> int | None:
    if dist.get_backend() != "xcomm":
        return None
    import xcomm

    return int(xcomm.group_plan()["fusion_threshold_bytes"])


def _save(out: str, rank: int, params: dict, loss: torch.Tensor, calls: int) -> None:
    save_rank_result(
        out,
        rank,
        params,
        loss=loss.detach().clone(),
        hook_calls=calls,
        fusion_threshold_bytes=_group_fusion(),
    )


class RegisterCommHook(pl.Callback):
    """The reference's hook, registered on Lightning's DDP model by hand."""

    def __init__(self, state: Any, hook: Any) -> None:
        self.state, self.hook = state, hook

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(self.state, self.hook)


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
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_fit_end(self) -> None:
        strategy = self.trainer.strategy
        state = getattr(strategy, "ddp_comm_state", None)
        for cb in self.trainer.callbacks:
            if isinstance(cb, RegisterCommHook):
                state = cb.state
        calls = int(state.stats.calls) if state is not None else 0
        loss = self.trainer.callback_metrics["train_loss"]
        _save(self.out, self.global_rank, self.state_dict(), loss, calls)


def run_trainer(backend: str, launch: str, hook: str, out: str) -> None:
    from pytorch_lightning.strategies import DDPStrategy

    pl.seed_everything(7, workers=True)
    state, fn = hook_of(hook)
    start_method = "spawn" if launch == "ddp_spawn" else "popen"
    callbacks: list[pl.Callback] = []
    if backend == "xcomm":
        import xcomm
        from xcomm.lightning import XcommStrategy

        strategy: Any = XcommStrategy(
            options=xcomm.Options(fusion_threshold_bytes=FUSION_BYTES),
            ddp_comm_hook=fn,
            ddp_comm_state=state,
            start_method=start_method,
        )
    else:
        strategy = DDPStrategy(process_group_backend=backend, start_method=start_method)
        callbacks.append(RegisterCommHook(state, fn))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=callbacks,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        num_sanity_val_steps=0,
    )
    trainer.fit(TinyRegressor(out), DataLoader(regression_data(64, 1), batch_size=8))


def run_fabric(backend: str, launch: str, hook: str, out: str) -> None:
    from lightning_fabric.strategies import DDPStrategy

    assert launch == "ddp", "this client launches Fabric with its subprocess launcher"
    state, fn = hook_of(hook)
    if backend == "xcomm":
        import xcomm
        from xcomm.lightning import XcommFabricStrategy

        strategy: Any = XcommFabricStrategy(
            options=xcomm.Options(fusion_threshold_bytes=FUSION_BYTES),
            ddp_comm_hook=fn,
            ddp_comm_state=state,
        )
    else:
        strategy = DDPStrategy(process_group_backend=backend)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(7)
    model = tiny_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = fabric.setup(model, opt)
    if backend != "xcomm":
        # Fabric's DDPStrategy takes no hook: the private path users had before
        model._forward_module.register_comm_hook(state, fn)
    loader = fabric.setup_dataloaders(
        DataLoader(regression_data(64, 1), batch_size=8, shuffle=False)
    )
    losses = []
    for _ in range(EPOCHS):
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            opt.step()
            losses.append(loss.detach())
    mean_loss = fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean")
    _save(out, fabric.global_rank, model.module.state_dict(), mean_loss, int(state.stats.calls))


if __name__ == "__main__":
    framework, *args = sys.argv[1:6]
    {"trainer": run_trainer, "fabric": run_fabric}[framework](*args)
