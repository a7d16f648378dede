"""Helpers shared by the client tests: run one client on xcomm and on gloo,
compare what each returned.

A client is a module-level function ``fn(ctx, *args)`` (see
``dist_harness.run_ranks``) whose default process group is the backend under
comparison; it returns plain data (tensors, numbers, strings, nested in dicts
and lists). ``run_both`` runs it twice, once per backend, with the same seed
and inputs, and ``assert_same`` compares the two results bitwise (or within
a tolerance where the client's summation order may legitimately differ).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from dist_harness import run_program, run_ranks  # noqa: F401 - run_program for the client tests

BACKENDS = ("xcomm", "gloo")
PG_TIMEOUT = datetime.timedelta(seconds=30)


def run_both(fn: Any, *args: Any, world_size: int = 2, timeout: float = 90, **kw: Any) -> dict:
    """``{backend: [per-rank results]}`` for xcomm and gloo."""
    return {
        b: run_ranks(
            fn,
            world_size,
            *args,
            backend=b,
            ref_group=False,
            timeout=timeout,
            pg_timeout=PG_TIMEOUT,
            **kw,
        )
        for b in BACKENDS
    }


def diff(got: Any, want: Any, path: str = "", rtol: float = 0.0, atol: float = 0.0) -> list[str]:
    """Differences between two nested results; tensors bitwise when rtol == atol == 0."""
    out: list[str] = []
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: got {type(got).__name__}, expected a tensor"]
        if got.dtype != want.dtype or got.shape != want.shape:
            return [f"{path}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"]
        if rtol == 0 and atol == 0:
            if not torch.equal(got, want):
                d = (got.double() - want.double()).abs().max().item()
                out.append(f"{path}: not bitwise equal (max |diff| {d:.3g})")
        elif not torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
            d = (got.double() - want.double()).abs().max().item()
            out.append(f"{path}: max |diff| {d:.3g} beyond rtol={rtol} atol={atol}")
        return out
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys {sorted(map(str, got))} vs {sorted(map(str, want))}"]
        for k in want:
            out += diff(got[k], want[k], f"{path}.{k}", rtol, atol)
        return out
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{path}: {got!r:.200} vs {want!r:.200}"]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            out += diff(g, w, f"{path}[{i}]", rtol, atol)
        return out
    if isinstance(want, float) and (rtol or atol):
        if abs(got - want) > atol + rtol * abs(want):
            out.append(f"{path}: {got!r} vs {want!r}")
        return out
    if got != want:
        out.append(f"{path}: {got!r:.300} vs {want!r:.300}")
    return out


def assert_same(results: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    """xcomm's per-rank results equal gloo's (bitwise unless a tolerance is given)."""
    problems = diff(results["xcomm"], results["gloo"], "rank", rtol, atol)
    assert not problems, "xcomm differs from gloo:\n" + "\n".join(problems[:40])
