"""Compute per step of xcomm's PowerSGD hook against torch's, on the same buckets.

Run: ``python -m xcomm_bench.powersgd_compute [--ranks 1,2,4] [--steps 10]``;
``--models mlp-small --bucket-mb 0.02`` times the per-bucket host work, and
``--compare-ref REV`` adds xcomm's hook as it was at git revision REV.

Both hooks run over a world-size-1 process group, so their collectives are
trivial and the time is the hooks' own work (plus the few microseconds of
issuing each collective: xcomm's hook issues 2 per bucket, torch's 3). The
buckets are DDP's (rebuilt) buckets of two models, built without a model:
gradients laid out as DDP lays them out (reverse parameter order, a 1 MiB
first bucket, then ``--bucket-mb``), refilled with the same random gradients
before every step (outside the timed region). Each step issues the hook for
every bucket, then waits for all of them, as DDP does.

Reported: the median over ``--steps`` steps once compression runs (after
``start_powerSGD_iter`` = 2 plain steps and one compressed warm-up step,
which allocates the state), and xcomm / torch, in wall time and in CPU time
of the whole process; the two hooks take turns step by step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

MiB = 1 << 20


def mlp_shapes() -> list[tuple[int, ...]]:
    """A ~20M-parameter MLP: 784 -> 4 x 2048 -> 1000 (weights and biases)."""
    dims = [784, 2048, 2048, 2048, 2048, 2048, 1000]
    shapes: list[tuple[int, ...]] = []
    for fan_in, fan_out in itertools.pairwise(dims):
        shapes += [(fan_out, fan_in), (fan_out,)]
    return shapes


def resnet18_shapes() -> list[tuple[int, ...]]:
    """ResNet-18's parameters (11.7M in 62 tensors, most of them small)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for out_ch, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            s = stride if block == 0 else 1
            shapes += [(out_ch, in_ch, 3, 3), (out_ch,), (out_ch,)]
            shapes += [(out_ch, out_ch, 3, 3), (out_ch,), (out_ch,)]
            if block == 0 and (s != 1 or in_ch != out_ch):
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
            in_ch = out_ch
    shapes += [(1000, 512), (1000,)]
    return shapes


def small_mlp_shapes() -> list[tuple[int, ...]]:
    """12 x Linear(64): with ``--bucket-mb 0.02`` a bucket per layer, each a
    64 x 64 matrix and a bias, so a step is almost all per-bucket host work
    (Python, dispatch, futures, callbacks) rather than arithmetic."""
    return [(64, 64), (64,)] * 12


MODELS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "mlp-20M": mlp_shapes,
    "resnet18": resnet18_shapes,
    "mlp-small": small_mlp_shapes,
}


def hook_at(ref: str, name: str = "powersgd") -> Any:
    """xcomm's hook module ``xcomm.hooks.<name>`` as it was at git revision
    ``ref``, loaded beside today's (same ``xcomm._C``), with the helpers of
    ``hooks/_common.py`` at ``ref`` too: to time a change of a hook's Python
    side against its predecessor in one run."""
    import importlib.util
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tag = "".join(c if c.isalnum() else "_" for c in ref)
    module = None
    for part in ("_common", name):
        source = subprocess.run(
            ["git", "-C", root, "show", f"{ref}:python/xcomm/hooks/{part}.py"],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        source = source.replace("from ._common import", f"from ._common_at_{tag} import")
        path = os.path.join(tempfile.mkdtemp(), f"{part}.py")
        with open(path, "w") as f:
            f.write(source)
        full = f"xcomm.hooks.{part}_at_{tag}"
        spec = importlib.util.spec_from_file_location(full, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module  # for the next part's import of it
        spec.loader.exec_module(module)  # its other relative imports resolve in xcomm.hooks
    return module


class Bucket:
    """What a hook uses of ``dist.GradBucket``, over a buffer laid out as DDP's."""

    def __init__(self, index: int, shapes: Sequence[tuple[int, ...]], is_last: bool) -> None:
        numel = sum(torch.Size(s).numel() for s in shapes)
        self._buffer = torch.empty(numel)
        self._grads, self._params, offset = [], [], 0
        for s in shapes:
            n = torch.Size(s).numel()
            self._grads.append(self._buffer[offset : offset + n].view(s))
            self._params.append(torch.nn.Parameter(torch.empty(0)))
            offset += n
        self._index, self._last = index, is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def ddp_buckets(shapes: Sequence[tuple[int, ...]], bucket_mb: float) -> list[Bucket]:
    """DDP's rebuilt buckets when gradients become ready in reverse order."""
    ready = [torch.empty(s) for s in reversed(shapes)]
    cap = int(bucket_mb * MiB)
    limits = [min(dist._DEFAULT_FIRST_BUCKET_BYTES, cap), cap]
    indices, _ = dist._compute_bucket_assignment_by_size(ready, limits)
    rev = list(reversed(shapes))
    return [
        Bucket(i, [rev[j] for j in idx], i == len(indices) - 1) for i, idx in enumerate(indices)
    ]


def time_hooks(
    runs: dict[str, tuple[Callable[[Any, Any], torch.futures.Future], Any]],
    buckets: Sequence[Bucket],
    grads: Sequence[torch.Tensor],
    steps: int,
    warmup: int,
) -> dict[str, dict[str, list[float]]]:
    """Per implementation, the wall and CPU seconds of each timed step.

    The implementations take turns step by step, so load from elsewhere on
    the machine slows them alike. CPU time (``time.process_time``, every
    thread of the process, the callbacks' threads included) is the work
    itself and hardly depends on that load; wall time is what a step waits.
    """
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in runs}
    for step in range(warmup + steps):
        for name, (hook, state) in runs.items():
            for b, g in zip(buckets, grads):
                b.buffer().copy_(g)
            wall, cpu = time.perf_counter(), time.process_time()
            # One bucket at a time, for both: torch's hook waits inside its
            # future callbacks, and with several buckets in flight it can
            # deadlock (on Gloo too); at world size 1 there is no transfer to
            # overlap anyway.
            for b in buckets:
                hook(state, b).wait()
            if step >= warmup:
                times[name]["wall"].append(time.perf_counter() - wall)
                times[name]["cpu"].append(time.process_time() - cpu)
    return times


def measure(
    model: str, rank: int, steps: int, bucket_mb: float, seed: int = 0, ref: Any = None
) -> dict[str, Any]:
    from xcomm.hooks import PowerSGDState, powersgd_hook

    buckets = ddp_buckets(MODELS[model](), bucket_mb)
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(b.buffer().numel(), generator=gen) for b in buckets]
    config = {"matrix_approximation_rank": rank, "start_powerSGD_iter": 2}
    warmup = config["start_powerSGD_iter"] + 1  # plain steps, then the first compressed one
    result: dict[str, Any] = {
        "model": model,
        "rank": rank,
        "params": sum(g.numel() for g in grads),
        "buckets": len(buckets),
    }
    runs = {
        "torch": (torch_powersgd.powerSGD_hook, torch_powersgd.PowerSGDState(None, **config)),
        "xcomm": (powersgd_hook, PowerSGDState(None, **config)),
    }
    if ref is not None:
        runs["ref"] = (ref.powersgd_hook, ref.PowerSGDState(None, **config))
    for name, t in time_hooks(runs, buckets, grads, steps, warmup).items():
        result[name] = statistics.median(t["wall"]) * 1e3
        result[name + "_cpu"] = statistics.median(t["cpu"]) * 1e3
    result["ratio"] = result["xcomm"] / result["torch"]
    result["cpu_ratio"] = result["xcomm_cpu"] / result["torch_cpu"]
    if ref is not None:
        result["ref_ratio"] = result["xcomm"] / result["ref"]
        result["ref_cpu_ratio"] = result["xcomm_cpu"] / result["ref_cpu"]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m xcomm_bench.powersgd_compute", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS)
    )
    parser.add_argument("--ranks", default="1,2,4", help="matrix_approximation_rank values")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--backend", default="xcomm", help="process group backend (world size 1)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument(
        "--compare-ref",
        default=None,
        metavar="REV",
        help="also time xcomm's hook as it was at git revision REV (columns 'ref ms', "
        "'xcomm/ref' and 'cpu/ref'), to measure a change of the hook against its predecessor",
    )
    args = parser.parse_args(argv)  # fmt: skip

    import xcomm  # noqa: F401 - registers the backend

    if args.threads:
        torch.set_num_threads(args.threads)
    ref = hook_at(args.compare_ref) if args.compare_ref else None
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            args.backend, init_method="file://" + os.path.join(tmp, "store"), rank=0, world_size=1
        )
        try:
            print(
                f"PowerSGD hook compute per step, CPU, {torch.get_num_threads()} threads, "
                f"world size 1 ({args.backend}), {args.bucket_mb:g} MiB buckets, "
                f"median of {args.steps} steps"
            )
            header = (
                f"{'model':10} {'params':>7} {'buckets':>7} {'rank':>4} {'torch ms':>9} "
                f"{'xcomm ms':>9} {'xcomm/torch':>11} {'torch cpu':>9} {'xcomm cpu':>9} "
                f"{'cpu ratio':>9}"
            )
            if ref is not None:
                header += f" {'ref ms':>8} {'ref cpu':>8} {'xcomm/ref':>9} {'cpu/ref':>7}"
            print(header)
            print("-" * len(header))
            for model in args.models.split(","):
                for rank in (int(r) for r in args.ranks.split(",")):
                    r = measure(model, rank, args.steps, args.bucket_mb, ref=ref)
                    line = (
                        f"{r['model']:10} {r['params'] / 1e6:6.1f}M {r['buckets']:7d} {r['rank']:4d} "
                        f"{r['torch']:9.2f} {r['xcomm']:9.2f} {r['ratio']:11.2f} "
                        f"{r['torch_cpu']:9.2f} {r['xcomm_cpu']:9.2f} {r['cpu_ratio']:9.2f}"
                    )
                    if ref is not None:
                        line += (
                            f" {r['ref']:8.2f} {r['ref_cpu']:8.2f} {r['ref_ratio']:9.2f} "
                            f"{r['ref_cpu_ratio']:7.2f}"
                        )
                    print(line, flush=True)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
