"""The DiLoCo benchmark end to end on loopback (few steps), and its report."""

from __future__ import annotations

import json
from pathlib import Path

from xcomm_bench.diloco import main, plot, table


def test_smoke_run_counts_fewer_bytes_for_diloco(tmp_path: Path) -> None:
    out = tmp_path / "diloco"
    argv = ["--rates", "loopback", "--steps", "40", "--sync-every", "10"]
    assert main([*argv, "--configs", "ddp,diloco,diloco-int8", "--out", str(out)]) == 0
    rows = json.loads((out / "diloco.json").read_text())["rates"]["loopback"]
    assert list(rows) == ["ddp", "diloco", "diloco-int8"]
    ddp, fp32, int8 = (rows[k]["link_bytes_per_sample"] for k in ("ddp", "diloco", "diloco-int8"))
    # 85,002 float32 parameters, 2 ranks, batch 64: a ring allreduce a step
    assert ddp == 2 * 85_002 * 4 / 2 / 64
    assert fp32 == ddp / 10  # an outer step every 10 steps
    assert 3.9 * int8 < fp32 < 4 * int8  # int8 plus a scale per 1024 elements
    assert all(r["seconds"] > 0 and r["nic_bytes_per_sample"] > 0 for r in rows.values())
    assert "| loopback | diloco-int8 |" in (out / "diloco.md").read_text()
    assert (out / "diloco.png").read_bytes()[:4] == b"\x89PNG"


def test_table_gives_ratios_to_ddp(tmp_path: Path) -> None:
    row = {"accuracy": 0.98, "nic_bytes_per_sample": 10.0, "seconds_all": []}
    result = {
        "steps": 600,
        "batch_size": 64,
        "sync_every": 20,
        "repeats": 1,
        "rates": {
            "0.1gbit": {
                "ddp": {**row, "seconds": 30.0, "link_bytes_per_sample": 5000.0},
                "diloco-int8": {**row, "seconds": 3.0, "link_bytes_per_sample": 50.0},
            }
        },
    }
    assert "| 0.1gbit | diloco-int8 | 98.00% | +0.00 pp | 3.00 | 10.00x | 10 | 50 | 100.0x |" in (
        table(result)
    )
    assert plot(tmp_path / "t.png", result).exists()
