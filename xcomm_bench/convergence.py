"""Does accuracy hold? Every reduction trains the same model on the same data.

``python -m xcomm_bench convergence`` trains scikit-learn's digits with DDP on
2 local ranks over xcomm, once per reduction (uncompressed, each of xcomm's
hooks, compression inside the backend, and torch's own hooks for reference;
then FSDP2 with each of xcomm's reduce-scatters, compared with FSDP2 uncompressed;
then DiLoCo (local SGD, an outer step every 20 steps) compared with DDP),
with the same seed, batches and number of steps. It prints a table of final
test accuracy, its difference from the uncompressed run in percentage points,
and bytes on the wire per step; writes ``convergence.{json,md,png}`` (the
PNG: test accuracy against step for every reduction).

Example::

    python -m xcomm_bench convergence --steps 600 --out bench-results/convergence
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

from .launch import REPO, module_command, run_ranks

__all__ = ["RUNS", "Run", "main", "run_all"]


@dataclass(frozen=True)
class Run:
    """One reduction: an xcomm hook, a torch hook, or backend compression."""

    label: str
    compression: str = "none"
    hook: str = "none"
    backend_compression: str | None = None
    density: float = 0.05
    auto_link_gbit: float | None = None
    wrapper: str = "ddp"
    sync_every: int = 20
    fragments: int = 1
    overlap_steps: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.5


RUNS: list[Run] = [
    Run("uncompressed"),
    Run("xcomm fp16 hook", compression="fp16"),
    Run("xcomm bf16 hook", compression="bf16"),
    Run("xcomm int8 hook", compression="int8"),
    Run("xcomm top-k 5% hook", compression="topk"),
    Run("xcomm random-k 5% hook", compression="randomk"),
    Run("xcomm random-k 50% hook", compression="randomk", density=0.5),
    Run("xcomm PowerSGD r4 hook", compression="powersgd"),
    Run("xcomm auto hook (measured link)", compression="auto"),
    Run("xcomm auto hook (link fixed at 0.1 Gbit/s)", compression="auto", auto_link_gbit=0.1),
    Run("xcomm backend fp16", backend_compression="fp16"),
    Run("xcomm backend int8", backend_compression="int8"),
    Run("torch fp16_compress_hook", hook="fp16"),
    Run("torch powerSGD_hook r4", hook="powersgd"),
    Run("FSDP2 uncompressed", wrapper="fsdp2"),
    Run("FSDP2 bf16 reduce-scatter", compression="bf16", wrapper="fsdp2"),
    Run("FSDP2 int8 reduce-scatter", compression="int8", wrapper="fsdp2"),
    Run("DiLoCo H=20 fp32 outer step", wrapper="diloco"),
    Run("DiLoCo H=20 int8 outer step", compression="int8", wrapper="diloco"),
    Run(
        "Streaming DiLoCo H=20 4 fragments int8 overlap 2",
        compression="int8",
        wrapper="diloco",
        fragments=4,
        overlap_steps=2,
    ),
]


def _examples_digits() -> ModuleType:
    """The main job's training code, ``examples/digits.py``, loaded from its file.

    This benchmark trains exactly what ``examples/train_ddp.py`` trains, once
    per reduction; the code stays with the example, which runs without
    ``xcomm_bench``.
    """
    name = "xcomm_examples_digits"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "digits.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while defining
        spec.loader.exec_module(module)
    return sys.modules[name]


def _worker(run: Run, steps: int, out: str) -> int:
    """One rank (``env://`` variables set by :func:`~xcomm_bench.launch.run_ranks`)."""
    import xcomm

    digits = _examples_digits()
    torch.set_num_threads(1)
    opts = xcomm.Options(
        timeout=datetime.timedelta(seconds=120), compression=run.backend_compression
    )
    dist.init_process_group("xcomm", init_method="env://", pg_options=opts)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        cfg = digits.DigitsConfig(
            compression=run.compression,
            hook=run.hook,
            backend_compression=run.backend_compression,
            density=run.density,
            auto_link_gbit=run.auto_link_gbit,
            wrapper=run.wrapper,
            sync_every=run.sync_every,
            fragments=run.fragments,
            overlap_steps=run.overlap_steps,
            outer_lr=run.outer_lr,
            outer_momentum=run.outer_momentum,
            steps=steps,
            log_every=max(1, steps // 20),
            log=lambda _line: None,
        )
        result = digits.train_digits(rank, world, cfg)
        if rank == 0:
            Path(out).write_text(json.dumps(asdict(result)))
    finally:
        dist.destroy_process_group()
    return 0


def run_one(run: Run, steps: int, world: int = 2) -> dict:
    """Trains once with ``run``'s reduction; returns rank 0's DigitsResult as a dict."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = ["--worker", out, "--run", json.dumps(asdict(run)), "--steps", str(steps)]
        rc = run_ranks(module_command("xcomm_bench.convergence", *argv), world, timeout=1800)
        if rc != 0:
            raise RuntimeError(f"convergence run {run.label!r}: ranks failed (exit status {rc})")
        return json.loads(Path(out).read_text())


def run_all(runs: list[Run], steps: int, progress: bool = True) -> list[dict]:
    """Every run in turn, with a progress bar; rows for :func:`format_markdown`."""
    from tqdm import tqdm

    rows = []
    for run in tqdm(runs, desc="convergence", disable=not progress, unit="run"):
        rows.append({"run": asdict(run), **run_one(run, steps)})
    return rows


def format_markdown(rows: list[dict], steps: int) -> str:
    # Each wrapper's first run is its base; DiLoCo's is DDP's (same samples, fewer syncs).
    bases = {r["run"].get("wrapper", "ddp"): r for r in reversed(rows)}
    if "ddp" in bases:
        bases["diloco"] = bases["ddp"]
    lines = [
        (
            f"| reduction | final test accuracy ({steps} steps) | vs uncompressed | "
            "wire KiB/step/rank | bytes ratio | time/step ms |"
        ),
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = bases[r["run"].get("wrapper", "ddp")]
        delta = 100 * (r["final_accuracy"] - base["final_accuracy"])
        ratio = base["wire_bytes_per_step"] / max(r["wire_bytes_per_step"], 1e-9)
        wire, ratio_text = f"{r['wire_bytes_per_step'] / 1024:.1f}", f"{ratio:.1f}x"
        if r["run"]["hook"] != "none":  # torch's hooks keep no byte count
            wire, ratio_text = "not counted", "-"
        label = r["run"]["label"] + (f" (chose {r['chosen']})" if r.get("chosen") else "")
        lines.append(
            f"| {label} | {100 * r['final_accuracy']:.2f}% | {delta:+.2f} pp | "
            f"{wire} | {ratio_text} | {r['mean_step_ms']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for r in rows:
        steps = [h[0] for h in r["history"]]
        acc = [100 * h[2] for h in r["history"]]
        style = "-" if r["run"]["label"] == "uncompressed" else "--"
        ax.plot(steps, acc, style, label=r["run"]["label"], linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(80, 100)
    ax.set_title("digits, DDP on 2 ranks over xcomm: accuracy per reduction")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xcomm_bench convergence", description=__doc__)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", default="bench-results/convergence")
    p.add_argument("--only", default=None, help="comma-separated labels to run (default: all)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # rank 0's result file
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # the worker's Run, JSON
    args = p.parse_args(argv)
    if args.worker is not None:
        return _worker(Run(**json.loads(args.run)), args.steps, args.worker)
    runs = RUNS if not args.only else [r for r in RUNS if r.label in args.only.split(",")]
    rows = run_all(runs, args.steps, progress=not args.no_progress)
    table = format_markdown(rows, args.steps)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.json").write_text(json.dumps(rows, indent=1))
    (out / "convergence.md").write_text(table + "\n")
    plot(rows, out / "convergence.png")
    print(f"wrote {out}/convergence.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
