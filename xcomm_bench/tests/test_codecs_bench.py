"""The codec benchmark's throughput table: rows, ratios and the plot."""

from __future__ import annotations

import json
from pathlib import Path

from xcomm_bench import codecs


def test_throughput_table_reports_every_method_against_copy(tmp_path: Path) -> None:
    out = tmp_path / "codecs"
    rc = codecs.main(
        [
            "--sizes",
            "",
            "--throughput-size",
            "64K",
            "--threads-list",
            "1",
            "--reps",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rows = json.loads((out / "throughput.json").read_text())
    methods = {r["method"] for r in rows}
    assert {"copy (reference)", "int8 + EF", "fp16 cast", "bf16 cast"} <= methods
    assert any(m.startswith("top-k") for m in methods) and any(
        m.startswith("random-k") for m in methods
    )
    copy = next(r for r in rows if r["method"] == "copy (reference)")
    assert copy["ratio"] == 1.0
    for r in rows:
        assert r["gb_s"] > 0 and abs(r["ratio"] - r["gb_s"] / r["copy_gb_s"]) < 1e-9
    assert (out / "throughput.png").stat().st_size > 0
    assert "| int8 + EF | 1 |" in (out / "throughput.md").read_text()
