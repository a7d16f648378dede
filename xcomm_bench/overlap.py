"""Overlap benchmark: the GradientBucketer vs reducing everything after backward.

``python -m xcomm_bench overlap --rate 300mbit`` starts 2 emulated nodes (network
namespaces joined by tbf-shaped links, :mod:`xcomm_bench.cluster`; needs root), one
rank each, and trains an MLP whose backward pass takes about as long as its
gradient allreduce on that link. In one run, round-robin, it times one training
step (forward, backward, gradient averaging, SGD step) in each mode:

``after_backward``
    backward, then every bucket (the engine's own layout) is allreduced, then
    the optimizer steps: what a hand-written loop does;
``after_backward_flat``
    backward, then one allreduce of all gradients flattened together;
``engine``
    :class:`xcomm.GradientBucketer`: buckets are reduced while backward still
    runs, and each bucket's optimizer steps as soon as it lands;
``engine_fifo`` / ``engine_priority``
    the engine with buckets cut into ``--chunk-mb`` chunks sent one at a time
    by :class:`xcomm.scheduler.ChunkScheduler`, in FIFO order or with the
    layers nearest the input first. Besides the step time, each reports the
    *forward wait*: from the end of backward until the first layer's
    gradients are reduced (when the next forward pass could start);
``compute_only`` / ``comm_only``
    the step without communication, and the bucket allreduces alone: the two
    things being overlapped.

It reports the median step time of each mode and ``engine / after_backward``
(the target is <= 0.7), and draws rank 0's timeline of one step of each mode
(``overlap_timeline.png``, also ``overlap_trace_rank*.json`` for Perfetto).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MODES = (
    "after_backward",
    "after_backward_flat",
    "engine",
    "engine_fifo",
    "engine_priority",
    "compute_only",
    "comm_only",
)
TRACED = ("after_backward", "engine", "engine_fifo", "engine_priority")


@dataclasses.dataclass
class OverlapConfig:
    rate: str = "300mbit"
    nodes: int = 2
    hidden: int = 1024
    layers: int = 6
    batch: int = 512
    bucket_cap_mb: float = 2.0
    chunk_mb: float = 0.5
    steps: int = 8
    warmup: int = 2
    threads: int = 1
    tbf_latency_ms: float = 10.0
    mtu: int = 1500
    out: str = "bench-results/overlap"
    timeout: float = 900.0

    def validate(self) -> None:
        if self.nodes < 2:
            raise ValueError("--nodes must be >= 2 (one rank per node)")
        for name in ("hidden", "layers", "batch", "steps", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        if self.bucket_cap_mb <= 0:
            raise ValueError("--bucket-cap-mb must be > 0")

    def argv(self) -> list[str]:
        out = []
        for f in dataclasses.fields(self):
            out += [f"--{f.name.replace('_', '-')}", str(getattr(self, f.name))]
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = OverlapConfig()
    for f in dataclasses.fields(OverlapConfig):
        p.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(getattr(d, f.name)),
            default=getattr(d, f.name),
        )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> OverlapConfig:
    cfg = OverlapConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(OverlapConfig)}
    )
    cfg.validate()
    return cfg


# ------------------------------------------------------------------ one rank


def _model(cfg: OverlapConfig) -> Any:
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(cfg.layers):
        layers += [nn.Linear(cfg.hidden, cfg.hidden), nn.ReLU()]
    layers.append(nn.Linear(cfg.hidden, 10))
    return nn.Sequential(*layers)


def run_rank(cfg: OverlapConfig) -> int:
    """One rank (env:// variables set by the cluster)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import xcomm
    from xcomm import trace

    torch.set_num_threads(cfg.threads)
    dist.init_process_group("xcomm", timeout=datetime.timedelta(seconds=cfg.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _model(cfg)
    bucketer = xcomm.GradientBucketer(
        model,
        bucket_cap_mb=cfg.bucket_cap_mb,
        optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=1e-3),
    )
    buckets = bucketer.buckets
    # The scheduled engines train their own copies (one bucketer per module).
    scheduled = {}
    for mode in ("fifo", "priority"):
        m = copy.deepcopy(model)
        scheduled[f"engine_{mode}"] = (
            m,
            xcomm.GradientBucketer(
                m,
                bucket_cap_mb=cfg.bucket_cap_mb,
                optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                schedule=mode,
                chunk_mb=cfg.chunk_mb,
            ),
        )
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg.batch, cfg.hidden, generator=g)
    y = torch.randint(0, 10, (cfg.batch,), generator=g)

    # Backward duration of the current step (ms), for every mode that runs one.
    backward_ms: dict[str, float] = {}

    def compute_span(name: str, t0: int) -> None:
        t1 = trace.now_us()
        trace.add_span(name, "compute", "compute (training thread)", t0, t1)
        if name == "backward":
            backward_ms["last"] = (t1 - t0) / 1e3

    def forward_backward() -> None:
        t0 = trace.now_us()
        loss = nn.functional.cross_entropy(model(x), y)
        compute_span("forward", t0)
        t0 = trace.now_us()
        loss.backward()
        compute_span("backward", t0)

    def reduce_buckets() -> None:
        works = []
        for b in buckets:
            t0 = trace.now_us()
            flat = torch.cat([p.grad.reshape(-1) for p in b.params]).mul_(1.0 / world)
            works.append((b, flat, dist.all_reduce(flat, async_op=True), t0))
        for b, flat, w, t0 in works:
            w.wait()
            trace.add_span(
                f"bucket {b.index} issue..landed",
                "transfer",
                "after-backward allreduce",
                t0,
                trace.now_us(),
            )
            for p, off in zip(b.params, b.offsets, strict=True):
                p.grad.copy_(flat.narrow(0, off, p.numel()).view_as(p))

    def reduce_flat() -> None:
        params = [p for b in buckets for p in b.params]
        flat = torch.cat([p.grad.reshape(-1) for p in params]).mul_(1.0 / world)
        dist.all_reduce(flat)
        off = 0
        for p in params:
            p.grad.copy_(flat.narrow(0, off, p.numel()).view_as(p))
            off += p.numel()

    def optimizer_steps() -> None:
        t0 = trace.now_us()
        for opt in bucketer.optimizers:
            opt.step()
        compute_span("optimizer", t0)

    def step(mode: str) -> float:
        bucketer.zero_grad(set_to_none=False)  # comm_only reduces the kept tensors
        dist.barrier()
        t0 = time.perf_counter()
        c0 = time.process_time()
        if mode == "engine":
            forward_backward()
            bucketer.step()
        elif mode in scheduled:
            m, b = scheduled[mode]
            b.zero_grad()
            t1 = trace.now_us()
            loss = nn.functional.cross_entropy(m(x), y)
            compute_span("forward", t1)
            t1 = trace.now_us()
            loss.backward()
            compute_span("backward", t1)
            b.step()
            forward_wait[mode].append(b.last_timing["forward_wait_s"])
        elif mode == "comm_only":
            reduce_buckets()
        else:
            with bucketer.no_sync():
                forward_backward()
            if mode == "after_backward":
                reduce_buckets()
            elif mode == "after_backward_flat":
                reduce_flat()
            optimizer_steps()
        cpu[mode].append(time.process_time() - c0)
        if "last" in backward_ms:
            backward[mode].append(backward_ms.pop("last"))
        return time.perf_counter() - t0

    # comm_only needs gradients to exist: one local backward first.
    with bucketer.no_sync():
        nn.functional.cross_entropy(model(x), y).backward()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    # CPU seconds of this process (all threads) per step.
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    backward: dict[str, list[float]] = {m: [] for m in MODES}
    forward_wait: dict[str, list[float]] = {m: [] for m in scheduled}
    iterator: Any = range(cfg.warmup + cfg.steps)
    if rank == 0:
        try:
            from tqdm import tqdm

            iterator = tqdm(iterator, desc="overlap rounds", file=sys.stderr)
        except ImportError:
            pass
    traced_steps: dict[str, tuple[int, int]] = {}
    for i in iterator:
        for mode in MODES:
            last = i == cfg.warmup + cfg.steps - 1
            if last and mode in TRACED:
                xcomm.enable_timeline()
                start = trace.now_us()
            dt = step(mode)
            if last and mode in TRACED:
                traced_steps[mode] = (start, trace.now_us())
                xcomm.save_timeline(
                    Path(cfg.out) / f"overlap_trace_{mode}_rank{rank}.json", pid=rank
                )
                xcomm.disable_timeline()
            if i >= cfg.warmup:
                times[mode].append(dt)
    result = {
        "rank": rank,
        "world": world,
        "params": sum(p.numel() for p in model.parameters()),
        "grad_bytes": sum(p.numel() * 4 for p in model.parameters()),
        "buckets": len(buckets),
        "times": times,
        "forward_wait_s": {m: v[cfg.warmup :] for m, v in forward_wait.items()},
        "cpu_s": {m: statistics.median(v[cfg.warmup :]) for m, v in cpu.items()},
        # median backward pass (ms): how much transfers beside it slow it down
        "backward_ms": {
            m: statistics.median(v[cfg.warmup :]) for m, v in backward.items() if v[cfg.warmup :]
        },
        "traced_steps": traced_steps,
        "stats": xcomm.stats(),
    }
    with open(Path(cfg.out) / f"overlap_rank{rank}.json", "w") as f:
        json.dump(result, f)
    bucketer.detach()
    for _, b in scheduled.values():
        b.detach()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ launcher


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step time per mode (slowest rank of each step) and the ratios."""
    n = len(results[0]["times"]["engine"])
    med = {}
    for mode in MODES:
        per_step = [max(r["times"][mode][i] for r in results) for i in range(n)]
        med[mode] = statistics.median(per_step)
    n_fw = len(results[0]["forward_wait_s"]["engine_fifo"])
    fw = {
        mode: statistics.median(
            max(r["forward_wait_s"][mode][i] for r in results) for i in range(n_fw)
        )
        for mode in ("engine_fifo", "engine_priority")
    }
    return {
        "median_step_s": med,
        "median_forward_wait_s": fw,
        "forward_wait_priority_vs_fifo": fw["engine_priority"] / fw["engine_fifo"]
        if fw["engine_fifo"]
        else float("nan"),
        "engine_vs_after_backward": med["engine"] / med["after_backward"],
        "engine_vs_after_backward_flat": med["engine"] / med["after_backward_flat"],
        "comm_over_compute": med["comm_only"] / med["compute_only"],
    }


def plot_timeline(
    out: Path,
    rank0_traces: dict[str, dict[str, Any]],
    summary: dict[str, Any],
    title: str,
) -> Path:
    """One panel per traced mode of rank 0's spans, one row per track.

    The backend's own op track is left out (it repeats the transfers; it is in the JSON).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in TRACED if m in rank0_traces]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 1.2 + 2.0 * len(modes)), squeeze=False)
    colors = {
        "compute": "tab:blue",
        "transfer": "tab:orange",
        "encode": "tab:green",
        "decode": "tab:purple",
        "optimizer": "tab:red",
    }
    t_end = 0.0
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        tr = rank0_traces[mode]
        events = tr["traceEvents"]
        tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        spans = [
            e for e in events if e["ph"] == "X" and tracks.get(e["tid"]) != "xcomm backend ops"
        ]
        starts = [e["ts"] for e in spans if e["name"] == "forward"]
        if not starts:
            continue
        t0 = min(starts)
        spans = [e for e in spans if e["ts"] >= t0]
        rows = sorted({tracks[e["tid"]] for e in spans})
        for e in spans:
            row = rows.index(tracks[e["tid"]])
            ax.broken_barh(
                [((e["ts"] - t0) / 1e3, max(e["dur"], 50) / 1e3)],
                (row - 0.4, 0.8),
                color=colors.get(e["cat"], "gray"),
                edgecolor="black",
                linewidth=0.3,
            )
            t_end = max(t_end, (e["ts"] + e["dur"] - t0) / 1e3)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(rows, fontsize=8)
        ax.set_title(
            f"{mode}: step {summary['median_step_s'][mode] * 1e3:.0f} ms (median)",
            fontsize=9,
        )
        ax.grid(axis="x", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_xlim(0, t_end * 1.02)
    axes[-1, 0].set_xlabel("ms since the step started (rank 0)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out / "overlap_timeline.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def launch(cfg: OverlapConfig) -> int:
    from .launch import module_command, run_ranks

    cfg.validate()
    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, out=str(out))
    rc = run_ranks(
        module_command("xcomm_bench.overlap", "--worker", *cfg.argv()),
        cfg.nodes,
        nodes=cfg.nodes,
        rate=cfg.rate,
        timeout=cfg.timeout,
        cluster_options={"latency_ms": cfg.tbf_latency_ms, "mtu": cfg.mtu},
    )
    if rc != 0:
        print(f"error: ranks failed (exit status {rc})", file=sys.stderr)
        return rc
    per_rank = [json.loads((out / f"overlap_rank{r}.json").read_text()) for r in range(cfg.nodes)]
    summary = summarize(per_rank)
    r0 = per_rank[0]
    title = (
        f"{cfg.nodes} emulated nodes at {cfg.rate}, MLP {cfg.layers}x{cfg.hidden} "
        f"({r0['grad_bytes'] / 2**20:.1f} MiB of gradients, {r0['buckets']} buckets of <= {cfg.bucket_cap_mb} MiB), "
        f"batch {cfg.batch}"
    )
    traces = {m: json.loads((out / f"overlap_trace_{m}_rank0.json").read_text()) for m in TRACED}
    png = plot_timeline(out, traces, summary, title)
    report = {
        "config": dataclasses.asdict(cfg),
        "title": title,
        "summary": summary,
        "ranks": per_rank,
    }
    (out / "overlap.json").write_text(json.dumps(report, indent=1))
    print(title)
    print(f"{'mode':<22}{'median step (ms)':>18}{'rank-0 CPU (ms)':>18}{'rank-0 backward':>18}")
    for mode, t in summary["median_step_s"].items():
        bw = r0["backward_ms"].get(mode)
        print(
            f"{mode:<22}{t * 1e3:>18.1f}{r0['cpu_s'][mode] * 1e3:>18.1f}"
            + (f"{bw:>18.1f}" if bw is not None else f"{'-':>18}")
        )
    print(
        f"engine / after_backward      = {summary['engine_vs_after_backward']:.3f}  (target <= 0.7)"
    )
    print(f"engine / after_backward_flat = {summary['engine_vs_after_backward_flat']:.3f}")
    print(f"comm_only / compute_only     = {summary['comm_over_compute']:.2f}")
    fw = summary["median_forward_wait_s"]
    print(
        f"forward wait (backward end -> first layer reduced): fifo {fw['engine_fifo'] * 1e3:.1f} ms, "
        f"priority {fw['engine_priority'] * 1e3:.1f} ms, ratio {summary['forward_wait_priority_vs_fifo']:.3f}"
    )
    print(f"timeline: {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m xcomm_bench overlap", description=__doc__.split("\n")[0]
    )
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_rank(cfg) if args.worker else launch(cfg)


if __name__ == "__main__":
    sys.exit(main())
