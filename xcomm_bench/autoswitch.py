"""auto on a link that changes mid-run: does it switch, and how fast?

Two emulated nodes (one rank each) train a model with DDP and
``xcomm.hooks.auto_hook``. The link starts at ``--rate-from``; once rank 0
reports step ``--change-at``, this process changes both nodes' tbf rate to
``--rate-to`` (``tc qdisc replace``), and later (``--change-back-at``) back.
Every step records its wall time, the method of each bucket and the link
bandwidth auto agreed on. Writes ``autoswitch.json``, ``autoswitch.png``
(step time and method against step, the rate changes marked) and the merged
timeline ``timeline.json`` (auto's decisions are spans on "xcomm auto").

Example (root)::

    python -m xcomm_bench autoswitch --model transformer --rate-from 10gbit \\
        --rate-to 100mbit --steps 40 --change-at 12 --change-back-at 28
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .launch import module_command, python_env

_METHOD_Y = {"none": 0, "fp16": 1, "bf16": 1, "int8": 2, "topk": 3, "powersgd": 4}


def rank_main(args: argparse.Namespace) -> int:
    """One rank: DDP with auto, a record per step (rank 0 writes the file)."""
    import xcomm
    from xcomm import hooks

    from .ddp import build_model

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=600)
    dist.init_process_group("xcomm", rank=rank, world_size=world, timeout=timeout)
    out = Path(args.out)
    try:
        spec = build_model(args.model)
        torch.manual_seed(1234)
        model = torch.nn.parallel.DistributedDataParallel(spec.build(), bucket_cap_mb=25)
        state = hooks.AutoState(interval=args.interval, model=model)
        model.register_comm_hook(state, hooks.auto_hook)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        loss_fn = torch.nn.CrossEntropyLoss()
        gen = torch.Generator().manual_seed(100 + rank)
        xcomm.enable_timeline()
        records = []
        for step in range(args.steps):
            x, y = spec.batch(gen)
            due = state.next_round
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            took = time.perf_counter() - t0
            measured = state.next_round > due  # this step ran a measuring round
            seconds = torch.tensor([took], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slower rank's step
            link = state.link_estimate
            records.append(
                {
                    "step": step,
                    "ms": float(seconds) * 1e3,
                    "methods": state.methods_by_bucket(),
                    "gbit": None if link is None else link.bandwidth_bytes_per_s * 8 / 1e9,
                    "round": measured,
                }
            )
            if rank == 0:
                (out / "progress").write_text(str(step + 1))
        xcomm.save_timeline(out / f"timeline-rank{rank}.json", pid=rank)
        if rank == 0:
            (out / "ranks.json").write_text(
                json.dumps({"records": records, "explain": state.explain()}, indent=1)
            )
        return 0
    finally:
        dist.destroy_process_group()


def plot(path: Path, result: dict[str, Any]) -> Path:
    """Step time and each bucket's method against step; rate changes marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result["records"]
    steps = [r["step"] for r in recs]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7.0, 4.6), sharex=True)
    ax1.plot(steps, [r["ms"] for r in recs], marker="o", ms=3)
    rounds = [r for r in recs if r.get("round")]
    ax1.plot(
        [r["step"] for r in rounds],
        [r["ms"] for r in rounds],
        "x",
        color="black",
        ms=6,
        label="measuring round",
    )
    ax1.legend(fontsize="x-small", loc="upper left")
    ax1.set_yscale("log")
    ax1.set_ylabel("step time (ms)")
    for b in range(max(len(r["methods"]) for r in recs)):
        pts = [(r["step"], _METHOD_Y[r["methods"][b]]) for r in recs if len(r["methods"]) > b]
        ax2.plot([p[0] for p in pts], [p[1] + 0.08 * b for p in pts], ".", label=f"bucket {b}")
    ax2.set_yticks(range(5), ["none", "fp16/bf16", "int8", "top-k", "PowerSGD"])
    ax2.set_xlabel("step")
    for change in result["changes"]:
        for ax in (ax1, ax2):
            ax.axvline(change["step"], color="red", lw=0.8, ls="--")
        ax1.annotate(
            f"-> {change['rate']}",
            (change["step"], ax1.get_ylim()[1]),
            fontsize="x-small",
            va="top",
        )
    ax1.set_title(f"auto on {result['model']}: link rate changed mid-run", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    from xcomm.trace import merge_traces

    from .cluster import EmulatedCluster

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "progress").write_text("0")
    cmd = module_command("xcomm_bench", "autoswitch", "--worker", *argv)
    env = python_env(dict(os.environ))
    changes: list[dict[str, Any]] = []
    plan = [(args.change_at, args.rate_to)]
    if args.change_back_at is not None:
        plan.append((args.change_back_at, args.rate_from))
    with EmulatedCluster(2, 1, args.rate_from) as cluster:
        results: list[Any] = []
        runner = threading.Thread(
            target=lambda: results.extend(cluster.run(cmd, env=env, timeout=args.timeout))
        )
        runner.start()
        for at, rate in plan:
            while runner.is_alive() and int((out / "progress").read_text() or 0) < at:
                time.sleep(0.05)
            if not runner.is_alive():
                break
            done = int((out / "progress").read_text() or 0)
            cluster.set_rate(rate)
            changes.append({"step": done, "rate": rate})
            print(f"autoswitch: link -> {rate} after step {done}", flush=True)
        runner.join()
    bad = [r.returncode for r in results if r.returncode != 0]
    if bad or not results:
        print(f"autoswitch: ranks failed ({bad})", file=sys.stderr)
        return bad[0] if bad else 1
    ranks = json.loads((out / "ranks.json").read_text())
    result = {
        "model": args.model,
        "rate_from": args.rate_from,
        "rate_to": args.rate_to,
        "interval": args.interval,
        "changes": changes,
        **ranks,
    }
    (out / "autoswitch.json").write_text(json.dumps(result, indent=1))
    merge_traces([out / f"timeline-rank{r}.json" for r in range(2)], out / "timeline.json")
    plot(out / "autoswitch.png", result)
    for r in result["records"]:
        gbit = "-" if r["gbit"] is None else f"{r['gbit']:.3f}"
        mark = "  round" if r.get("round") else ""
        print(
            f"step {r['step']:3d}  {r['ms']:9.1f} ms  link {gbit:>7} Gbit/s  {r['methods']}{mark}"
        )
    print(f"wrote {out}/autoswitch.json, autoswitch.png, timeline.json", flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m xcomm_bench autoswitch", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="transformer", help="mlp, cnn or transformer")
    p.add_argument("--rate-from", default="10gbit")
    p.add_argument("--rate-to", default="100mbit")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--change-at", type=int, default=12, help="change the rate after this step")
    p.add_argument("--change-back-at", type=int, default=None, help="and back after this one")
    p.add_argument("--interval", type=int, default=5, help="auto's re-evaluation interval")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--out", default="bench-results/autoswitch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.worker:
        return rank_main(args)
    return launch(args, argv)
