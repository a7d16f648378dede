"""CI-sized runs of the differential fuzzer (``python -m xcomm_bench.fuzz``).

Every ``Options`` combination at 2 ranks for a fixed seed, one 3-rank run
with its subgroups, and a planted difference that the fuzzer must report (a
fuzzer that cannot fail proves nothing). Each runs the controller in a
subprocess, as a user would, and reads its summary JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from xcomm_bench.fuzz import CONFIGS, make_program, subgroups
from xcomm_bench.launch import python_env

SEED = 12


def _fuzz(tmp_path: Path, *args: str, timeout: float = 240) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "xcomm_bench.fuzz", "--seed", str(SEED), "--out", str(out), *args]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        check=False,
        env=python_env(),
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(out.read_text())


def _assert_clean(code: int, summary: dict[str, Any], configs: list[str], ops: int) -> None:
    expected = sum(map(len, make_program(SEED, ops, summary["world_size"])))
    assert summary["program_ops"] == expected >= ops
    bad = {
        name: (run["outcome"], run["status"], run["mismatches"][:3])
        for name, run in summary["runs"].items()
        if run["outcome"] != "ok" or run["mismatches"] or run["ops"] != expected
    }
    assert not bad, bad
    assert sorted(summary["runs"]) == sorted(configs)
    assert summary["total_ops"] == expected * len(configs)
    assert summary["failures"] == 0 and code == 0


@pytest.mark.slow
def test_every_configuration_at_two_ranks(tmp_path: Path) -> None:
    ops = 120
    # Every fixed method; auto where it may compress (shm off: it measures the
    # link with probes between the program's ops), with and without fusion.
    names = [c.name for c in CONFIGS if c.compression != "auto"]
    names += ["noshm-off-auto", "noshm-cycle-auto"]
    assert len(names) == 26 and len(CONFIGS) == 30
    code, summary = _fuzz(tmp_path, "--ops", str(ops), "--configs", ",".join(names))
    _assert_clean(code, summary, names, ops)
    for run in summary["runs"].values():
        # Rank 0 skips the batches on the single-rank group [1]; rank 1 runs all.
        per_rank = run["ops_run_per_rank"]
        assert per_rank[1] == summary["program_ops"] > per_rank[0] > 0
    # Compression really happened: lossy ops came back inexact, within the bound.
    for kind in ("fp16", "bf16", "int8"):
        runs = [r for n, r in summary["runs"].items() if n.endswith("-" + kind)]
        assert sum(r["lossy_inexact"] for r in runs) > 0, kind
    # The op-after-a-refused-op pattern ran: refused as gloo's where Gloo runs
    # it, reduced exactly on shared memory, and the ops after it clean.
    runs = summary["runs"].items()
    assert sum(r["rejected_raised"] for n, r in runs if n.startswith("noshm")) > 0
    assert sum(r["rejected_ran"] for n, r in runs if n.startswith("shm")) > 0
    for name, run in summary["runs"].items():
        if name.endswith("-none"):
            assert run["lossy_ops"] == 0, name
        if name.endswith("-auto"):
            assert run["lossy_ops"] > 0, name  # checked against the bound


@pytest.mark.slow
def test_three_ranks_with_subgroups(tmp_path: Path) -> None:
    ops = 300
    configs = ["shm-ondemand-int8", "noshm-cycle-bf16"]
    code, summary = _fuzz(
        tmp_path, "--ops", str(ops), "--world-size", "3", "--configs", ",".join(configs)
    )
    assert summary["subgroups"] == subgroups(3) == [[0, 1, 2], [0, 1], [1, 2]]
    _assert_clean(code, summary, configs, ops)
    program = make_program(SEED, ops, 3)
    for run in summary["runs"].values():
        # Each rank ran exactly the ops of the groups it belongs to.
        want = [sum(len(b) for b in program if r in subgroups(3)[b[0]["group"]]) for r in range(3)]
        assert run["ops_run_per_rank"] == want
        assert len(set(want)) == 3  # every subgroup was used
        assert run["lossy_inexact"] > 0


@pytest.mark.slow
def test_a_planted_difference_is_reported(tmp_path: Path) -> None:
    code, summary = _fuzz(
        tmp_path, "--ops", "60", "--configs", "shm-off-none", "--inject-mismatch", "20"
    )
    run = summary["runs"]["shm-off-none"]
    assert code == 1 and summary["failures"] >= 1
    assert run["outcome"] == "fail"
    assert run["mismatches"] and all(
        int(m.split()[1]) >= 20 and "output" in m for m in run["mismatches"]
    ), run["mismatches"]
