"""The host-work benchmarks of the PowerSGD and int8 hooks in a quick run: the
ref hook loads from git beside today's, both run, and their gradients agree."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from xcomm_bench import hook_host, powersgd_compute
from xcomm_bench.launch import REPO


def _in_git() -> bool:
    probe = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], check=False, capture_output=True
    )
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _in_git(), reason="--compare-ref reads the hook from git")


def test_small_buckets_are_one_layer_each() -> None:
    buckets = powersgd_compute.ddp_buckets(powersgd_compute.small_mlp_shapes(), 0.02)
    assert len(buckets) == 6  # 2 layers (33,280 bytes) per 0.02 MiB bucket
    assert [b.is_last() for b in buckets] == [False] * 5 + [True]


def test_compute_times_the_ref_hook_beside_todays(tmp_path: Path) -> None:
    import xcomm  # noqa: F401 - registers the backend

    ref = powersgd_compute.hook_at("HEAD")
    dist.init_process_group("xcomm", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        r = powersgd_compute.measure("mlp-small", 4, steps=2, bucket_mb=0.02, ref=ref)
    finally:
        dist.destroy_process_group()
    assert r["buckets"] == 6
    for key in ("torch", "xcomm", "ref"):
        assert r[key] > 0 and r[key + "_cpu"] > 0
    assert r["ref_ratio"] == r["xcomm"] / r["ref"]


@pytest.mark.parametrize("hook", ["powersgd", "int8", "topk", "randomk"])
def test_host_benchmark_runs_ddp_with_both_hooks(
    hook: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = hook_host.main(
        ["--hook", hook, "--world", "2", "--steps", "2", "--rounds", "1", "--compare-ref", "HEAD"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "6 buckets, world size 2" in out
    assert "same gradients bit for bit: True" in out
    rows = {line.split()[0] for line in out.splitlines()[2:5]}
    assert rows == {"none", "xcomm", "ref"}, out
