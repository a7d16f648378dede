"""The FSDP2 benchmark end to end on loopback (tiny model), and its report."""

from __future__ import annotations

import json
from pathlib import Path

from xcomm_bench.fsdp import main, plot, table


def test_smoke_run_reports_every_method_and_the_bytes_saved(tmp_path: Path) -> None:
    out = tmp_path / "fsdp"
    argv = ["--smoke", "--rates", "loopback", "--steps", "2", "--min-bytes", "0"]
    methods = ["gloo", "none", "bf16", "int8", "backend-int8", "auto"]
    assert main([*argv, "--methods", ",".join(methods), "--out", str(out)]) == 0
    result = json.loads((out / "fsdp.json").read_text())
    rows = result["rates"]["loopback"]
    assert list(rows) == methods
    assert all(r["ms"] > 0 and len(r["ms_all"]) == 2 for r in rows.values())
    none, bf16, int8 = (rows[m]["rs_mb_per_step"] for m in ("none", "bf16", "int8"))
    # tiny layers: int8 pays for its scales and whole 1024-element chunks
    assert none > 0 and bf16 < 0.51 * none and int8 < bf16, rows
    # the backend's int8 reduce-scatter: the hook's bytes (same rows), without a hook
    assert rows["backend-int8"]["rs_mb_per_step"] == int8, rows
    assert rows["gloo"]["rs_mb_per_step"] is None  # a plain Gloo group counts nothing
    assert rows["auto"]["methods"], rows["auto"]  # what auto chose, in the table too
    md = (out / "fsdp.md").read_text()
    assert "| loopback | int8 |" in md and "| loopback | auto (" in md
    assert (out / "fsdp.png").read_bytes()[:4] == b"\x89PNG"


def test_table_gives_ratios_to_none(tmp_path: Path) -> None:
    row = {"ms_all": [], "nic_mb_per_step": 1.0, "rs_mb_per_step": 1.0}
    result = {
        "model": "mlp",
        "steps": 3,
        "warmup": 1,
        "rates": {"1gbit": {"none": {**row, "ms": 300.0}, "int8": {**row, "ms": 200.0}}},
    }
    assert "| 1gbit | int8 | 200 | 1.50x |" in table(result)
    assert plot(tmp_path / "t.png", result).exists()
