"""Tests of the collectives benchmark (python/xcomm/bench)."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from xcomm.bench import SweepConfig, busbw, busbw_factor, message_sizes, report
from xcomm.bench.__main__ import build_parser, config_from_args
from xcomm.bench.collectives import BackendSpec, iteration_counts, parse_size
from xcomm.bench.metrics import OPS, algbw, percentile
from xcomm.bench.ops import effective_count, make_case

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------- formulas


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        ("allreduce", 2, 1.0),
        ("allreduce", 4, 1.5),
        ("allreduce", 8, 1.75),
        ("allreduce", 1, 0.0),
        ("allgather", 2, 0.5),
        ("allgather", 4, 0.75),
        ("reduce_scatter", 8, 0.875),
        ("alltoall", 4, 0.75),
        ("broadcast", 2, 1.0),
        ("broadcast", 8, 1.0),
    ],
)
def test_busbw_factors(op: str, n: int, factor: float) -> None:
    assert busbw_factor(op, n) == pytest.approx(factor)


def test_bandwidth_formulas() -> None:
    # 1 GB in 1 s is 1 GB/s algbw (GB = 1e9 bytes); busbw scales it.
    assert algbw(10**9, 1.0) == pytest.approx(1.0)
    assert algbw(256 << 20, 0.5) == pytest.approx((256 << 20) / 0.5 / 1e9)
    assert busbw(10**9, 2.0, "allreduce", 4) == pytest.approx(0.5 * 2 * 3 / 4)
    assert busbw(10**9, 1.0, "alltoall", 2) == pytest.approx(0.5)
    assert busbw(10**9, 1.0, "broadcast", 16) == pytest.approx(1.0)
    assert math.isinf(algbw(1, 0.0))
    with pytest.raises(ValueError):
        busbw_factor("gather", 2)
    with pytest.raises(ValueError):
        busbw_factor("allreduce", 0)


def test_percentile_and_sizes() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 90) == 5.0
    assert message_sizes(8, 256 << 20, 2)[0] == 8
    assert message_sizes(8, 256 << 20, 2)[-1] == 256 << 20
    assert len(message_sizes(8, 256 << 20, 2)) == 26
    assert message_sizes(1024, 1 << 20, 4) == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert message_sizes(10, 20, 1.5) == [10, 15]
    assert parse_size("256M") == 256 << 20
    assert parse_size("4KiB") == 4096
    assert parse_size("8") == 8


def test_iteration_policy_scales_down() -> None:
    cfg = SweepConfig(backends=["gloo"])
    assert iteration_counts(8, cfg) == (5, 20)
    assert iteration_counts(64 << 20, cfg) == (2, 8)
    assert iteration_counts(256 << 20, cfg) == (1, 3)


def test_effective_count_rounds_to_world_size() -> None:
    assert effective_count("allreduce", 8, 2, 4) == 2
    assert effective_count("allreduce", 2, 2, 4) == 1
    assert effective_count("allgather", 8, 4, 4) == 4
    assert effective_count("alltoall", 100, 3, 4) == 24


def test_backend_spec() -> None:
    assert BackendSpec.parse("gloo") == BackendSpec("gloo", "cpu")
    assert BackendSpec.parse("nccl") == BackendSpec("nccl", "cuda")
    assert BackendSpec.parse("xcomm:cuda").label == "xcomm:cuda"
    with pytest.raises(ValueError):
        BackendSpec.parse("gloo:tpu")


def test_config_argv_round_trip() -> None:
    cfg = SweepConfig(
        backends=["xcomm", "gloo"],
        ops=["allreduce", "alltoall"],
        nproc=4,
        min_bytes=64,
        max_bytes=1 << 20,
        factor=4.0,
        max_iters=7,
        min_iters=2,
        iter_bytes=1 << 24,
        max_warmup=2,
        dtype="bfloat16",
        out=None,
        nodes=2,
        rate="1gbit",
        plot=False,
        progress=False,
        threads=1,
        label="x y",
        interleave=False,
    )
    args = build_parser().parse_args(["collectives", *cfg.to_argv()])
    assert config_from_args(args) == cfg


def test_config_validation_messages() -> None:
    with pytest.raises(ValueError, match="multiple of nodes"):
        SweepConfig(backends=["gloo"], nproc=3, nodes=2).validate()
    with pytest.raises(ValueError, match="needs an emulated cluster"):
        SweepConfig(backends=["gloo"], rate="1gbit").validate()
    with pytest.raises(ValueError, match="unknown ops"):
        SweepConfig(backends=["gloo"], ops=["gather"]).validate()


# ----------------------------------------------------------------- correctness patterns


def _simulate(op: str, cases: list) -> None:
    """Does what the collective does, in plain torch, across the ranks' cases."""
    n = len(cases)
    if op == "allreduce":
        total = sum(c.buf.clone() for c in cases)
        for c in cases:
            c.buf.copy_(total)
    elif op == "broadcast":
        for c in cases[1:]:
            c.buf.copy_(cases[0].buf)
    elif op == "allgather":
        full = torch.cat([c.inp for c in cases])
        for c in cases:
            c.out.copy_(full)
    elif op == "reduce_scatter":
        total = sum(c.inp for c in cases)
        for r, c in enumerate(cases):
            c.out.copy_(total.chunk(n)[r])
    elif op == "alltoall":
        for r, c in enumerate(cases):
            c.out.copy_(torch.cat([cases[s].inp.chunk(n)[r] for s in range(n)]))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_check_accepts_right_and_rejects_wrong(op: str, n: int, dtype: torch.dtype) -> None:
    cases = [make_case(op, 1000, rank=r, world_size=n, dtype=dtype) for r in range(n)]
    for c in cases:
        c.prepare_check()
    # Untouched outputs (sentinels / own input) must fail, except the broadcast root.
    assert not all(c.check() for c in cases)
    _simulate(op, cases)
    assert all(c.check() for c in cases)
    # A single wrong element anywhere must fail.
    victim = cases[-1]
    out = getattr(victim, "out", None)
    out = victim.buf if out is None else out
    out[-1] += 1
    assert not victim.check()


def test_case_sizes_follow_nccl_tests_convention() -> None:
    ag = make_case("allgather", 4096, rank=0, world_size=2)
    assert ag.nbytes == 4096 and ag.out.numel() == 1024 and ag.inp.numel() == 512
    rs = make_case("reduce_scatter", 4096, rank=0, world_size=2)
    assert rs.inp.numel() == 1024 and rs.out.numel() == 512


# ----------------------------------------------------------------- tiny sweep end to end


@pytest.mark.slow
def test_tiny_sweep_writes_reports_and_is_correct(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "-m",
        "xcomm.bench",
        "collectives",
        "--backends",
        "xcomm,gloo",
        "--nproc",
        "2",
        "--min-bytes",
        "8",
        "--max-bytes",
        "8K",
        "--factor",
        "32",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--out",
        str(out),
        "--no-progress",
        "--timeout",
        "100",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "xcomm/gloo" in proc.stdout and "check" in proc.stdout
    for name in ("collectives.csv", "collectives.json", "collectives.md", "collectives.png"):
        assert (out / name).stat().st_size > 0, name

    with open(out / "collectives.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    sizes = {8, 256, 8192}
    assert {(r["backend"], r["op"], int(r["nbytes"])) for r in rows} == {
        (b, op, s) for b in ("xcomm", "gloo") for op in OPS for s in sizes
    }
    assert all(r["correct"] == "True" for r in rows), [r for r in rows if r["correct"] != "True"]

    data = json.loads((out / "collectives.json").read_text())
    assert data["meta"]["world_size"] == 2 and data["meta"]["torch"] == torch.__version__
    for r in data["results"]:
        t = r["time_us"] * 1e-6
        assert r["algbw_gbps"] == pytest.approx(r["nbytes"] / t / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * busbw_factor(r["op"], 2))
        assert r["time_us_min"] <= r["time_us"] <= r["time_us_max"]

    ms, _ = report.load_json(out / "collectives.json")
    md = report.format_markdown(ms, baseline="gloo", ops=["allreduce"])
    assert md.count("\n") == 1 + len(sizes) and "FAIL" not in md
