"""``xcomm.lightning``'s strategies against Lightning's own DDP on gloo with
the same hook (lightning_strategy_client.py, run as a program).

Each case runs the same script twice, same seed: with ``XcommStrategy`` /
``XcommFabricStrategy`` (an xcomm comm hook and ``xcomm.Options``), and with
Lightning's ``DDPStrategy(process_group_backend="gloo")`` and the same hook
registered by hand on the DDP model. Both ranks' final parameters and the
synced loss must be bitwise equal (two ranks: sums of two floats do not
depend on order); the hook must have run on every rank of both (the same
number of times); the xcomm group must carry the options given to the
strategy. Cases: Trainer with Lightning's subprocess launcher (fp16), the
Trainer with ``ddp_spawn`` (PowerSGD: its state travels to the spawned ranks
by pickle), and Fabric with its subprocess launcher (int8). The script
imports xcomm only inside ``main()``, which spawned ranks never run.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from client_common import BACKENDS, assert_same, run_client_program

pytest.importorskip("pytorch_lightning")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "lightning_strategy_client.py")
RUN_TIMEOUT = 120
FUSION_BYTES = 65536  # as the client sets it


def run_client(framework: str, backend: str, launch: str, hook: str, tmp: str) -> list[dict]:
    out = os.path.join(tmp, f"{framework}_{backend}_{launch}_{hook}")
    label = f"{framework} {backend} {launch} {hook}"
    args = [SCRIPT, framework, backend, launch, hook, out]
    return run_client_program(args, out, backend, tmp, RUN_TIMEOUT, label)


@pytest.mark.client
@pytest.mark.slow
@pytest.mark.parametrize(
    ("framework", "launch", "hook"),
    # each run ~11 s on 2 cores, two per case; on the second torch the Trainer
    # case that spawns and the Fabric case (the strategy's two faces)
    [
        pytest.param("trainer", "ddp", "fp16", marks=pytest.mark.first_torch_only),
        ("trainer", "ddp_spawn", "powersgd"),
        ("fabric", "ddp", "int8"),
    ],
)
def test_strategy_with_hook_matches_gloo(
    framework: str, launch: str, hook: str, tmp_path: Any
) -> None:
    res = {b: run_client(framework, b, launch, hook, str(tmp_path)) for b in BACKENDS}
    assert_same(
        {b: [{"params": r["params"], "loss": r["loss"]} for r in v] for b, v in res.items()}
    )
    calls = {b: [r["hook_calls"] for r in v] for b, v in res.items()}
    # 2 epochs of 4 steps per rank, one bucket each: the hook ran on every rank of both runs
    assert all(c > 0 for v in calls.values() for c in v), calls
    assert calls["xcomm"] == calls["gloo"], calls
    assert [r["fusion_threshold_bytes"] for r in res["xcomm"]] == [FUSION_BYTES] * 2
    r0, r1 = res["xcomm"]
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k


def test_strategies_are_registered_by_name() -> None:
    import pytorch_lightning as pl
    from lightning_fabric import Fabric

    from xcomm.lightning import XcommFabricStrategy, XcommStrategy

    for name, start_method in (("xcomm", "popen"), ("xcomm_spawn", "spawn")):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        assert type(trainer.strategy) is XcommStrategy, name
        assert trainer.strategy._start_method == start_method
        assert trainer.strategy.process_group_backend == "xcomm"
        fabric = Fabric(accelerator="cpu", devices=2, strategy=name)
        assert type(fabric.strategy) is XcommFabricStrategy, name
    with pytest.raises(TypeError, match="xcomm backend"):
        XcommStrategy(process_group_backend="gloo")
