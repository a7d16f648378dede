"""Reports of a collectives sweep: text table, Markdown, CSV, JSON and a PNG plot.

The ratio columns are ``busbw(backend) / busbw(baseline)``, which equals
``time(baseline) / time(backend)``: above 1 the backend is faster.

Example::

    >>> from xcomm_bench import report
    >>> ms, meta = report.load_json("bench-results/collectives/collectives.json")  # doctest: +SKIP
    >>> print(report.format_markdown(ms, baseline="gloo"))  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .collectives import Measurement
from .metrics import OPS

__all__ = [
    "format_markdown",
    "format_table",
    "human_size",
    "load_json",
    "plot",
    "ratio_summary",
    "write_all",
    "write_csv",
    "write_json",
]

_FIELDS = [f.name for f in dataclasses.fields(Measurement)]


def human_size(nbytes: float) -> str:
    """``8 -> '8 B'``, ``65536 -> '64 KiB'``, ``3 << 20 -> '3 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if nbytes == int(nbytes) else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} B"


def _backends(ms: Sequence[Measurement]) -> list[str]:
    return list(dict.fromkeys(m.backend for m in ms))


def _grid(ms: Sequence[Measurement]) -> dict[tuple[str, int], dict[str, Measurement]]:
    """(op, nbytes) -> backend -> measurement, in op order then size order."""
    grid: dict[tuple[str, int], dict[str, Measurement]] = {}
    order = {op: i for i, op in enumerate(OPS)}
    for m in sorted(ms, key=lambda m: (order.get(m.op, len(OPS)), m.op, m.nbytes)):
        grid.setdefault((m.op, m.nbytes), {})[m.backend] = m
    return grid


def _ratio(m: Measurement | None, base: Measurement | None) -> float | None:
    if m is None or base is None or base.time_us <= 0 or m.time_us <= 0:
        return None
    return base.time_us / m.time_us


def _rows(ms: Sequence[Measurement], baseline: str) -> tuple[list[str], list[list[str]]]:
    backends = _backends(ms)
    others = [b for b in backends if b != baseline] if baseline in backends else []
    header = ["op", "size", "count"]
    for b in backends:
        header += [f"{b} time(us)", f"{b} busbw(GB/s)"]
    header += [f"{b}/{baseline}" for b in others] + ["check"]
    rows = []
    for (op, nbytes), by_backend in _grid(ms).items():
        any_m = next(iter(by_backend.values()))
        row = [op, human_size(nbytes), str(any_m.count)]
        for b in backends:
            m = by_backend.get(b)
            row += ["-", "-"] if m is None else [f"{m.time_us:.1f}", f"{m.busbw_gbps:.4g}"]
        for b in others:
            r = _ratio(by_backend.get(b), by_backend.get(baseline))
            row.append("-" if r is None else f"{r:.2f}")
        failed = [b for b, m in by_backend.items() if not m.correct]
        row.append("OK" if not failed else "FAIL " + ",".join(failed))
        rows.append(row)
    return header, rows


def format_table(ms: Sequence[Measurement], *, baseline: str = "gloo") -> str:
    """A fixed-width table, one line per (op, size), backends side by side."""
    if not ms:
        return "(no measurements)"
    header, rows = _rows(ms, baseline)
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    world = ms[0].world_size
    lines.append(
        f"# {world} ranks, dtype {ms[0].dtype}; time = p50 over iterations of the slowest "
        f"rank; busbw per nccl-tests; ratio = busbw / busbw({baseline})"
    )
    return "\n".join(lines)


def format_markdown(
    ms: Sequence[Measurement],
    *,
    baseline: str = "gloo",
    ops: Iterable[str] | None = None,
    sizes: Iterable[int] | None = None,
) -> str:
    """A Markdown table (optionally restricted to some ops and sizes)."""
    keep_ops = set(ops) if ops is not None else None
    keep_sizes = set(sizes) if sizes is not None else None
    sel = [
        m
        for m in ms
        if (keep_ops is None or m.op in keep_ops) and (keep_sizes is None or m.nbytes in keep_sizes)
    ]
    if not sel:
        return "(no measurements)"
    header, rows = _rows(sel, baseline)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def ratio_summary(
    ms: Sequence[Measurement], *, baseline: str = "gloo"
) -> dict[str, dict[str, float]]:
    """Per non-baseline backend and op: geometric mean, min and max of the ratio over sizes."""
    summary: dict[str, dict[str, float]] = {}
    grid = _grid(ms)
    for b in _backends(ms):
        if b == baseline:
            continue
        for op in dict.fromkeys(m.op for m in ms):
            rs = [
                r
                for (o, _), by in grid.items()
                if o == op and (r := _ratio(by.get(b), by.get(baseline))) is not None
            ]
            if rs:
                geo = math.exp(sum(math.log(r) for r in rs) / len(rs))
                summary[f"{b}/{baseline} {op}"] = {
                    "geomean": geo,
                    "min": min(rs),
                    "max": max(rs),
                    "n": len(rs),
                }
    return summary


def write_csv(path: Path, ms: Sequence[Measurement]) -> Path:
    """One row per measurement, columns = :class:`Measurement` fields."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=_FIELDS)
        w.writeheader()
        for m in ms:
            w.writerow(m.as_dict())
    return path


def write_json(path: Path, ms: Sequence[Measurement], meta: dict[str, Any]) -> Path:
    """``{"meta": ..., "results": [...]}``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "results": [m.as_dict() for m in ms]}, f, indent=1)
        f.write("\n")
    return path


def load_json(path: str | Path) -> tuple[list[Measurement], dict[str, Any]]:
    """Reads what :func:`write_json` wrote."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return [Measurement(**r) for r in data["results"]], data.get("meta", {})


def plot(path: Path, ms: Sequence[Measurement], *, baseline: str = "gloo", title: str = "") -> Path:
    """busbw vs size per op (one panel per op, a line per backend) and, when the
    baseline was measured, the ratio to it underneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OPS if any(m.op == op for m in ms)]
    backends = _backends(ms)
    others = [b for b in backends if b != baseline] if baseline in backends else []
    nrows = 2 if others else 1
    fig, axes = plt.subplots(
        nrows, len(ops), figsize=(3.6 * len(ops), 3.2 * nrows + 0.6), squeeze=False, sharex=True
    )
    grid = _grid(ms)
    for j, op in enumerate(ops):
        ax = axes[0][j]
        for b in backends:
            pts = sorted((m.nbytes, m.busbw_gbps) for m in ms if m.op == op and m.backend == b)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=b)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        if j == 0:
            ax.set_ylabel("busbw (GB/s)")
            ax.legend(fontsize="small")
        if others:
            rax = axes[1][j]
            for b in others:
                pts = sorted(
                    (nb, r)
                    for (o, nb), by in grid.items()
                    if o == op and (r := _ratio(by.get(b), by.get(baseline))) is not None
                )
                rax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"{b}/{baseline}"
                )
            rax.axhline(1.0, color="gray", lw=0.8, ls="--")
            rax.set_xscale("log", base=2)
            rax.grid(True, which="both", alpha=0.3)
            if j == 0:
                rax.set_ylabel(f"busbw ratio to {baseline}")
                rax.legend(fontsize="small")
    for ax in axes[-1]:
        ax.set_xlabel("message size (bytes)")
        lo, hi = min(m.nbytes for m in ms), max(m.nbytes for m in ms)
        step = max(1, math.ceil((math.log2(hi) - math.log2(lo)) / 5))
        ticks = [1 << k for k in range(int(math.log2(lo)), int(math.log2(hi)) + 1, step)]
        ax.set_xticks(ticks, [human_size(t).replace(" ", "") for t in ticks])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)  # keeps the PNG well under 200 KB for docs/img
    plt.close(fig)
    return path


def write_all(
    out_dir: Path,
    ms: Sequence[Measurement],
    meta: dict[str, Any],
    *,
    baseline: str = "gloo",
    plot_png: bool = True,
    stem: str = "collectives",
) -> list[Path]:
    """Writes ``<stem>.csv``, ``.json``, ``.md`` and (``plot_png``) ``.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        write_csv(out_dir / f"{stem}.csv", ms),
        write_json(out_dir / f"{stem}.json", ms, meta),
    ]
    md = out_dir / f"{stem}.md"
    md.write_text(format_markdown(ms, baseline=baseline) + "\n", encoding="utf-8")
    paths.append(md)
    if plot_png:
        cfg = meta.get("config", {})
        where = (
            f"{cfg.get('nodes')} emulated nodes at {cfg.get('rate') or 'unshaped'}"
            if cfg.get("nodes")
            else "loopback"
        )
        title = f"{meta.get('world_size', '?')} ranks, {cfg.get('label') or where}, {cfg.get('dtype', '')}"
        if meta.get("cpu_count"):
            title += f" ({meta['cpu_count']}-core host)"
        paths.append(plot(out_dir / f"{stem}.png", ms, baseline=baseline, title=title))
    return paths
