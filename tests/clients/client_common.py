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
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch

from dist_harness import run_ranks

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


def run_program(args: list[str], cwd: str, timeout: float, label: str) -> str:
    """Runs ``python ARGS`` as a program that launches its own ranks (in a
    session of its own, killed whole if it hangs), without the launcher
    variables of this process; fails the test unless it exits 0. Its log."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(k, None)
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the ranks it starts share our process group id
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{label} hung:\n{log.decode()[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.decode(errors="replace")
    assert proc.returncode == 0, f"{label} failed:\n{text[-6000:]}"
    return text
