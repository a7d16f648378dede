"""The time-to-accuracy benchmark: its arithmetic, and one small run end to end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from xcomm_bench.launch import module_command, python_env
from xcomm_bench.time_to_accuracy import (
    build_task,
    combine,
    format_markdown,
    smoothed,
    steps_to_target,
    target_loss,
)


def _run(history: list[tuple[int, float]], step_s: list[float], **extra: object) -> dict:
    return {"history": history, "step_s": step_s, "hook_calls": 1, **extra}


def test_time_to_target_is_steps_to_the_target_times_the_rates_step_time() -> None:
    none = [(0, 5.0), (10, 4.0), (20, 3.0), (30, 2.5), (40, 2.6)]
    slow_learner = [(0, 5.0), (10, 4.5), (20, 4.0), (30, 3.5), (40, 3.2)]
    fast_learner = [(0, 5.0), (10, 2.9), (20, 2.0), (30, 1.9), (40, 1.8)]
    # The target is none's best so far nearest 3/4 of its run: 2.5 at step 30.
    assert target_loss(none, 0.75) == 2.5
    assert steps_to_target(none, 2.5) == 30
    trained = {
        "none": _run(none, []),
        "topk": _run(slow_learner, []),
        "int8": _run(fast_learner, []),
    }
    timed = {
        "1gbit": {
            "none": {"step_s": [0.1, 0.3], "hook_calls": 0},
            "topk": {"step_s": [0.01], "hook_calls": 5},
            "int8": {"step_s": [0.05, 0.05], "hook_calls": 5},
        }
    }
    # auto at 1 Gbit/s reaches the target at step 20; its first 20 steps took 1 s each.
    auto = _run(fast_learner, [1.0] * 20 + [9.0] * 20, chosen="int8", switches=2)
    rows = combine(trained, timed, {"1gbit": {"auto": auto}}, 0.75, 40)
    by = {r["method"]: r for r in rows}
    assert by["none"]["time_s"] == pytest.approx(30 * 0.2)
    # int8's hook reduces its first 2 steps uncompressed: 2 x 0.2 s, then 18 x 0.05 s.
    assert by["int8"]["steps"] == 20 and by["int8"]["step_ms"] == pytest.approx(50)
    assert by["int8"]["time_s"] == pytest.approx(2 * 0.2 + 18 * 0.05)
    # top-k never reaches it: its bound is all its steps, flagged as not reached.
    assert not by["topk"]["reached"] and by["topk"]["time_s"] == pytest.approx(2 * 0.2 + 38 * 0.01)
    assert by["auto"]["time_s"] == pytest.approx(20.0) and by["auto"]["step_ms"] == 5000
    # top-k's 0.78 s is a bound, not a time to target: int8 is the best static method.
    assert by["auto"]["best_static"] == "int8" and by["auto"]["vs_best_static"] == pytest.approx(
        20.0 / 1.3
    )
    assert by["int8"]["vs_none"] == pytest.approx(1.3 / 6.0)
    # The table names what auto ended on and how often it switched on the way.
    table = format_markdown([{**r, "task": "lm", "optimizer": "adamw"} for r in rows])
    assert "| 1gbit | auto (int8; 2 switches) |" in table and "| 1gbit | int8 |" in table


def test_the_vision_task_shows_crops_of_the_photographs_it_names() -> None:
    """A training batch: 16 x 16 crops (per-channel standardised), each a
    window, or its mirror image, of the photograph and grid region its label
    names; the CNN maps them to the 32 classes."""
    from sklearn.datasets import load_sample_images

    spec = build_task("vision", smoke=True)
    x, y = spec.batch(torch.Generator().manual_seed(0))
    assert x.shape == (32, 3, 16, 16) and int(y.max()) < 32
    assert spec.build()(x).shape == (32, 32)
    photos = torch.stack([torch.from_numpy(im.copy()) for im in load_sample_images().images])
    photos = photos.permute(0, 3, 1, 2).float().div_(255.0)
    photos = (photos - photos.mean((0, 2, 3), keepdim=True)) / photos.std((0, 2, 3), keepdim=True)
    h, w = photos.shape[2] // 4, photos.shape[3] // 4
    for crop, label in list(zip(x, y.tolist(), strict=True))[:4]:
        image, cell = divmod(label, 16)
        top, left = cell // 4 * h, cell % 4 * w
        region = photos[image, :, top : top + h, left : left + w]
        windows = region.unfold(1, 16, 1).unfold(2, 16, 1).permute(1, 2, 0, 3, 4)
        hits = [
            bool(((windows - c).abs().amax((-1, -2, -3)) < 1e-5).any())
            for c in (crop, crop.flip(-1))
        ]
        assert any(hits), f"crop of class {label} is not a window of its region"


def test_a_small_run_trains_every_method_and_writes_its_report(tmp_path: Path) -> None:
    """Loopback, tiny models: each method trained (its hook called), rows for each."""
    out = tmp_path / "tta"
    cmd = module_command(
        "xcomm_bench",
        "time-to-accuracy",
        "--smoke",
        "--tasks",
        "embedding",
        "--optimizers",
        "adamw",
        "--methods",
        "none,int8,auto",
        "--no-progress",
        "--out",
        str(out),
    )
    subprocess.run(cmd, check=True, env=python_env(), timeout=600)
    results = json.loads((out / "time_to_accuracy.json").read_text())
    case = results["cases"]["embedding/adamw"]
    # Uncompressed trained its 20 steps and set the target; int8 trained
    # until its smoothed loss reached it (or for at most 3 x 20 steps).
    none = case["trained"]["none"]["history"]
    assert none[0][0] == 0 and none[-1][0] == 20 and none[-1][1] < none[0][1]
    target = case["rows"][0]["target"]
    assert target == target_loss(none, 0.75, 3)
    int8 = case["trained"]["int8"]["history"]
    assert smoothed(int8, 3)[-1][1] <= target or int8[-1][0] == 60
    assert all(smoothed(int8, 3)[i][1] > target for i in range(len(int8) - 1))
    # int8's hook ran at every step (at least one bucket each); auto's too.
    trained_int8 = case["trained"]["int8"]
    assert trained_int8["hook_calls"] >= len(trained_int8["step_s"]) > 0
    auto = case["adaptive"]["loopback"]["auto"]
    assert auto["hook_calls"] >= len(auto["step_s"]) > 0 and auto["chosen"]
    rows = {r["method"]: r for r in case["rows"]}
    assert set(rows) == {"none", "int8", "auto"}
    assert rows["none"]["reached"] and rows["none"]["steps"] <= 20
    mean = {m: sum(t["step_s"]) / len(t["step_s"]) for m, t in case["timed"]["loopback"].items()}
    # int8's first 2 steps at uncompressed's step time, as its hook runs them.
    assert rows["int8"]["time_s"] == pytest.approx(
        rows["int8"]["steps"] * mean["int8"] + 2 * (mean["none"] - mean["int8"])
    )
    assert "| embedding | adamw | loopback | auto (" in (out / "time_to_accuracy.md").read_text()
    assert (out / "time_to_accuracy.png").stat().st_size > 0
