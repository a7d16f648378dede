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
    crossing_step,
    format_markdown,
    main,
    smoothed,
    steps_to_target,
    target_loss,
)


def _run(history: list[tuple[int, float]], step_s: list[float], **extra: object) -> dict:
    return {"history": history, "step_s": step_s, "hook_calls": 1, **extra}


def test_time_to_target_is_steps_to_the_target_times_the_rates_step_time() -> None:
    none = [(0, 5.0), (10, 4.0), (20, 3.0), (30, 2.5), (40, 2.6)]
    slow_learner = [(0, 5.0), (10, 4.5), (20, 4.0), (30, 3.5), (40, 3.2)]
    fast_learner = [(0, 5.0), (10, 3.0), (20, 2.0), (30, 1.9), (40, 1.8)]
    # The target is none's best so far nearest 3/4 of its run: 2.5 at step 30.
    assert target_loss(none, 0.75) == 2.5
    assert steps_to_target(none, 2.5) == 30 and crossing_step(none, 2.5) == 30
    # The fast learner's first evaluation under 2.5 is at step 20; its curve
    # crosses 2.5 half way from step 10 (3.0) to step 20 (2.0).
    assert steps_to_target(fast_learner, 2.5) == 20 and crossing_step(fast_learner, 2.5) == 15
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
    # auto at 1 Gbit/s crosses the target at step 15; its first 20 steps took 1 s each.
    auto = _run(fast_learner, [1.0] * 20 + [9.0] * 20, chosen="int8", switches=2)
    rows = combine(trained, timed, {"1gbit": {"auto": auto}}, 0.75, 40)
    by = {r["method"]: r for r in rows}
    assert by["none"]["time_s"] == pytest.approx(30 * 0.2)
    # int8's hook reduces its first 2 steps uncompressed: 2 x 0.2 s, then 13 x 0.05 s.
    assert by["int8"]["steps"] == 15 and by["int8"]["step_ms"] == pytest.approx(50)
    assert by["int8"]["time_s"] == pytest.approx(2 * 0.2 + 13 * 0.05)
    # top-k never reaches it: its bound is all its steps, flagged as not reached.
    assert not by["topk"]["reached"] and by["topk"]["time_s"] == pytest.approx(2 * 0.2 + 38 * 0.01)
    # Its step time is that of its steps to the crossing (1 s), so that
    # steps x step time is its time to target.
    assert by["auto"]["time_s"] == pytest.approx(15.0) and by["auto"]["step_ms"] == 1000
    # top-k's 0.78 s is a bound, not a time to target: int8 is the best static method.
    assert by["auto"]["best_static"] == "int8" and by["auto"]["vs_best_static"] == pytest.approx(
        15.0 / 1.05
    )
    assert by["int8"]["vs_none"] == pytest.approx(1.05 / 6.0)
    # The table names what auto ended on and how often it switched on the way.
    table = format_markdown([{**r, "task": "lm", "optimizer": "adamw"} for r in rows])
    assert "| 1gbit | auto (int8; 2 switches) |" in table and "| 1gbit | int8 |" in table


def test_with_rounds_a_row_is_the_median_round_and_shows_the_fastest_and_slowest() -> None:
    """Three rounds per method: the row is the round with the median time to
    target (its steps, step time and choice together), the spread beside it."""
    none = [(0, 5.0), (10, 4.0), (20, 3.0), (30, 2.5), (40, 2.6)]
    learner = [(0, 5.0), (10, 3.0), (20, 2.0), (30, 1.9), (40, 1.8)]
    trained = {"none": _run(none, []), "bf16": _run(learner, [])}
    timed = {
        "1gbit": {
            "none": [_run([], [0.2]), _run([], [0.1, 0.1]), _run([], [0.4])],
            "bf16": [_run([], [0.06]), _run([], [0.05]), _run([], [0.03, 0.05])],
        }
    }
    # auto's rounds cross the target at step 15, at step 20 + 2/7 of 10 (a
    # slower learner that round) and at step 15: 17.62 steps on average, at
    # each round's own seconds per step: 0.05, 0.05 and 0.02 s.
    late = [(0, 5.0), (10, 3.0), (20, 2.7), (30, 2.0)]
    autos = [
        _run(learner, [0.05] * 40, chosen="bf16"),
        _run(late, [0.05] * 40, chosen="int8"),
        _run(learner, [0.02] * 40, chosen="bf16"),
    ]
    rows = combine(trained, timed, {"1gbit": {"auto": autos}}, 0.75, 40, window=1)
    by = {r["method"]: r for r in rows}
    # none: 30 steps at 0.2, 0.1 and 0.4 s: the median round is 0.2 s.
    assert by["none"]["time_s"] == pytest.approx(6.0) and by["none"]["step_ms"] == pytest.approx(
        200
    )
    assert (by["none"]["time_min_s"], by["none"]["time_max_s"]) == pytest.approx((3.0, 12.0))
    assert by["none"]["rounds"] == 3
    # bf16 crosses the target at step 15 (no uncompressed first steps): 0.9, 0.75, 0.6 s.
    assert by["bf16"]["time_s"] == pytest.approx(0.75)
    assert by["bf16"]["step_ms"] == pytest.approx(50)
    assert (by["bf16"]["time_min_s"], by["bf16"]["time_max_s"]) == pytest.approx((0.6, 0.9))
    # auto: 17.62 x (0.05, 0.05, 0.02) s; the median round is the first (of
    # the two equal, the earlier), with its step time and choice.
    steps = (15 + 20 + 20 / 7 + 15) / 3
    a = by["auto"]
    assert a["steps"] == pytest.approx(steps) and a["chosen"] == "bf16"
    assert a["time_s"] == pytest.approx(steps * 0.05) and a["step_ms"] == pytest.approx(50)
    assert (a["time_min_s"], a["time_max_s"]) == pytest.approx((steps * 0.02, steps * 0.05))
    assert a["chosen_by_round"] == ["bf16", "int8", "bf16"]
    assert a["vs_best_static"] == pytest.approx(steps * 0.05 / 0.75) and a["best_static"] == "bf16"
    table = format_markdown([{**r, "task": "lm", "optimizer": "adamw"} for r in rows])
    assert "| 1gbit | none | 30 | 200.0 | 6.00 | 3: 3.00-12.00 | 1.00 |" in table


def test_with_seeds_a_static_methods_steps_are_the_mean_over_its_seeds() -> None:
    """Two seeds: a method's steps to target are the mean of its seeds'
    crossings (one seed's trajectory is partly chance); a seed that never
    crosses counts as the bound and marks the row as not reached."""
    none = [(0, 5.0), (10, 4.0), (20, 3.0), (30, 2.5), (40, 2.6)]
    seed0 = [(0, 5.0), (10, 3.0), (20, 2.0)]  # crosses 2.5 at step 15
    seed1 = [(0, 5.0), (10, 4.0), (20, 3.0), (30, 2.0)]  # at step 25
    never = [(0, 5.0), (10, 4.0), (20, 3.0)]
    trained = {
        "none": [_run(none, []), _run(seed1, [])],
        "bf16": [_run(seed0, []), _run(seed1, [])],
        "int8": [_run(seed0, []), _run(never, [])],
    }
    timed = {"1gbit": {m: [_run([], [0.1])] for m in ("none", "bf16", "int8")}}
    rows = combine(trained, timed, {}, 0.75, 40)
    by = {r["method"]: r for r in rows}
    # The target comes from seed 0's uncompressed run: 2.5 at step 30.
    assert by["none"]["target"] == 2.5 and by["none"]["steps"] == pytest.approx((30 + 25) / 2)
    assert by["bf16"]["steps"] == pytest.approx(20) and by["bf16"]["seeds"] == 2
    assert by["bf16"]["time_s"] == pytest.approx(20 * 0.1) and by["bf16"]["reached"]
    assert by["int8"]["steps"] == pytest.approx((15 + 40) / 2) and not by["int8"]["reached"]
    assert by["none"]["best_static"] == "bf16"


def test_rounds_below_one_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--rounds must be at least 1, got 0"):
        main(["--rounds", "0", "--no-progress", "--out", str(tmp_path / "tta")])
    assert not (tmp_path / "tta").exists()  # refused before any run


def test_seeds_below_one_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--seeds must be at least 1, got 0"):
        main(["--seeds", "0", "--no-progress", "--out", str(tmp_path / "tta")])
    assert not (tmp_path / "tta").exists()  # refused before any run


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


def test_a_small_run_trains_in_rounds_and_writes_its_report(tmp_path: Path) -> None:
    """Loopback, tiny models, two rounds and two seeds (``--smoke``):
    uncompressed trained once per seed and timed twice, auto trained twice,
    once per seed (its hook called), a row each. (Six process pairs: the
    static methods' arithmetic is tested above.)"""
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
        "none,auto",
        "--seeds",
        "2",
        "--no-progress",
        "--out",
        str(out),
    )
    subprocess.run(cmd, check=True, env=python_env(), timeout=600)
    results = json.loads((out / "time_to_accuracy.json").read_text())
    case = results["cases"]["embedding/adamw"]
    # Uncompressed trained its 20 steps and set the target; auto trained
    # until its smoothed loss reached it (or for at most 3 x 20 steps).
    nones = case["trained"]["none"]
    assert [run["seed"] for run in nones] == [0, 1]
    none = nones[0]["history"]
    assert none[0][0] == 0 and none[-1][0] == 20 and none[-1][1] < none[0][1]
    # Another seed, another trajectory: seed 1 trained to seed 0's target.
    assert nones[1]["history"] != none[: len(nones[1]["history"])]
    target = case["rows"][0]["target"]
    assert target == target_loss(none, 0.75, 3)
    autos = case["adaptive"]["loopback"]["auto"]
    assert [auto["seed"] for auto in autos] == [0, 1]
    for auto in autos:
        curve = smoothed(auto["history"], 3)
        assert curve[-1][1] <= target or curve[-1][0] == 60
        assert all(loss > target for _, loss in curve[:-1])
        # Its hook ran at every step (at least one bucket each).
        assert auto["hook_calls"] >= len(auto["step_s"]) > 0 and auto["chosen"]
    rows = {r["method"]: r for r in case["rows"]}
    assert set(rows) == {"none", "auto"}
    assert rows["none"]["reached"] and rows["none"]["seeds"] == 2
    crossings = [crossing_step(run["history"], target, 3) for run in nones]
    assert rows["none"]["steps"] == pytest.approx(sum(crossings) / 2)
    assert rows["none"]["rounds"] == rows["auto"]["rounds"] == 2
    assert len(rows["auto"]["chosen_by_round"]) == 2
    # Two timings of uncompressed, in separate process pairs; with two
    # rounds a row is the faster one's.
    timed = case["timed"]["loopback"]["none"]
    means = [sum(t["step_s"]) / len(t["step_s"]) for t in timed]
    assert len(means) == 2 and rows["none"]["step_ms"] == pytest.approx(1e3 * min(means))
    assert rows["none"]["time_s"] == pytest.approx(rows["none"]["steps"] * min(means))
    # Each round's seconds per step up to its interpolated crossing (a
    # fraction of the next step), times the rounds' mean steps to target.
    reached = [crossing_step(a["history"], target, 3) or 60 for a in autos]
    per_step = []
    for a, n in zip(autos, reached, strict=True):
        whole = int(n)
        rest = (n - whole) * a["step_s"][whole] if whole < len(a["step_s"]) else 0.0
        per_step.append((sum(a["step_s"][:whole]) + rest) / n)
    mean_steps = sum(reached) / 2
    assert rows["auto"]["steps"] == pytest.approx(mean_steps)
    assert rows["auto"]["time_s"] == pytest.approx(mean_steps * min(per_step))
    assert "| embedding | adamw | loopback | auto (" in (out / "time_to_accuracy.md").read_text()
    assert (out / "time_to_accuracy.png").stat().st_size > 0
