"""Before/after: one collectives sweep, alternating two builds of xcomm.

Runs ``python -m xcomm_bench collectives ARGS`` ``--runs`` times with each
source tree's ``python/`` (and ``xcomm_bench``) first on ``PYTHONPATH``,
in pairs whose order alternates (before-after, then after-before: the
second run of a pair is often slower on a small machine, by 10-40% on 2
cores, which a fixed order would charge to one build), and prints, per
(backend, op, size), the median over runs of the p50 time of each build,
their ratio (after / before; below 1 is faster) and the median of the
pairs' ratios.

A tree is a checkout whose extension is built in place, e.g. an older commit:

    git clone -q . /work/old && git -C /work/old checkout -q <commit>
    (cd /work/old && python setup.py -q build_ext --inplace)
    python scripts/ab_builds.py --before /work/old --after . --runs 6 -- \\
        --backends xcomm,gloo --ops allreduce --min-bytes 4K --max-bytes 64K --iters 400
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm


def run_once(tree: Path, bench_args: list[str], out: Path) -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree / "python"), str(tree), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "xcomm_bench", "collectives", *bench_args]
    cmd += ["--out", str(out), "--no-plot", "--no-progress"]
    subprocess.run(cmd, env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    with open(out / "collectives.json", encoding="utf-8") as f:
        return json.load(f)["results"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="source tree, built in place")
    parser.add_argument("--after", type=Path, required=True, help="source tree, built in place")
    parser.add_argument("--runs", type=int, default=6, help="runs of each build (default 6)")
    parser.add_argument("--json", type=Path, help="also write every run's p50s here")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then collectives' args")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    p50: dict[tuple[str, str, int], dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pairs = [
            ("before", "after") if i % 2 == 0 else ("after", "before") for i in range(args.runs)
        ]
        order = [name for pair in pairs for name in pair]
        for i, name in enumerate(tqdm(order, desc="alternating runs", unit="run")):
            out = Path(tmp) / f"{i}"
            for r in run_once(trees[name], bench_args, out):
                key = (r["backend"], r["op"], int(r["nbytes"]))
                p50.setdefault(key, {"before": [], "after": []})[name].append(r["time_us"])
    print(
        f"{'backend':<22}{'op':<16}{'bytes':>10}{'before us':>12}{'after us':>12}{'ratio':>8}"
        f"{'paired':>8}"
    )
    rows = []
    for (backend, op, nbytes), runs in sorted(p50.items()):
        before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
        ratio = after / before if before else float("nan")
        # Run i of each build belong to one pair.
        paired = statistics.median(a / b for a, b in zip(runs["after"], runs["before"]) if b)
        rows.append(
            {
                "backend": backend,
                "op": op,
                "nbytes": nbytes,
                **runs,
                "ratio": ratio,
                "paired": paired,
            }
        )
        print(
            f"{backend:<22}{op:<16}{nbytes:>10}{before:>12.1f}{after:>12.1f}{ratio:>8.3f}"
            f"{paired:>8.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
