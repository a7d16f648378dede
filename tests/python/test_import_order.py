"""``dist.monitored_barrier`` on xcomm does not depend on the order of
imports (issue 44: ``from torch.distributed import monitored_barrier``
before ``import xcomm`` kept torch's "only implemented for GLOO backend").

Each program runs in fresh interpreters (2 ranks, file rendezvous), taking
its reference to torch's function *before* ``import xcomm``. Reference: the
same program on gloo. Rank 1 skips the barrier; rank 0's must fail naming
rank 1 on both backends, and with every rank present it passes. A group of
another backend (torch's ``fake``) gets the same refusal as without xcomm.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = """
import datetime, os, re, sys, time
from torch.distributed import monitored_barrier  # before import xcomm
import torch.distributed as dist
import xcomm

backend, rank, init, done = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group(backend, init_method=init, rank=rank, world_size=2)
monitored_barrier(timeout=datetime.timedelta(seconds=20))  # all arrive
print("all arrived", flush=True)
if rank == 0:
    try:
        monitored_barrier(timeout=datetime.timedelta(seconds=2))
        print("no error")
    except Exception as exc:  # noqa: BLE001
        m = re.search(r"Ranks? [0-9, ]+ failed to pass monitoredBarrier[^\\n]*", str(exc))
        print("error:", type(exc).__name__, m.group(0) if m else str(exc))
    open(done, "w").close()
else:
    while not os.path.exists(done):  # absent until rank 0's barrier has failed
        time.sleep(0.05)
sys.stdout.flush()
os._exit(0)  # the group is broken after a failed barrier: no teardown
"""


def _run(backend: str, tmp: Path) -> list[str]:
    init = f"file://{tmp / ('rdzv_' + backend)}"
    done = str(tmp / f"done_{backend}")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROGRAM, backend, str(rank), init, done],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{backend}: hung")
        assert p.returncode == 0, out[-3000:]
        outs.append(out)
    return outs


@pytest.mark.slow
def test_monitored_barrier_taken_before_import_xcomm_works(tmp_path: Path) -> None:
    res = {b: _run(b, tmp_path) for b in ("xcomm", "gloo")}
    for backend, (out0, out1) in res.items():
        assert "all arrived" in out0 and "all arrived" in out1, (backend, out0, out1)
        assert "only implemented for GLOO" not in out0, (backend, out0)
        error = [line for line in out0.splitlines() if line.startswith("error:")]
        assert len(error) == 1 and "Rank 1 failed to pass monitoredBarrier" in error[0], (
            backend,
            out0,
        )
    # the same error as the reference (the message names the group's timeout and rank)
    err = {
        b: next(ln for ln in out[0].splitlines() if ln.startswith("error:"))
        for b, out in res.items()
    }
    assert err["xcomm"] == err["gloo"], err


def test_other_backends_keep_torchs_check() -> None:
    """A ``fake`` group gets the error torch gives it without xcomm (torch
    2.13 refuses in Python, 2.14 in C++)."""
    code = (
        "from torch.distributed import monitored_barrier\n"
        "import torch.distributed as dist\n"
        "{import_xcomm}"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=2)\n"
        "try:\n"
        "    monitored_barrier()\n"
        "except Exception as e:\n"
        "    print('refused:', type(e).__name__, e)\n"
    )
    out = {}
    for with_xcomm in (True, False):
        program = code.format(import_xcomm="import xcomm\n" if with_xcomm else "")
        proc = subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[with_xcomm] = proc.stdout
    assert "refused:" in out[False] and "GLOO" in out[False], out
    assert out[True] == out[False], out
