"""The overlap benchmark's pure parts: its summary arithmetic, its plot, its arguments.

(The measurement itself needs root and an emulated cluster; it is a
benchmark, run by hand: ``python -m xcomm_bench overlap``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from xcomm_bench import overlap


def _rank(times: dict[str, list[float]], waits: dict[str, list[float]]) -> dict:
    return {"times": times, "forward_wait_s": waits}


def test_summary_uses_the_slowest_rank_of_each_step_and_medians() -> None:
    modes = {m: [1.0, 1.0, 1.0] for m in overlap.MODES}
    r0 = dict(modes, after_backward=[2.0, 4.0, 3.0], engine=[1.5, 2.0, 1.0])
    r1 = dict(modes, after_backward=[2.5, 1.0, 1.0], engine=[1.0, 1.0, 2.5])
    waits0 = {"engine_fifo": [0.5, 0.4, 0.6], "engine_priority": [0.1, 0.3, 0.1]}
    waits1 = {"engine_fifo": [0.7, 0.4, 0.2], "engine_priority": [0.2, 0.1, 0.1]}
    s = overlap.summarize([_rank(r0, waits0), _rank(r1, waits1)])
    # per-step max: after_backward [2.5, 4, 3] -> 3; engine [1.5, 2, 2.5] -> 2
    assert s["median_step_s"]["after_backward"] == 3.0
    assert s["median_step_s"]["engine"] == 2.0
    assert s["engine_vs_after_backward"] == pytest.approx(2.0 / 3.0)
    # fifo [0.7, 0.4, 0.6] -> 0.6; priority [0.2, 0.3, 0.1] -> 0.2
    assert s["median_forward_wait_s"]["engine_fifo"] == pytest.approx(0.6)
    assert s["forward_wait_priority_vs_fifo"] == pytest.approx(0.2 / 0.6)


def test_plot_draws_one_panel_per_traced_mode(tmp_path: Path) -> None:
    events = [
        {
            "name": "thread_name",
            "ph": "M",
            "pid": 0,
            "tid": 1,
            "args": {"name": "compute"},
        },
        {
            "name": "thread_name",
            "ph": "M",
            "pid": 0,
            "tid": 2,
            "args": {"name": "engine 2: transfer"},
        },
        {
            "name": "forward",
            "cat": "compute",
            "ph": "X",
            "pid": 0,
            "tid": 1,
            "ts": 100,
            "dur": 50,
        },
        {
            "name": "bucket 0",
            "cat": "transfer",
            "ph": "X",
            "pid": 0,
            "tid": 2,
            "ts": 160,
            "dur": 90,
        },
    ]
    traces = {m: {"traceEvents": events} for m in overlap.TRACED}
    summary = {
        "median_step_s": {m: 0.25 for m in overlap.MODES},
        "median_forward_wait_s": {"engine_fifo": 0.1, "engine_priority": 0.05},
    }
    png = overlap.plot_timeline(tmp_path, traces, summary, "test")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_rejected() -> None:
    assert overlap.main(["--bucket-cap-mb", "0"]) == 2
    assert overlap.main(["--nodes", "1"]) == 2
