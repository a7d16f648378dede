"""The main job, examples/train_ddp.py, runs as the README says.

Reference: it must learn (test accuracy far above the 10% of chance after a
short run) and report the bytes each rank sends per step: a ring allreduce
of every float32 gradient uncompressed (2 (n-1)/n x 4 bytes x 85,002
parameters = 332.0 KiB at 2 ranks), fewer with compression.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_ddp.py")
DONE = re.compile(r"final test accuracy ([0-9.]+) .* wire/step ([0-9.]+) KiB")

pytestmark = pytest.mark.slow


def _run(cmd: list[str]) -> tuple[float, float]:
    # The installed xcomm, as the README's commands run it (editable on torch
    # 2.13; a regular install in the torch 2.14 venv, where the source tree's
    # module is the 2.13 build).
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = DONE.search(proc.stdout)
    assert match, proc.stdout[-3000:]
    return float(match.group(1)), float(match.group(2))


def test_spawned_ranks_learn_and_report_bytes() -> None:
    acc, kib = _run([sys.executable, SCRIPT, "--steps", "80", "--log-every", "40"])
    assert acc > 0.8
    assert kib == pytest.approx(332.0, abs=0.1)


def test_torchrun_launch() -> None:
    # torchrun of this interpreter (the `torchrun` on PATH may be another torch's).
    acc, _ = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            SCRIPT,
            "--steps",
            "60",
        ]
    )
    assert acc > 0.7


@pytest.mark.parametrize(
    "flags, max_kib",
    [
        (["--compression", "powersgd"], 100.0),  # compressed after 10 plain steps
        (["--backend-compression", "int8"], 90.0),
    ],
)
def test_compression_cuts_bytes_per_step(flags: list[str], max_kib: float) -> None:
    acc, kib = _run([sys.executable, SCRIPT, "--steps", "60", "--log-every", "60", *flags])
    assert acc > 0.7
    assert kib < max_kib
