"""The autoswitch benchmark's report (no root needed); its run is in docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

from xcomm_bench.autoswitch import parser, plot


def test_plot_marks_the_rate_changes_and_the_methods(tmp_path: Path) -> None:
    records = [
        {"step": s, "ms": 80.0 if s < 5 else 400.0, "methods": ["none" if s < 7 else "powersgd"]}
        for s in range(12)
    ]
    result = {"model": "mlp", "records": records, "changes": [{"step": 5, "rate": "100mbit"}]}
    png = plot(tmp_path / "a.png", result)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 5_000 < png.stat().st_size < 200_000


def test_command_line_defaults() -> None:
    args = parser().parse_args([])
    assert (args.rate_from, args.rate_to, args.change_at) == ("10gbit", "100mbit", 12)
    assert not args.worker
