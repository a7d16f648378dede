"""PyTorch Lightning on xcomm vs on gloo (lightning_client.py, run as a program).

Each case runs the same Lightning script twice, with
``DDPStrategy(process_group_backend="xcomm")`` and with ``"gloo"``, same seed;
the final parameters of every rank and the epoch metrics logged with
``sync_dist=True`` (mean and max reductions) must be bitwise equal (two ranks:
sums of two floats do not depend on order). Strategies ``ddp`` (Lightning
re-launches the script for rank 1) and ``ddp_spawn``; with no comm hook and
with xcomm's fp16 / int8 hooks passed as ``ddp_comm_hook``/``ddp_comm_state``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch
from client_common import BACKENDS, assert_same

pytest.importorskip("pytorch_lightning")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "lightning_client.py")
RUN_TIMEOUT = 120


def run_lightning(backend: str, strategy: str, hook: str, tmp: str) -> list[dict[str, Any]]:
    out = os.path.join(tmp, f"{backend}_{strategy}_{hook}")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(k, None)
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, backend, strategy, hook, out],
        cwd=tmp,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the ranks Lightning starts share our process group id
    )
    try:
        log, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"lightning {backend} {strategy} {hook} hung:\n{log.decode()[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.decode(errors="replace")
    assert proc.returncode == 0, f"lightning {backend} {strategy} {hook} failed:\n{text[-6000:]}"
    results = [torch.load(f"{out}.rank{r}.pt") for r in range(2)]
    for r in results:
        assert r["backend"] == backend and r["world_size"] == 2, (r["backend"], text[-2000:])
    return results


@pytest.mark.client
@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "hook"),
    # both strategies, each with and without a hook (each run ~25 s on 2 cores)
    [("ddp", "none"), ("ddp", "fp16"), ("ddp_spawn", "none"), ("ddp_spawn", "int8")],
)
def test_lightning_ddp_matches_gloo(strategy: str, hook: str, tmp_path: Any) -> None:
    res = {b: run_lightning(b, strategy, hook, str(tmp_path)) for b in BACKENDS}
    assert_same(
        {b: [{"params": r["params"], "metrics": r["metrics"]} for r in v] for b, v in res.items()}
    )
    r0, r1 = res["xcomm"]
    assert set(r0["metrics"]) == {"train_loss", "train_max", "val_loss"}
    # synced metrics and DDP-averaged parameters agree across ranks
    for k in r0["metrics"]:
        assert torch.equal(r0["metrics"][k], r1["metrics"][k]), k
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k
    assert r0["metrics"]["train_max"] >= r0["metrics"]["train_loss"]
