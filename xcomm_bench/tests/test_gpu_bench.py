"""``python -m xcomm_bench gpu`` on the CPU (what scripts/gpu_check.sh runs on
a GPU): it measures every row, reports a failing method as a failure row, and
writes its JSON and markdown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_gpu_benchmark_runs_on_the_cpu_and_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    cmd = [sys.executable, "-m", "xcomm_bench", "gpu", "--device", "cpu", "--numel", "64K"]
    cmd += ["--reps", "2", "--steps", "2", "--width", "64", "--depth", "2", "--batch", "8"]
    done = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "gpu.json").read_text())
    codecs = {(r["method"], r["impl"]): r for r in result["codecs"]}
    copy = codecs[("copy (reference)", "torch")]
    assert copy["ratio"] == 1.0
    for r in codecs.values():  # on the CPU every codec runs
        assert "error" not in r and r["gb_s"] > 0, r
    hooks = {r["hook"]: r for r in result["ddp"]}
    assert {"none", "torch powerSGD_hook r4", "xcomm powersgd_hook r4", "xcomm auto_hook"} <= set(
        hooks
    )
    for r in hooks.values():
        assert "error" not in r and r["params_finite"], r
    assert hooks["none"]["hook_ms"] == 0
    assert "| copy (reference) | torch |" in (out / "gpu.md").read_text()


def test_the_profile_runs_on_the_cpu_and_profiles_every_hook(tmp_path: Path) -> None:
    """``--profile`` (CPU op time here, GPU kernel time on a GPU): one summary
    row per profiled hook, none failing, and each hook's breakdown."""
    from xcomm_bench.gpu import PROFILED_HOOKS

    cmd = [sys.executable, "-m", "xcomm_bench", "gpu", "--device", "cpu", "--profile"]
    cmd += ["--width", "64", "--depth", "2", "--batch", "8", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    text = (tmp_path / "profile.txt").read_text()
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if " | " in line}
    for hook in PROFILED_HOOKS:
        assert hook in rows and "fails" not in rows[hook], text
        fields = rows[hook].split(" | ")
        assert float(fields[1]) > 0 and float(fields[3]) > 0, rows[hook]
        if hook != "none":
            assert f"{hook}: device time beyond the no-hook step" in text
    assert "PowerSGD compute, xcomm / torch (device time beyond none): " in text


def test_the_profile_counts_each_kernel_once() -> None:
    """On a GPU, an op's self device time repeats the time of the kernels it
    launched, and a scope (``AccumulateGrad``) is billed for kernels launched
    outside any op: only the device's own rows may be summed (an earlier
    profile summed both, so its PowerSGD ratio counted some kernels twice)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from xcomm_bench.gpu import time_rows

    def row(key: str, device: DeviceType, us: float, count: int) -> SimpleNamespace:
        return SimpleNamespace(
            key=key,
            device_type=device,
            self_device_time_total=us,
            self_cpu_time_total=1.0,
            count=count,
        )

    events = [
        row("aten::mm", DeviceType.CPU, 40.0, 4),  # its kernel's time, again
        row("sgemm_kernel", DeviceType.CUDA, 40.0, 4),
        row("autograd::engine::evaluate_function: AccumulateGrad", DeviceType.CPU, 12.0, 2),
        row("gramSchmidtKernel", DeviceType.CUDA, 12.0, 2),
        row("Memcpy DtoD (Device -> Device)", DeviceType.CUDA, 6.0, 2),
        row("aten::empty", DeviceType.CPU, 0.0, 8),
    ]
    on_gpu = time_rows(events, per=2, device=True)
    assert on_gpu == {
        "sgemm_kernel": (20.0, 2.0),
        "gramSchmidtKernel": (6.0, 1.0),
        "Memcpy DtoD (Device -> Device)": (3.0, 1.0),
    }
    # On the CPU each op's self time, every op.
    on_cpu = time_rows(events, per=1, device=False)
    assert set(on_cpu) == {r.key for r in events} and on_cpu["aten::mm"] == (1.0, 4.0)
