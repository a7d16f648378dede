"""docs/quickstart.md's program, examples/quickstart.py, runs as the page shows:
the int8 hook and auto both run (their collectives are counted in
``xcomm.stats()``), training learns, and the timeline is written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *flags: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), *flags],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step \d+: loss ([0-9.]+)$", out, re.MULTILINE)]


@pytest.mark.parametrize("flags", [(), ("--auto",)], ids=["int8", "auto"])
def test_the_quickstart_runs_as_documented(tmp_path: Path, flags: tuple[str, ...]) -> None:
    out = _run(tmp_path, *flags)
    losses = _losses(out)
    assert len(losses) == 3 and losses[-1] < 0.6 * losses[0], out
    calls = {m[0]: int(m[1]) for m in re.findall(r"^(\S+): (\d+) calls", out, re.MULTILINE)}
    ratio = float(re.search(r"^hook: ([0-9.]+)x fewer", out, re.MULTILINE).group(1))
    if flags:
        assert sum(n for op, n in calls.items() if op.startswith("AUTO:")) == 28, calls
        assert re.search(
            r"^bucket 0 \(\d+ elements\): \w+ since step \d+; predicted ms:", out, re.MULTILINE
        )
        assert ratio >= 1.0, out
    else:
        # The int8 hook's two collectives ran on each of the 28 compressed steps.
        assert calls.get("ALLTOALL_BASE") == 28 and calls.get("_ALLGATHER_BASE") == 28, calls
        assert 3.0 < ratio < 4.0, out
    trace = json.loads((tmp_path / "quickstart-timeline.rank0.json").read_text())
    assert trace["traceEvents"], trace
