"""DiLoCo against DDP: the same samples, accuracy, bytes and wall-clock time.

Two emulated nodes (one rank each, ``--rates`` in turn) train scikit-learn's
digits (``examples/digits.py``) once per configuration, in one launch per
rate, configurations back to back (``--repeats`` rounds, the median kept):

* ``ddp``: DDP, a float32 allreduce every step (the baseline);
* ``ddp-int8``: DDP with xcomm's int8 hook (compression every step);
* ``diloco``: local SGD, an outer step every ``--sync-every`` steps, float32;
* ``diloco-int8``: the same, int8 pseudo-gradients with error feedback;
* ``streaming-int8``: Streaming DiLoCo, 4 fragments, each exchange
  overlapping 2 inner steps.

Every run sees the same global batches (each rank half of each), so bytes per
sample compare like with like. Reported: final test accuracy, wall-clock
seconds to the trained model and its speed-up over ``ddp``, the bytes the
node's NIC sent per sample, and the reduction's own link bytes per sample and
their ratio to ``ddp``'s. Writes ``diloco.json``, ``diloco.md``, ``diloco.png``.

Example (root)::

    python -m xcomm_bench diloco --rates 0.1gbit,1gbit,10gbit --steps 600
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .convergence import _examples_digits
from .internode import _tx_bytes as internode_tx_bytes
from .launch import module_command, run_ranks

#: label -> DigitsConfig fields.
CONFIGS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "ddp-int8": {"compression": "int8"},
    "diloco": {"wrapper": "diloco"},
    "diloco-int8": {"wrapper": "diloco", "compression": "int8"},
    "streaming-int8": {
        "wrapper": "diloco",
        "compression": "int8",
        "fragments": 4,
        "overlap_steps": 2,
    },
}


def _tx_bytes() -> int:
    return internode_tx_bytes(os.environ.get("GLOO_SOCKET_IFNAME", "lo"))


def rank_main(args: argparse.Namespace) -> int:
    """One rank: every configuration in turn, ``repeats`` rounds; rank 0 writes the result."""
    import xcomm  # noqa: F401 - registers the backend

    digits = _examples_digits()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("xcomm", timeout=datetime.timedelta(seconds=600))
    try:
        labels = args.configs.split(",")
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
        for round_ in range(args.repeats):
            for label in labels:
                cfg = digits.DigitsConfig(
                    **CONFIGS[label],
                    sync_every=args.sync_every,
                    steps=args.steps,
                    log=lambda _line: None,
                )
                dist.barrier()
                sent0 = _tx_bytes()
                result = digits.train_digits(rank, world, cfg)
                sent = _tx_bytes() - sent0
                took = torch.tensor([result.train_seconds], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slower rank's time
                samples = args.steps * cfg.batch_size
                runs[label].append(
                    {
                        "seconds": float(took),
                        "accuracy": result.final_accuracy,
                        "nic_bytes_per_sample": sent / samples,
                        "link_bytes_per_sample": result.wire_bytes_per_step / cfg.batch_size,
                    }
                )
                if rank == 0:
                    print(
                        f"diloco: round {round_ + 1}/{args.repeats} {label}: "
                        f"{float(took):.2f} s, accuracy {result.final_accuracy:.4f}",
                        flush=True,
                    )
        if rank == 0:
            result_rows = {}
            for label, rows in runs.items():
                result_rows[label] = {
                    "seconds": statistics.median(r["seconds"] for r in rows),
                    "seconds_all": [r["seconds"] for r in rows],
                    "accuracy": rows[-1]["accuracy"],
                    "nic_bytes_per_sample": statistics.median(
                        r["nic_bytes_per_sample"] for r in rows
                    ),
                    "link_bytes_per_sample": rows[-1]["link_bytes_per_sample"],
                }
            Path(args.worker_out).write_text(json.dumps(result_rows))
        return 0
    finally:
        dist.destroy_process_group()


def table(result: dict[str, Any]) -> str:
    """Markdown: per rate and configuration, accuracy, time and bytes, ratios to ddp."""
    lines = [
        (
            f"digits, {result['steps']} steps of {result['batch_size']} samples, "
            f"2 emulated nodes x 1 rank, DiLoCo H = {result['sync_every']}, "
            f"median of {result['repeats']} run(s)"
        ),
        "",
        (
            "| link | run | test accuracy | vs ddp | wall-clock (s) | speed-up vs ddp | "
            "NIC bytes/sample | link bytes/sample | fewer bytes than ddp |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rate, rows in result["rates"].items():
        base = rows.get("ddp")
        for label, r in rows.items():
            speed = f"{base['seconds'] / r['seconds']:.2f}x" if base else "-"
            fewer = (
                f"{base['link_bytes_per_sample'] / r['link_bytes_per_sample']:.1f}x"
                if base and r["link_bytes_per_sample"]
                else "-"
            )
            delta = f"{100 * (r['accuracy'] - base['accuracy']):+.2f} pp" if base else "-"
            lines.append(
                f"| {rate} | {label} | {100 * r['accuracy']:.2f}% | {delta} | "
                f"{r['seconds']:.2f} | {speed} | {r['nic_bytes_per_sample']:.0f} | "
                f"{r['link_bytes_per_sample']:.0f} | {fewer} |"
            )
    return "\n".join(lines) + "\n"


def plot(path: Path, result: dict[str, Any]) -> Path:
    """Wall-clock time per configuration at each rate (log scale), speed-up over ddp."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(result["rates"])
    labels = list(next(iter(result["rates"].values())))
    fig, ax = plt.subplots(figsize=(7.0, 3.8))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        secs = [result["rates"][r][label]["seconds"] for r in rates]
        bars = ax.bar([k + i * width for k in range(len(rates))], secs, width, label=label)
        for bar, r in zip(bars, rates, strict=True):
            base = result["rates"][r].get("ddp", {}).get("seconds")
            if base and label != "ddp":
                ax.annotate(
                    f"{base / result['rates'][r][label]['seconds']:.1f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize="x-small",
                )
    ax.set_xticks([k + width * (len(labels) - 1) / 2 for k in range(len(rates))], rates)
    ax.set_yscale("log")
    ax.set_ylabel(f"seconds for {result['steps']} steps (log)")
    ax.set_title("digits on 2 emulated nodes: DiLoCo vs DDP, same samples", fontsize="medium")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batch_size = _examples_digits().DigitsConfig().batch_size
    result: dict[str, Any] = {
        "steps": args.steps,
        "batch_size": batch_size,
        "sync_every": args.sync_every,
        "repeats": args.repeats,
        "rates": {},
    }
    for rate in tqdm(args.rates.split(","), desc="diloco", unit="rate"):
        worker_out = out / f"rank0-{rate}.json"
        cmd = module_command("xcomm_bench", "diloco", *argv, "--worker", str(worker_out))
        nodes = 0 if rate == "loopback" else 2
        code = run_ranks(
            cmd, 2, nodes=nodes, rate=None if nodes == 0 else rate, timeout=args.timeout
        )
        if code != 0:
            print(f"diloco: ranks failed at {rate} (exit {code})", file=sys.stderr)
            return code
        result["rates"][rate] = json.loads(worker_out.read_text())
        worker_out.unlink()
        (out / "diloco.json").write_text(json.dumps(result, indent=1))  # kept if a later rate fails
    (out / "diloco.md").write_text(table(result))
    plot(out / "diloco.png", result)
    print(table(result))
    print(f"wrote {out}/diloco.json, diloco.md, diloco.png", flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m xcomm_bench diloco", description=__doc__.split("\n")[0]
    )
    p.add_argument("--rates", default="0.1gbit,1gbit,10gbit", help="'loopback' runs unshaped")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default="bench-results/diloco")
    p.add_argument("--worker", default=None, dest="worker_out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        print(f"diloco: unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")
        return 2
    if args.worker_out:
        return rank_main(args)
    return launch(args, argv)


__all__ = ["CONFIGS", "main", "plot", "table"]
