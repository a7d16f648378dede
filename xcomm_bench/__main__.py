"""Command line of xcomm's benchmarks: ``python -m xcomm_bench <subcommand>``.

Subcommands:

``collectives``
    nccl-tests-style sweep of allreduce, broadcast, allgather, reduce_scatter
    and alltoall over several backends side by side.
``ddp``
    End-to-end DDP time and bytes per step for several models and gradient
    reductions (xcomm's hooks, torch's), across link rates of an emulated cluster.
``report``
    Re-prints / re-plots a stored ``collectives.json``.
``convergence``
    Final test accuracy of every reduction on the digits task (does accuracy hold?).
``codecs``
    Encode+decode time of xcomm's codecs against plain torch ops and torch's hooks.
``overlap``
    GradientBucketer vs reducing after backward on emulated slow links
    (:mod:`xcomm_bench.overlap`).
``fusion``
    many small async allreduces, fused vs not (:mod:`xcomm_bench.fusion`).
``autoswitch``
    the auto hook on an emulated link whose rate changes mid-run
    (:mod:`xcomm_bench.autoswitch`).
``fsdp``
    FSDP2 step time and bytes with and without a compressed reduce-scatter
    (:mod:`xcomm_bench.fsdp`).
``diloco``
    DiLoCo against DDP on digits: accuracy, bytes per sample and wall-clock
    time at emulated link rates (:mod:`xcomm_bench.diloco`).
``time-to-accuracy``
    steps to a target loss times step time, per reduction and link rate, on a
    language model and an embedding model (:mod:`xcomm_bench.time_to_accuracy`).
``gpu``
    one GPU: codec GB/s beside the GPU's copy bandwidth, DDP step time and
    hook cost per step at world size 1 (:mod:`xcomm_bench.gpu`).

Examples::

    python -m xcomm_bench collectives --backends xcomm,gloo --nproc 2 --out bench-results/loopback
    python -m xcomm_bench collectives --min-bytes 1K --max-bytes 64M --factor 4
    # 2 emulated nodes at 1 Gbit/s, 1 rank each (root):
    python -m xcomm_bench collectives --nodes 2 --nproc 2 --rate 1gbit --max-bytes 64M
    python -m xcomm_bench report bench-results/loopback/collectives.json --markdown
    # DDP over 2 emulated nodes at 0.1, 1 and 10 Gbit/s (root):
    python -m xcomm_bench ddp --rates 0.1gbit,1gbit,10gbit --out bench-results/ddp
    python -m xcomm_bench ddp --smoke   # loopback, tiny models, a few seconds
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .metrics import OPS

if TYPE_CHECKING:
    from .collectives import SweepConfig
    from .ddp import DDPBenchConfig

MiB = 1 << 20


def _size(text: str) -> int:
    from .collectives import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _add_collectives(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "collectives",
        help="sweep collectives over message sizes, backends side by side",
        description="nccl-tests-style sweep: p50 time, algbw, busbw and a correctness check "
        "per (op, size, backend). Ranks are spawned on loopback (or in an emulated cluster "
        "with --nodes).",
    )
    a = p.add_argument
    a(
        "--backends",
        default=None,
        help="comma-separated backends, name or name:device (default: xcomm,gloo, plus nccl with a GPU)",
    )
    a("--ops", default=",".join(OPS), help=f"comma-separated ops (default {','.join(OPS)})")
    a("--nproc", type=int, default=2, help="world size, total ranks (default 2)")
    a("--min-bytes", type=_size, default=8, help="smallest message, bytes or K/M/G (default 8)")
    a("--max-bytes", type=_size, default=256 * MiB, help="largest message (default 256M)")
    a("--factor", type=float, default=2.0, help="size multiplication step (default 2)")
    a("--iters", type=int, default=20, help="timed iterations for small messages (default 20)")
    a(
        "--min-iters",
        type=int,
        default=3,
        help="timed iterations for the largest messages (default 3)",
    )
    a(
        "--iter-bytes",
        type=_size,
        default=512 * MiB,
        help="iterations = clamp(iter_bytes / size, min-iters, iters) (default 512M)",
    )
    a(
        "--warmup",
        type=int,
        default=5,
        help="most warm-up iterations, fewer for big messages (default 5)",
    )
    a("--dtype", default="float32", help="float32 (default), float64, float16, bfloat16, int32")
    a("--baseline", default="gloo", help="backend the ratios are against (default gloo)")
    a(
        "--out",
        default="bench-results/collectives",
        help="folder for collectives.{csv,json,md,png} (default bench-results/collectives)",
    )
    a("--no-out", action="store_true", help="write no files, only the table")
    a("--no-plot", action="store_true", help="skip the PNG")
    a("--no-progress", action="store_true", help="no progress bar")
    a(
        "--nodes",
        type=int,
        default=0,
        help="0: ranks on loopback (default); N: an emulated cluster of N nodes (root)",
    )
    a("--rate", default=None, help="link rate of the emulated cluster, e.g. 1gbit")
    a(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default cores / local ranks)",
    )
    a("--label", default="", help="free text stored in the JSON and the plot title")
    a(
        "--pg-timeout",
        type=float,
        default=600.0,
        help="process group timeout, seconds (default 600)",
    )
    a(
        "--no-interleave",
        action="store_true",
        help="take each backend's samples in a row instead of round-robin",
    )
    a(
        "--block-bytes",
        type=_size,
        default=64 * MiB,
        help="a sample times clamp(block_bytes / size, 1, max-block) back-to-back ops "
        "(default 64M)",
    )
    a(
        "--max-block",
        type=int,
        default=32,
        help="most back-to-back ops per sample; 1 times every op on its own (default 32)",
    )
    a("--timeout", type=float, default=None, help="kill the ranks after this many seconds")
    a(
        "--launcher",
        choices=("spawn", "env"),
        default="spawn",
        help="spawn: start the ranks (default); env: this process is one rank "
        "(env:// variables set)",
    )


def _add_ddp(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from .ddp import DEFAULT_REDUCTIONS, EXTRA_MODELS, MODELS, REDUCTIONS

    p = sub.add_parser(
        "ddp",
        help="end-to-end DDP time/bytes per step per model, reduction and link rate",
        description="DDP training steps on synthetic data for each model and gradient "
        "reduction, one emulated cluster per link rate (root), or loopback with --nodes 0. "
        "Reports p50 time/step, bytes/step and the speedup over uncompressed DDP in the same run.",
    )
    a = p.add_argument
    a(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated (default {','.join(MODELS)}; also {','.join(EXTRA_MODELS)})",
    )
    a(
        "--reductions",
        default=",".join(DEFAULT_REDUCTIONS),
        help=f"comma-separated, of {','.join(REDUCTIONS)} (default {','.join(DEFAULT_REDUCTIONS)}); "
        "'none' is always run",
    )
    a("--rates", default="0.1gbit,1gbit,10gbit", help="link rates (default 0.1gbit,1gbit,10gbit)")
    a("--nodes", type=int, default=None, help="emulated nodes (default 2; 0 = loopback, no root)")
    a("--ranks-per-node", type=int, default=1, help="ranks per node (default 1; loopback: 2)")
    a("--steps", type=int, default=None, help="timed steps per measurement (default 8; smoke 2)")
    a("--warmup", type=int, default=3, help="untimed steps first, >= 3 (default 3)")
    a("--rounds", type=int, default=2, help="rounds the timed steps are interleaved in (default 2)")
    a(
        "--min-seconds",
        type=float,
        default=0.0,
        help="raise the timed steps of the contenders (the autos and the reductions within "
        "2x of the fastest) so the fastest's take about this long (default 0: exactly --steps)",
    )
    a("--no-interleave", action="store_true", help="run each reduction's steps in one block")
    a("--powersgd-rank", type=int, default=4, help="PowerSGD matrix rank, both hooks (default 4)")
    a("--topk-density", type=float, default=0.01, help="top-k density (default 0.01)")
    a("--backend", default="xcomm", help="process-group backend DDP uses (default xcomm)")
    a("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size (default 25)")
    a("--threads", type=int, default=None, help="torch threads per rank (default cores/ranks)")
    a("--smoke", action="store_true", help="tiny models on loopback, 2 timed steps (for tests)")
    a("--out", default="bench-results/ddp", help="folder for ddp.{csv,json,md,png}")
    a("--no-out", action="store_true", help="write no files, only print the table")
    a("--no-plot", action="store_true", help="skip the PNG")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--label", default="", help="free text stored in the JSON")
    a("--pg-timeout", type=float, default=900.0, help="process group timeout, s (default 900)")
    a("--timeout", type=float, default=None, help="kill the ranks of a rate after this many s")
    a("--launcher", choices=("spawn", "env"), default="spawn", help=argparse.SUPPRESS)
    a("--rate-label", default="loopback", help=argparse.SUPPRESS)


def ddp_config_from_args(args: argparse.Namespace) -> DDPBenchConfig:
    """Builds a validated :class:`~xcomm_bench.ddp.DDPBenchConfig` from parsed arguments."""
    from .collectives import parse_list
    from .ddp import DDPBenchConfig

    nodes = args.nodes if args.nodes is not None else (0 if args.smoke else 2)
    cfg = DDPBenchConfig(
        models=parse_list(args.models),
        reductions=parse_list(args.reductions),
        rates=parse_list(args.rates),
        nodes=nodes,
        ranks_per_node=args.ranks_per_node if nodes else max(2, args.ranks_per_node),
        steps=args.steps if args.steps is not None else (2 if args.smoke else 8),
        warmup=args.warmup,
        rounds=args.rounds,
        min_seconds=args.min_seconds,
        interleave=not args.no_interleave,
        powersgd_rank=args.powersgd_rank,
        topk_density=args.topk_density,
        backend=args.backend,
        bucket_cap_mb=args.bucket_cap_mb,
        threads=args.threads,
        smoke=args.smoke,
        out=None if args.no_out else args.out,
        plot=not args.no_plot,
        progress=not args.no_progress,
        label=args.label,
        pg_timeout_s=args.pg_timeout,
    )
    cfg.validate()
    return cfg


def _cmd_ddp(args: argparse.Namespace) -> int:
    from .ddp import launch, run_rank

    try:
        cfg = ddp_config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.launcher == "env":
        return run_rank(cfg, args.rate_label)
    from .cluster import ClusterError, ClusterInterrupted, ClusterPermissionError

    try:
        return launch(cfg, timeout=args.timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ClusterPermissionError as e:
        print(f"error: {e} (or use --nodes 0 for loopback)", file=sys.stderr)
        return 77
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ClusterInterrupted as e:
        print(f"xcomm_bench ddp: {e}; ranks stopped, cluster torn down", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("xcomm_bench ddp: interrupted; ranks stopped, cluster torn down", file=sys.stderr)
        return 130


def _add_report(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="re-print or re-plot a stored collectives.json")
    p.add_argument("json", help="path of a collectives.json")
    p.add_argument("--baseline", default="gloo")
    p.add_argument(
        "--markdown", action="store_true", help="print Markdown instead of the text table"
    )
    p.add_argument("--ops", default=None, help="only these ops (comma-separated)")
    p.add_argument(
        "--sizes", default=None, help="only these sizes (comma-separated, e.g. 1K,1M,64M)"
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="also write the plot here")
    p.add_argument("--title", default=None, help="plot title")


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m xcomm_bench`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m xcomm_bench", description="xcomm benchmarks")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_collectives(sub)
    _add_ddp(sub)
    _add_report(sub)
    for name, (_module, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=f"{help_text} (see: python -m xcomm_bench {name} --help)")
    return parser


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    """Builds a validated :class:`~xcomm_bench.collectives.SweepConfig` from parsed arguments."""
    from .collectives import SweepConfig, default_backends, parse_list

    cfg = SweepConfig(
        backends=parse_list(args.backends) if args.backends else default_backends(),
        ops=parse_list(args.ops),
        nproc=args.nproc,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        factor=args.factor,
        max_iters=args.iters,
        min_iters=min(args.min_iters, args.iters),
        iter_bytes=args.iter_bytes,
        max_warmup=args.warmup,
        dtype=args.dtype,
        out=None if args.no_out else args.out,
        baseline=args.baseline,
        nodes=args.nodes,
        rate=args.rate,
        plot=not args.no_plot,
        progress=not args.no_progress,
        pg_timeout_s=args.pg_timeout,
        threads=args.threads,
        label=args.label,
        interleave=not args.no_interleave,
        block_bytes=args.block_bytes,
        max_block=args.max_block,
    )
    cfg.validate()
    return cfg


def _cmd_collectives(args: argparse.Namespace) -> int:
    from .collectives import launch, run_rank

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.launcher == "env":
        return run_rank(cfg)
    return launch(cfg, timeout=args.timeout)


def _cmd_report(args: argparse.Namespace) -> int:
    from . import report
    from .collectives import parse_list, parse_size

    ms, meta = report.load_json(args.json)
    ops = parse_list(args.ops) if args.ops else None
    sizes = [parse_size(s) for s in parse_list(args.sizes)] if args.sizes else None
    if args.markdown:
        print(report.format_markdown(ms, baseline=args.baseline, ops=ops, sizes=sizes))
    else:
        sel = [
            m for m in ms if (ops is None or m.op in ops) and (sizes is None or m.nbytes in sizes)
        ]
        print(report.format_table(sel, baseline=args.baseline))
    if args.plot:
        title = (
            args.title if args.title is not None else str(meta.get("config", {}).get("label", ""))
        )
        report.plot(Path(args.plot), ms, baseline=args.baseline, title=title)
    return 0


#: Subcommands that parse their own arguments: name -> (module, help).
_DELEGATED = {
    "convergence": ("convergence", "accuracy of every reduction on the digits task"),
    "codecs": ("codecs", "encode+decode cost of xcomm's codecs against plain torch ops"),
    "overlap": ("overlap", "GradientBucketer vs reducing after backward on emulated slow links"),
    "fusion": ("fusion", "many small async allreduces, fused vs not"),
    "autoswitch": ("autoswitch", "auto hook on a link whose rate changes mid-run"),
    "fsdp": ("fsdp", "FSDP2 step time and bytes, compressed reduce-scatter vs not"),
    "diloco": ("diloco", "DiLoCo vs DDP on digits: accuracy, bytes/sample, wall-clock"),
    "gpu": ("gpu", "one GPU: codec GB/s against copy, DDP step time per hook (world size 1)"),
    "time-to-accuracy": (
        "time_to_accuracy",
        "time to a target loss per reduction and link rate (LM, embedding model)",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        import importlib

        module = importlib.import_module(f".{_DELEGATED[argv[0]][0]}", __package__)
        return module.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.cmd == "collectives":
        return _cmd_collectives(args)
    if args.cmd == "ddp":
        return _cmd_ddp(args)
    return _cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
