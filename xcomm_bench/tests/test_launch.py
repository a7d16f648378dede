"""The one way the benchmarks start ranks: xcomm_bench.launch.run_ranks (loopback here;
the emulated-cluster path is covered by test_cluster and the DDP cluster test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xcomm_bench.launch import REPO, module_command, python_env, run_ranks

# Each rank imports xcomm_bench and writes its env:// variables to a file.
PROBE = (
    "import json, os, sys\n"
    "import xcomm_bench.launch\n"
    "keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'EXTRA')\n"
    "out = {k: os.environ.get(k) for k in keys}\n"
    "with open(os.path.join(sys.argv[1], 'rank' + out['RANK']), 'w') as f: json.dump(out, f)\n"
)


def test_ranks_get_env_and_find_the_package_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    cmd = [sys.executable, "-c", PROBE, str(tmp_path)]
    assert run_ranks(cmd, 3, env={"EXTRA": "x"}, timeout=120) == 0
    ranks = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(3)]
    assert [r["RANK"] for r in ranks] == ["0", "1", "2"]
    assert {(r["WORLD_SIZE"], r["MASTER_ADDR"], r["EXTRA"]) for r in ranks} == {
        ("3", "127.0.0.1", "x")
    }
    assert len({r["MASTER_PORT"] for r in ranks}) == 1


def test_first_failing_rank_status_and_the_others_are_stopped() -> None:
    # Rank 1 fails at once; rank 0 would wait for it for a minute.
    code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)"
    t0 = time.monotonic()
    assert run_ranks([sys.executable, "-c", code], 2, fail_grace_s=0.5) == 3
    assert time.monotonic() - t0 < 30


def test_timeout_kills_the_ranks_and_returns_124(capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    assert run_ranks([sys.executable, "-c", "import time; time.sleep(60)"], 2, timeout=1) == 124
    assert time.monotonic() - t0 < 30
    assert "still running after 1s" in capsys.readouterr().err


def test_arguments_checked_and_python_env() -> None:
    with pytest.raises(ValueError, match="multiple of nodes"):
        run_ranks(["true"], 3, nodes=2)
    with pytest.raises(ValueError, match="emulated cluster"):
        run_ranks(["true"], 2, rate="1gbit")
    env = python_env({"PYTHONPATH": os.pathsep.join(["/a", str(REPO)])})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/a"]
    assert module_command("xcomm_bench", "ddp") == [sys.executable, "-m", "xcomm_bench", "ddp"]


@pytest.mark.slow
def test_convergence_trains_the_examples_digits_task(tmp_path: Path) -> None:
    """The convergence benchmark trains examples/digits.py on 2 loopback ranks per run."""
    out = tmp_path / "conv"
    cmd = module_command("xcomm_bench", "convergence", "--steps", "40", "--no-progress")
    only = "uncompressed,xcomm int8 hook,FSDP2 uncompressed,FSDP2 int8 reduce-scatter"
    cmd += ["--only", only, "--out", str(out)]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=python_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["run"]["label"]: r for r in json.loads((out / "convergence.json").read_text())}
    assert list(rows) == only.split(",")
    assert all(r["final_accuracy"] > 0.5 for r in rows.values())
    # 2 ranks, ring allreduce of 85,002 float32 gradients: 4 bytes each per step.
    assert rows["uncompressed"]["wire_bytes_per_step"] == pytest.approx(4 * 85_002)
    assert (
        rows["xcomm int8 hook"]["wire_bytes_per_step"]
        < rows["uncompressed"]["wire_bytes_per_step"] / 3
    )
    # FSDP2: a reduce-scatter of the same gradients, half the ring allreduce's bytes.
    fsdp, fsdp_int8 = rows["FSDP2 uncompressed"], rows["FSDP2 int8 reduce-scatter"]
    assert fsdp["wire_bytes_per_step"] == pytest.approx(2 * 85_002)
    assert fsdp_int8["wire_bytes_per_step"] < fsdp["wire_bytes_per_step"] / 3
    assert (out / "convergence.png").stat().st_size > 0


def test_rank_spawner_places_rank_zero_first_and_refuses_a_rate_without_nodes() -> None:
    from xcomm_bench.launch import RankSpawner

    with pytest.raises(ValueError, match="a link rate needs emulated nodes"):
        RankSpawner(rate="1gbit")
    spread = RankSpawner(nodes=2)
    assert [spread.node_of(r, 3) for r in range(3)] == [0, 0, 1]
    assert [spread.node_of(r, 4) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(RuntimeError, match="enter the `with` block"):
        spread.env(0, 2, 29500)
    loopback = RankSpawner()
    assert loopback.where == "one host (loopback)" and loopback.node_of(3, 4) == 0
    env = loopback.env(1, 2, 1234)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "2", "1234")
