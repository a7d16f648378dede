"""Tests of the benchmarks (xcomm_bench).

The command-line tests run ``python -m xcomm_bench`` in a temporary folder:
the repository root reaches them on PYTHONPATH (``launch.python_env``), as it
reaches every rank the benchmarks start.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xcomm_bench import SweepConfig, busbw, busbw_factor, message_sizes, report
from xcomm_bench.__main__ import build_parser, config_from_args
from xcomm_bench.collectives import BackendSpec, iteration_counts, parse_size
from xcomm_bench.launch import python_env
from xcomm_bench.metrics import OPS, algbw, percentile
from xcomm_bench.ops import effective_count, make_case

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
    # Variants are Options settings of xcomm's group, kept in the label.
    spec = BackendSpec.parse("xcomm+noshm+unchecked")
    assert spec == BackendSpec("xcomm", "cpu", ("noshm", "unchecked"))
    assert spec.label == "xcomm+noshm+unchecked"
    options = spec.pg_options()
    assert options.shm is False and options.check_collectives is False
    assert BackendSpec.parse("xcomm+uncarried").pg_options().carry_small_ops is False
    assert BackendSpec.parse("xcomm").pg_options() is None
    with pytest.raises(ValueError, match="unknown variant"):
        BackendSpec.parse("xcomm+fast")
    with pytest.raises(ValueError, match="only xcomm"):
        BackendSpec.parse("gloo+noshm")


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
        "xcomm_bench",
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
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
        check=False,
        env=python_env(),
    )
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


# ----------------------------------------------------------------- DDP benchmark


def _ddp_args(*extra: str):
    from xcomm_bench.__main__ import ddp_config_from_args

    return ddp_config_from_args(build_parser().parse_args(["ddp", *extra]))


def test_ddp_config_round_trip_and_checks() -> None:
    from xcomm_bench.ddp import DDPBenchConfig

    cfg = DDPBenchConfig(
        models=["mlp", "cnn"],
        reductions=["powersgd", "torch-powersgd"],
        rates=["0.5gbit", "2gbit"],
        nodes=2,
        steps=5,
        rounds=3,
        min_seconds=1.5,
        interleave=False,
        powersgd_rank=2,
        topk_density=0.05,
        backend="gloo",
        threads=1,
        out=None,
        plot=False,
        progress=False,
        label="x y",
    )
    assert _ddp_args(*cfg.to_argv()) == cfg
    assert cfg.ordered_reductions == ["none", "powersgd", "torch-powersgd"]
    smoke = _ddp_args("--smoke")
    assert (smoke.nodes, smoke.world_size, smoke.steps, smoke.smoke) == (0, 2, 2, True)
    with pytest.raises(ValueError, match="warmup must be >= 3"):
        DDPBenchConfig(warmup=2).validate()
    with pytest.raises(ValueError, match="unknown reductions"):
        DDPBenchConfig(reductions=["fp8"]).validate()
    with pytest.raises(ValueError, match="min_seconds must be >= 0"):
        DDPBenchConfig(min_seconds=-1).validate()
    with pytest.raises(ValueError, match=r"0\.1-10 Gbit/s"):
        DDPBenchConfig(rates=["40gbit"]).validate()


def test_ddp_min_seconds_gives_the_contenders_more_timed_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fastest static reduction's last warm-up step sets the count: 16
    steps of 25 ms are 0.4 s, so 2 s asks 80. The autos and the static
    reductions within 2x of the fastest of their comparison get it; one
    several times slower keeps ``steps``; the backend's comparison (none,
    bf16, int8) has its own fastest; the slowest rank's reading decides."""
    from types import SimpleNamespace

    from xcomm_bench import ddp

    def runners(**took: float) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(reduction=r.replace("_", "-"), last_warm=t) for r, t in took.items()
        ]

    cfg = ddp.DDPBenchConfig(steps=16, min_seconds=2.0)
    monkeypatch.setattr(ddp.dist, "all_reduce", lambda t, **kw: None)
    hook = runners(none=0.4, topk=0.025, powersgd=0.040, int8=0.06, auto=0.5)
    assert ddp._timed_steps(cfg, hook, None) == [16, 80, 80, 16, 80]
    # The backend's comparison: its fastest (int8, 0.25 s) asks 8 < 16 steps;
    # bf16 (0.45 s) is within 2x of it, none (0.6 s) is not.
    both = runners(
        none=0.6, topk=0.025, auto=0.03, backend_bf16=0.45, backend_int8=0.25, backend_auto=0.3
    )
    assert ddp._timed_steps(cfg, both, None) == [16, 80, 80, 16, 16, 16]
    fast_backend = runners(none=0.2, backend_bf16=0.05, backend_int8=0.1, backend_auto=0.2)
    assert ddp._timed_steps(cfg, fast_backend, None) == [16, 40, 40, 40]
    assert ddp._timed_steps(cfg, runners(none=0.2), None) == [16]
    assert ddp._timed_steps(dataclasses.replace(cfg, min_seconds=0), hook, None) == [16] * 5

    def slower_rank(t: torch.Tensor, **kw: object) -> None:
        t.clamp_(min=0.05)  # another rank's steps took at least 50 ms

    monkeypatch.setattr(ddp.dist, "all_reduce", slower_rank)
    assert ddp._timed_steps(cfg, hook, None) == [16, 40, 40, 40, 40]


def test_ddp_schedule_interleaves_each_runners_steps_over_the_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every runner's timed steps are spread over the rounds in blocks of at
    least 4 (a round with none of a runner's steps skips it), in the same
    order on every rank."""
    from types import SimpleNamespace

    from xcomm_bench import ddp

    monkeypatch.setattr(
        ddp, "_Runner", lambda spec, r, cfg, group, rank: SimpleNamespace(reduction=r)
    )
    cfg = ddp.DDPBenchConfig(reductions=["topk", "auto"], rounds=3, warmup=3)
    blocks = [
        (b[0].reduction, b[1], b[2])
        for b in ddp._schedule(None, cfg, None, 0, lambda runners: [2, 13, 9])  # type: ignore[arg-type]
    ]
    warm = [("none", 3, False), ("topk", 3, False), ("auto", 3, False)]
    timed = [
        ("none", 2, True), ("topk", 5, True), ("auto", 5, True),
        ("topk", 4, True), ("auto", 4, True),
        ("topk", 4, True),
    ]  # fmt: skip
    assert blocks == warm + timed


def test_ddp_ratio_interval_covers_the_ratio_and_widens_with_block_noise() -> None:
    """The block bootstrap's 90% interval holds the ratio of the medians; a
    series whose rounds sit at different levels gets a wider interval than
    the same steps with the levels shuffled apart; two equal series' interval
    holds 1."""
    import random

    from xcomm_bench.ddp import ratio_interval

    rng = random.Random(3)
    base = [25 + rng.gauss(0, 1) for _ in range(80)]
    lo, hi = ratio_interval(base, base, 8)
    assert lo < 1.0 < hi and hi - lo < 0.05
    drift = [v + (3 if (i // 10) % 2 else 0) for i, v in enumerate(base)]  # rounds of 10 steps
    lo, hi = ratio_interval(drift, base, 8)
    assert lo < statistics.median(drift) / statistics.median(base) < hi
    shuffled = drift[:]
    rng.shuffle(shuffled)
    slo, shi = ratio_interval(shuffled, base, 8)
    assert hi - lo > 1.5 * (shi - slo)


def test_ddp_models_have_the_documented_sizes() -> None:
    from xcomm_bench.ddp import build_model

    sizes = {}
    for name in ("mlp", "cnn", "transformer"):
        spec = build_model(name)
        model = spec.build()
        x, y = spec.batch(torch.Generator().manual_seed(0))
        assert model(x).shape[0] == y.shape[0]
        sizes[name] = sum(p.numel() for p in model.parameters())
    assert 19e6 < sizes["mlp"] < 21e6
    assert 1e6 < sizes["cnn"] < 1.3e6
    assert 2.5e6 < sizes["transformer"] < 4e6


@pytest.mark.slow
def test_ddp_smoke_runs_every_reduction_and_counts_bytes(tmp_path: Path) -> None:
    """Loopback, tiny MLP, 2 ranks: every reduction trains, and the byte counts
    agree with the formulas (fp16 halves them, both PowerSGDs send the same)."""
    from xcomm_bench.ddp import REDUCTIONS

    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "xcomm_bench", "ddp", "--smoke", "--models", "mlp"]
    cmd += ["--reductions", ",".join(REDUCTIONS)]  # unchecked is not a default one
    cmd += ["--out", str(out), "--no-progress", "--timeout", "120"]
    # Both ranks are on one host, where xcomm would take its shared-memory
    # path; torch's powerSGD_hook times out on it (its compressed step, found
    # while writing this benchmark; reported). The benchmark keeps it off on
    # loopback by default; say so explicitly: this test is about the
    # benchmark, not the transport.
    env = python_env({**os.environ, "XCOMM_SHM": "0"})
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=150, cwd=tmp_path, check=False, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("ddp.csv", "ddp.json", "ddp.md"):
        assert (out / name).stat().st_size > 0, name
    rows = {r["reduction"]: r for r in json.loads((out / "ddp.json").read_text())["results"]}
    assert list(rows) == list(REDUCTIONS)
    b = {k: float(r["bytes_per_step"]) for k, r in rows.items()}
    params = int(rows["none"]["params"])
    assert b["none"] == pytest.approx(4 * params)  # ring allreduce, 2 ranks: 2 (n-1)/n = 1
    assert b["unchecked"] == pytest.approx(b["none"])  # descriptors are not gradient bytes
    assert b["fp16"] == pytest.approx(b["none"] / 2)
    assert b["torch-fp16"] == pytest.approx(b["none"] / 2)
    assert b["powersgd"] == pytest.approx(b["torch-powersgd"])
    assert b["powersgd"] < b["none"] / 2
    assert b["int8"] < b["fp16"] and b["topk"] < b["int8"]
    assert float(rows["none"]["speedup"]) == 1.0
    # auto tells what it chose per bucket, and its table against the fastest is written.
    chosen = rows["auto"]["chosen"].split(",")
    assert chosen and set(chosen) <= {"none", "fp16", "int8", "topk", "powersgd"}
    auto_row = (out / "ddp-auto.md").read_text().splitlines()[2]
    assert auto_row.startswith(f"| mlp | {rows['auto']['rate']} |")
    for r in rows.values():
        assert r["steps"] == 2 and float(r["time_ms"]) > 0 and math.isfinite(r["final_loss"])
        assert float(r["speedup"]) == pytest.approx(
            float(rows["none"]["time_ms"]) / float(r["time_ms"])
        )


def test_ddp_speedup_plot_is_small(tmp_path: Path) -> None:
    from xcomm_bench.ddp import DDPResult, plot_speedup

    results = [
        DDPResult(m, 1000, rate, red, 4, t, t, t, 1.0, 1.0, 10.0 / t, 0.0)
        for m in ("mlp", "cnn")
        for rate in ("0.1gbit", "1gbit", "10gbit")
        for red, t in (("none", 10.0), ("powersgd", 2.0), ("torch-powersgd", 4.0))
    ]
    path = plot_speedup(tmp_path / "ddp.png", results, title="t")
    assert 0 < path.stat().st_size < 200_000


def _have_netns_privileges() -> bool:
    from xcomm_bench.cluster import ClusterError, ClusterPermissionError, check_privileges

    try:
        check_privileges()
    except (ClusterPermissionError, ClusterError):
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(
    not _have_netns_privileges(),
    reason="needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2 for the emulated cluster",
)
def test_ddp_in_emulated_cluster_measures_link_bytes(tmp_path: Path) -> None:
    """2 emulated nodes at 1 Gbit/s: the veth counters see at least the payload
    the reduction accounts for, and fp16 puts fewer bytes on the link."""
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "xcomm_bench", "ddp", "--smoke", "--nodes", "2"]
    cmd += ["--rates", "1gbit", "--models", "mlp", "--reductions", "none,fp16", "--steps", "3"]
    cmd += ["--out", str(out), "--no-progress", "--no-plot", "--timeout", "120"]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        check=False,
        env=python_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["reduction"]: r for r in json.loads((out / "ddp.json").read_text())["results"]}
    assert {r["rate"] for r in rows.values()} == {"1gbit"}
    none, fp16 = rows["none"], rows["fp16"]
    assert none["link_tx_per_step"] >= none["bytes_per_step"] > 0
    assert fp16["link_tx_per_step"] >= fp16["bytes_per_step"] > 0
    assert fp16["link_tx_per_step"] < none["link_tx_per_step"]


def test_fusion_bench_smoke_every_group_and_pattern_identical(tmp_path: Path) -> None:
    """Loopback, 2 ranks, a few ops: all three groups (unfused, fused on
    demand, fused with a cycle) in both patterns report times and give
    results identical to the unfused group (the bench exits 1 otherwise)."""
    cmd = [sys.executable, "-m", "xcomm_bench", "fusion", "--ops", "12", "--elems", "64"]
    cmd += ["--threshold", "1024", "--compute-us", "50", "--rounds", "2", "--warmup", "1"]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
        check=False,
        env=python_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "results identical: True" in proc.stdout
    rows = [
        line.split()
        for line in proc.stdout.splitlines()
        if line.split()[:1] in (["burst"], ["spread"])
    ]
    assert [(r[0], r[1]) for r in rows] == [
        (p, g) for p in ("burst", "spread") for g in ("unfused", "fused", "fused_cycle")
    ]
    assert all(float(r[2]) > 0 and float(r[4]) >= 0 for r in rows)
    # The cycle's own view: rounds ran, and a share of ops was already reduced.
    assert "agreement rounds per sample" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cycle-ms", "0"], "--cycle-ms must be > 0"),
        (["--compute-us", "-1"], "--compute-us >= 0"),
        (["--ops", "0"], "must be >= 1"),
    ],
)
def test_fusion_bench_refuses_bad_arguments(args: list[str], message: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "xcomm_bench", "fusion", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env=python_env(),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
