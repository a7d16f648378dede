"""torchrun (``torch.distributed.run``) elastic restart on xcomm and on gloo.

``torchrun --standalone --nproc-per-node=2 --max-restarts=1`` runs
torchrun_client.py; rank 1 fails on the first attempt, the agent restarts
both workers, and the second attempt trains a small DDP model. On both
backends the job must succeed on attempt 1, and the outputs (parameters,
gathered objects, the first attempt's all-reduce) must be equal.

With torch 2.13's default (workers share the agent's TCPStore,
``TORCHELASTIC_USE_AGENT_STORE=True``) the restarted attempt reads the first
attempt's stale Gloo addresses from the store, and the restart fails or
hangs in Gloo's connectFullMesh on gloo and on xcomm alike (which of the two
varies from run to run). The test therefore sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: rank 0 hosts a fresh store per
attempt.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch
from client_common import BACKENDS, assert_same

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "torchrun_client.py")
RUN_TIMEOUT = 120


def _kill_workers(outdir: str) -> None:
    """Kill leftover workers of our run (torchrun starts each in its own
    session, so killing torchrun's process group misses them): the processes
    whose command line names our unique output folder."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if SCRIPT.encode() in cmd and outdir.encode() in cmd:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def launch(backend: str, outdir: str, share_store: bool, timeout: float) -> tuple[int | None, str]:
    """(return code or None if it hung past ``timeout``, output)."""
    os.makedirs(outdir)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "0" if share_store else "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.2",
        SCRIPT,
        backend,
        outdir,
    ]
    log_path = outdir + ".log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _kill_workers(outdir)
    with open(log_path, errors="replace") as f:
        return code, f.read()


def run_torchrun(backend: str, outdir: str) -> tuple[list[dict[str, Any]], list[str]]:
    code, text = launch(backend, outdir, share_store=False, timeout=RUN_TIMEOUT)
    # The reference only: plain torch + Gloo (xcomm not loaded) sometimes
    # aborts in the restarted attempt ("terminate called without an active
    # exception"): once on torch 2.14.1, and twice in a row on torch 2.13.0 in
    # one CI run. It gets up to three launches; xcomm's own run gets
    # no second chance.
    for _ in range(2):
        if backend != "gloo" or code in (None, 0):
            break
        shutil.rmtree(outdir, ignore_errors=True)
        code, text = launch(backend, outdir, share_store=False, timeout=RUN_TIMEOUT)
    assert code is not None, f"torchrun on {backend} hung:\n{text[-4000:]}"
    assert code == 0, f"torchrun on {backend} failed:\n{text[-6000:]}"
    assert "injected failure on rank 1" in text, text[-3000:]
    results = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(2)]
    return results, sorted(f for f in os.listdir(outdir) if f.startswith("attempt"))


@pytest.mark.client
@pytest.mark.slow
def test_torchrun_restart_matches_gloo(tmp_path: Any) -> None:
    res, files = {}, {}
    for b in BACKENDS:
        res[b], files[b] = run_torchrun(b, str(tmp_path / b))
    for b in BACKENDS:
        assert [r["backend"] for r in res[b]] == [b, b]
        assert [r["attempt"] for r in res[b]] == [1, 1], f"{b}: not restarted exactly once"
        assert files[b] == [
            "attempt0_rank0.txt",
            "attempt0_rank1.txt",
            "attempt1_rank0.txt",
            "attempt1_rank1.txt",
        ]
    strip = {
        b: [{k: r[k] for k in ("params", "gathered", "allreduce")} for r in v]
        for b, v in res.items()
    }
    assert_same(strip)
    r0, r1 = res["xcomm"]
    assert r0["gathered"] == [{"rank": 0, "attempt": 1}, {"rank": 1, "attempt": 1}]
    assert r0["allreduce"].item() == 3.0
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k
