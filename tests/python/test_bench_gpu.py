"""``python -m xcomm_bench gpu``, the benchmark ``scripts/gpu_check.sh`` runs on
the GPU machine, in its CPU smoke mode: every codec, product and hook row
runs, and the profile gives the PowerSGD ratio. A GPU session has minutes;
a benchmark that breaks here would waste them there.
"""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--device", "cpu", "--width", "128", "--depth", "2", "--batch", "16"]


def _bench(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "xcomm_bench", "gpu", *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_gpu_benchmark_rows_all_run_on_cpu(tmp_path: Path) -> None:
    _bench(
        "--numel",
        "64K",
        "--reps",
        "2",
        "--steps",
        "2",
        "--matrix",
        "64x96x4",
        "--out",
        str(tmp_path),
    )
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["config"]["rows"] == 64 and result["config"]["rank"] == 4
    codecs = result["codecs"]
    assert [r for r in codecs if "error" in r] == []
    assert codecs[0]["method"] == "copy (reference)" and codecs[0]["ratio"] == 1.0
    products = {(r["product"], r["impl"]): r for r in result["products"]}
    assert set(products) == {
        ("copy of M (reference)", "torch"),
        ("P = M Q", "cuBLAS"),
        ("P = M Q", "xcomm"),
        ("Q = M^T P", "cuBLAS"),
        ("Q = M^T P", "xcomm"),
    }
    for (name, impl), row in products.items():
        if impl == "xcomm":  # the kernels take CUDA tensors only
            assert "declined" in row["error"], row
        else:
            assert row["ms"] > 0 and row["ratio"] > 0, row
    hooks = {r["hook"]: r for r in result["ddp"]}
    assert "torch powerSGD_hook r4" in hooks and "xcomm powersgd_hook r4" in hooks
    for name, row in hooks.items():
        assert "error" not in row, (name, row)
        assert row["params_finite"], name
    assert "| P = M Q | cuBLAS |" in (tmp_path / "gpu.md").read_text()


def test_gpu_profile_gives_the_powersgd_ratio_on_cpu(tmp_path: Path) -> None:
    out = _bench("--profile", "--out", str(tmp_path))
    text = (tmp_path / "profile.txt").read_text()
    assert text.strip() == out.strip()
    assert "fails" not in text, text
    for hook in ("torch powerSGD_hook r4", "xcomm powersgd_hook r4", "xcomm topk_hook 1%"):
        assert f"\n{hook} | " in text, hook
    assert "PowerSGD compute, xcomm / torch (device time beyond none): " in text


def test_profile_arithmetic_examples_hold() -> None:
    """The docstring examples of the profile's sums (``time_rows``, ``busy_us``):
    each kernel counted once, overlapping device spans merged."""
    sys.path.insert(0, ROOT)
    try:
        from xcomm_bench import gpu
    finally:
        sys.path.remove(ROOT)
    failures, tried = doctest.testmod(gpu)
    assert tried >= 8 and failures == 0


def test_a_malformed_matrix_is_a_usage_error_naming_the_option() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "xcomm_bench", "gpu", *SMALL, "--matrix", "2048x2048"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--matrix wants ROWSxCOLSxRANK" in proc.stderr and "'2048x2048'" in proc.stderr
