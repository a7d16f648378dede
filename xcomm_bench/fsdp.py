"""FSDP2 step time and bytes with and without a compressed reduce-scatter.

Two emulated nodes (one rank each, ``--rates`` in turn) train a model wrapped
with ``fully_shard`` (every child with parameters, then the root). Each rank
builds one copy of the model per method (``none``: FSDP2's own reduce-scatter
on xcomm, ``bf16``, ``int8`` with error feedback, ``auto``, see
:mod:`xcomm.hooks.fsdp`; ``backend-bf16`` / ``backend-int8``: no hook, FSDP2 on
a group made with ``xcomm.Options(compression=...)``, which compresses the
reduce-scatter; ``gloo``: FSDP2 on a plain Gloo group, what it gets without
xcomm) and runs
their steps interleaved, so every method sees the same machine and link
moment. A step's time is the slower rank's; bytes are what the node's NIC
sent (all-gathers of parameters included, which compression leaves alone)
and the reduce-scatter's own link bytes.

Writes ``fsdp.json``, ``fsdp.md`` (a table, ratios to ``none``) and
``fsdp.png``.

Example (root)::

    python -m xcomm_bench fsdp --model mlp --rates 0.1gbit,1gbit,10gbit --steps 6
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .internode import _tx_bytes as internode_tx_bytes
from .launch import module_command, run_ranks

METHODS = ("gloo", "none", "bf16", "int8", "auto")


def _tx_bytes() -> int:
    """Bytes this node's NIC sent so far (the interface Gloo uses)."""
    return internode_tx_bytes(os.environ.get("GLOO_SOCKET_IFNAME", "lo"))


class _BackendCounts:
    """The reduce-scatter bytes of a group compressing in the backend, read
    from its ``compression_stats`` (the hook states' ``stats`` interface)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._backend = group._get_backend(torch.device("cpu"))
        self._base = 0

    def reset(self) -> None:
        self._base = self._backend.compression_stats["link_bytes_sent"]

    @property
    def link_bytes_sent(self) -> int:
        return self._backend.compression_stats["link_bytes_sent"] - self._base

    @property
    def stats(self) -> _BackendCounts:
        return self


class _NoCounts:
    """A plain Gloo group counts nothing: its reduce-scatter bytes are unknown."""

    def reset(self) -> None:
        pass

    link_bytes_sent = None

    @property
    def stats(self) -> _NoCounts:
        return self


def _sharded(spec: Any, method: str, min_bytes: int) -> tuple[torch.nn.Module, Any]:
    """The model under ``fully_shard``: with the hook's ``method``, or, for
    ``backend-<codec>``, on a group whose backend compresses reduce-scatters."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import xcomm
    from xcomm.hooks import compress_reduce_scatter

    mesh, group = None, None
    if method == "gloo":
        group = dist.new_group(backend="gloo")
        mesh = DeviceMesh.from_group(group, device_type="cpu")
    elif method.startswith("backend-"):
        options = xcomm.Options(
            compression=method.removeprefix("backend-"), compression_min_bytes=min_bytes
        )
        group = dist.new_group(backend="xcomm", pg_options=options)
        mesh = DeviceMesh.from_group(group, device_type="cpu")
    torch.manual_seed(1234)
    model = spec.build()
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if method == "gloo":
        return model, _NoCounts()
    if group is not None:
        return model, _BackendCounts(group)
    return model, compress_reduce_scatter(model, method, min_bytes=min_bytes)


def rank_main(args: argparse.Namespace) -> int:
    """One rank: every method's model, steps interleaved; rank 0 writes the result."""
    import xcomm  # noqa: F401 - registers the backend

    from .ddp import build_model

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("xcomm", timeout=datetime.timedelta(seconds=900))
    try:
        spec = build_model(args.model, smoke=args.smoke)
        runs = {}
        for m in args.methods.split(","):
            model, state = _sharded(spec, m, args.min_bytes)
            runs[m] = (model, state, torch.optim.SGD(model.parameters(), lr=1e-3))
        loss_fn = torch.nn.CrossEntropyLoss()
        gen = torch.Generator().manual_seed(100 + rank)
        times: dict[str, list[float]] = {m: [] for m in runs}
        nic: dict[str, int] = dict.fromkeys(runs, 0)
        for step in range(args.warmup + args.steps):
            x, y = spec.batch(gen)
            for m, (model, state, opt) in runs.items():
                dist.barrier()
                if step == args.warmup:
                    state.stats.reset()
                sent0, t0 = _tx_bytes(), time.perf_counter()
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                sent = _tx_bytes() - sent0
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slower rank's step
                if step >= args.warmup:
                    times[m].append(float(took))
                    nic[m] += sent
            if rank == 0:
                print(f"fsdp: step {step + 1}/{args.warmup + args.steps}", flush=True)
        if rank == 0:
            result = {
                m: {
                    "ms": statistics.median(times[m]) * 1e3,
                    "ms_all": [t * 1e3 for t in times[m]],
                    "nic_mb_per_step": nic[m] / args.steps / 1e6,
                    "rs_mb_per_step": None
                    if (sent := runs[m][1].stats.link_bytes_sent) is None
                    else sent / args.steps / 1e6,
                }
                for m in runs
            }
            if "auto" in runs:
                result["auto"]["methods"] = sorted(
                    {d["method"] for d in runs["auto"][1].decisions.values()}
                )
            Path(args.worker_out).write_text(json.dumps(result))
        return 0
    finally:
        dist.destroy_process_group()


def table(result: dict[str, Any]) -> str:
    """Markdown: per rate and method the median step, NIC and reduce-scatter MB, ratios to none."""
    lines = [
        (
            f"FSDP2, model `{result['model']}`, 2 emulated nodes x 1 rank, "
            f"median of {result['steps']} steps after {result['warmup']} warm-up"
        ),
        "",
        "| link | method | step (ms) | speed-up vs none | NIC MB/step | reduce-scatter MB/step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for rate, rows in result["rates"].items():
        base = rows["none"]["ms"] if "none" in rows else None
        for m, r in rows.items():
            ratio = f"{base / r['ms']:.2f}x" if base else "-"
            rs = "-" if r["rs_mb_per_step"] is None else f"{r['rs_mb_per_step']:.1f}"
            name = f"auto ({', '.join(r['methods'])})" if "methods" in r else m
            lines.append(
                f"| {rate} | {name} | {r['ms']:.0f} | {ratio} | {r['nic_mb_per_step']:.1f} | {rs} |"
            )
    return "\n".join(lines) + "\n"


def plot(path: Path, result: dict[str, Any]) -> Path:
    """Step time per method at each rate, and the speed-up over none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(result["rates"])
    methods = list(next(iter(result["rates"].values())))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ms = [result["rates"][r][m]["ms"] for r in rates]
        bars = ax.bar([k + i * width for k in range(len(rates))], ms, width, label=m)
        for bar, r in zip(bars, rates, strict=True):
            base = result["rates"][r].get("none", {}).get("ms")
            if base and m != "none":
                ax.annotate(
                    f"{base / result['rates'][r][m]['ms']:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize="x-small",
                )
    ax.set_xticks([k + width * (len(methods) - 1) / 2 for k in range(len(rates))], rates)
    ax.set_yscale("log")
    ax.set_ylabel("FSDP2 step time (ms, log)")
    ax.set_title(f"FSDP2 {result['model']}: compressed reduce-scatter", fontsize="medium")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "model": args.model,
        "steps": args.steps,
        "warmup": args.warmup,
        "rates": {},
    }
    rates = args.rates.split(",")
    for rate in tqdm(rates, desc="fsdp", unit="rate"):
        worker_out = out / f"rank0-{rate}.json"
        cmd = module_command("xcomm_bench", "fsdp", *argv, "--worker", str(worker_out))
        nodes = 0 if rate == "loopback" else 2
        code = run_ranks(
            cmd, 2, nodes=nodes, rate=None if nodes == 0 else rate, timeout=args.timeout
        )
        if code != 0:
            print(f"fsdp: ranks failed at {rate} (exit {code})", file=sys.stderr)
            return code
        result["rates"][rate] = json.loads(worker_out.read_text())
        worker_out.unlink()
        (out / "fsdp.json").write_text(json.dumps(result, indent=1))  # kept if a later rate fails
    (out / "fsdp.md").write_text(table(result))
    plot(out / "fsdp.png", result)
    print(table(result))
    print(f"wrote {out}/fsdp.json, fsdp.md, fsdp.png", flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m xcomm_bench fsdp", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="mlp", help="mlp, cnn or transformer")
    p.add_argument("--rates", default="0.1gbit,1gbit,10gbit", help="'loopback' runs unshaped")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny models")
    p.add_argument(
        "--min-bytes", type=int, default=64 * 1024, help="smaller reduce-scatters go uncompressed"
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default="bench-results/fsdp")
    p.add_argument("--worker", default=None, dest="worker_out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.worker_out:
        return rank_main(args)
    return launch(args, argv)
