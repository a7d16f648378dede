"""Self-tests of ``dist_harness`` (always on gloo, independent of xcomm).

They pin down the guarantees the rest of the suite relies on: a rank's
exception is re-raised with its traceback, a hung rank is killed at the hard
timeout (with its Python stack in the report), and a crashed rank is reported
instead of being waited for.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import RankContext, RankError, run_ranks


def _rank_value(ctx: RankContext) -> tuple[int, float]:
    t = torch.full((2,), float(ctx.rank + 1))
    dist.all_reduce(t)
    r = torch.full((2,), float(ctx.rank + 1))
    dist.all_reduce(r, group=ctx.ref)
    return ctx.rank, float(t[0] + r[0])


def test_results_come_back_in_rank_order() -> None:
    assert run_ranks(_rank_value, 3, backend="gloo") == [(0, 12.0), (1, 12.0), (2, 12.0)]


def _rank_raises(ctx: RankContext) -> None:
    if ctx.rank == 1:
        raise ValueError("boom from rank one")


def test_rank_exception_is_reraised_with_traceback() -> None:
    with pytest.raises(
        RankError, match=r"rank 1 raised builtins.ValueError: boom from rank one"
    ) as ei:
        run_ranks(_rank_raises, 2, backend="gloo")
    assert "_rank_raises" in str(ei.value)  # the rank's traceback
    assert isinstance(ei.value.__cause__, ValueError)


def _rank_hangs(ctx: RankContext) -> None:
    if ctx.rank == 0:
        time.sleep(3600)


def test_hang_is_killed_at_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)TIMED OUT.*rank 0 HUNG.*_rank_hangs"):
        run_ranks(_rank_hangs, 2, backend="gloo", timeout=4)
    assert time.monotonic() - t0 < 15


def _rank_crashes(ctx: RankContext) -> None:
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()  # rank 0 is stuck here until the crash is noticed


def test_crash_is_reported() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 died without a result \(signal SIGSEGV\)"):
        run_ranks(_rank_crashes, 2, backend="gloo", timeout=30)
    assert time.monotonic() - t0 < 20


def _rank_dies_quietly(ctx: RankContext) -> str:
    dist.barrier()
    if ctx.rank == 1:
        os._exit(3)
    return "survivor"


def test_may_die_ranks_are_allowed_to_vanish() -> None:
    assert run_ranks(_rank_dies_quietly, 2, backend="gloo", may_die=[1]) == ["survivor", None]


def test_subprocess_launcher() -> None:
    assert run_ranks(_rank_value, 2, backend="gloo", launcher="subprocess") == [(0, 6.0), (1, 6.0)]


_LAUNCHER = '''
import subprocess, sys, time


def launcher_waits_for_its_rank():
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    child.wait()


CHILD = """
import time
from typing import Any


def rank_one_is_stuck_here():
    time.sleep(600)


rank_one_is_stuck_here()
"""
launcher_waits_for_its_rank()
'''


def test_a_hung_program_is_killed_with_the_stacks_of_all_its_processes(tmp_path: Any) -> None:
    """A program that starts its own ranks (Lightning's ``ddp``, torchrun)
    and hangs is killed whole, and the failure shows where each of its
    processes, the ones it started too, was stuck."""
    from dist_harness import run_program

    (tmp_path / "launcher.py").write_text(_LAUNCHER)
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_program(["launcher.py"], str(tmp_path), timeout=5, label="the launcher")
    text = str(failure.value)
    assert "the launcher hung" in text, text
    assert "launcher_waits_for_its_rank" in text and "rank_one_is_stuck_here" in text, text
    assert time.monotonic() - started < 30
