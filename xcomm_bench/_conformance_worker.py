"""The process that runs torch's DistributedTest cases for :mod:`xcomm_bench.conformance`.

Not meant to be started by hand: :mod:`xcomm_bench.conformance` starts one in
its own session, feeds it one test name per line on stdin, and kills the whole
session when a test runs past its hard timeout. Each test writes one JSON
result file (written whole, then renamed into place); everything the test and
its ranks print goes to that test's log file.

The mode comes from the environment (``XCOMM_CONFORMANCE_MODE``):

- ``gloo``: the reference. ``BACKEND=gloo``, xcomm is not even imported.
- ``xcomm``: ``BACKEND=xcomm``; the suite sees the name ``xcomm`` (its
  gloo-only tests skip).
- ``standin``: ``BACKEND=gloo`` but xcomm answers: :func:`install_standin`
  maps every ``"gloo"`` that reaches ``init_process_group`` / ``new_group``
  to ``"xcomm"`` and makes ``get_backend`` report ``"gloo"`` for an xcomm
  group, so the suite takes its gloo branches against xcomm.

The suite checks that each collective is exactly one profiler event named
``<backend>:<op>``, for the backends it lists. xcomm records one
``xcomm:<op>`` event per op, so the ``xcomm`` mode adds xcomm to those lists,
and the ``standin`` mode looks for ``xcomm:<op>`` where the suite asks for
``gloo:<op>`` (the inner Gloo's events must not stand in for xcomm's).
``XCOMM_CONFORMANCE_PROFILER_NAMES=0`` turns those checks off.

In the ``xcomm`` and ``standin`` modes every rank writes a proof file per test:
the type of the default group's CPU backend when the test started and the
number of ops ``xcomm.stats()`` counted during the test.

Each rank's stderr goes to a file of its own while the test runs (appended to
the test's log afterwards). A rank that wrote no result (no proof file where
one is due, or an exit by a signal or with an unexpected code) is named in
the test's reason with its exit status and the tail of its stderr
(``rank_exits`` in the record holds every rank's exit code).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import traceback
import unittest
from pathlib import Path
from typing import Any

MODE = os.environ.get("XCOMM_CONFORMANCE_MODE", "gloo")
START = os.environ.get("XCOMM_CONFORMANCE_START", "fork")
PROOF_DIR = os.environ.get("XCOMM_CONFORMANCE_PROOF_DIR", "")
if MODE not in ("gloo", "xcomm", "standin"):
    raise SystemExit(f"XCOMM_CONFORMANCE_MODE must be gloo, xcomm or standin, not {MODE!r}")

# distributed_test reads these when it is imported.
os.environ["BACKEND"] = "xcomm" if MODE == "xcomm" else "gloo"
os.environ.setdefault("WORLD_SIZE", "2")

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from xcomm_bench.conformance import one_line_reason

if MODE != "gloo":
    import xcomm  # noqa: F401  (registers the backend)


def _to_xcomm(backend: Any) -> Any:
    """``"gloo"`` (any case, also inside ``"cpu:gloo,cuda:nccl"``) -> ``"xcomm"``."""
    if isinstance(backend, str):
        return re.sub(r"(?i)\bgloo\b", "xcomm", backend)
    return backend


def install_standin() -> None:
    """Makes xcomm answer wherever the suite asks for gloo (this process and
    the ranks it forks or spawns: a spawned rank imports this module again).

    ``init_process_group`` and ``new_group`` are replaced in both
    ``torch.distributed`` and ``distributed_c10d`` (``new_subgroups`` and
    friends call ``new_group`` through the module), and ``get_backend``
    reports ``"gloo"`` for a group whose backend is xcomm, so the suite's
    name checks and torch's own branches on the backend name see gloo.
    xcomm's own inner Gloo groups are built as ``ProcessGroupGloo`` objects
    directly, so they are unaffected.
    """
    if getattr(c10d, "_xcomm_standin", False):
        return
    real_init, real_new, real_get = c10d.init_process_group, c10d.new_group, c10d.get_backend

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if backend is None and "backend" in kwargs:
            backend = kwargs.pop("backend")
        return real_init(_to_xcomm(backend), *args, **kwargs)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = _to_xcomm(kwargs["backend"])
        elif len(args) >= 3:
            args = (*args[:2], _to_xcomm(args[2]), *args[3:])
        return real_new(*args, **kwargs)

    def get_backend(group: Any = None) -> Any:
        name = real_get(group)
        return "gloo" if name == "xcomm" else name

    for module in (c10d, dist):
        module.init_process_group = init_process_group
        module.new_group = new_group
        module.get_backend = get_backend
    c10d._xcomm_standin = True


if MODE == "standin":
    install_standin()

from torch.testing._internal import common_distributed
from torch.testing._internal.distributed import distributed_test as _suite
from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)

_PROFILING_LISTS = (
    _suite.PROFILING_SUPPORTED_BACKENDS,
    _suite.CUDA_PROFILING_SUPPORTED_BACKENDS,
    _suite.SEND_RECV_PROFILING_SUPPORTED_BACKENDS,
)
if os.environ.get("XCOMM_CONFORMANCE_PROFILER_NAMES", "1") == "0":
    # The suite checks for profiler events named "<backend>:<op>" (exactly
    # one per op) for the backends in these lists; emptying them skips only
    # that check, so the rest of each collective test (its results) still runs.
    for _lst in _PROFILING_LISTS:
        _lst.clear()
elif MODE == "xcomm":
    # The suite checks event names only for the backends it lists; xcomm
    # records "xcomm:<op>" as they do "<name>:<op>", so hold it to the check.
    for _lst in _PROFILING_LISTS:
        _lst.append("xcomm")
elif MODE == "standin":
    # The suite looks for "<get_backend()>:<op>", and the stand-in reports
    # "gloo" for an xcomm group; the backend answering is xcomm, whose events
    # are "xcomm:<op>" (exactly one per op, as Gloo's). Look for those: the
    # inner Gloo's own "gloo:<op>" events must not count for xcomm. What is
    # found answers to the name asked for (the point-to-point tests compare
    # each event's name with it); everything else is the event's own.
    _real_get_profiling_event = _suite.get_profiling_event

    class _AsAsked:
        def __init__(self, event: Any, name: str) -> None:
            self._event, self.name = event, name

        def __getattr__(self, attr: str) -> Any:
            return getattr(self._event, attr)

    def _xcomm_profiling_event(event_name: str, *args: Any, **kwargs: Any) -> Any:
        found = _real_get_profiling_event(re.sub(r"^gloo:", "xcomm:", event_name), *args, **kwargs)
        return [_AsAsked(e, event_name) for e in found]

    _suite.get_profiling_event = _xcomm_profiling_event

# torch's own per-test timeout: below the runner's hard timeout, so a hung
# test is reported by torch (with the ranks' stacks in the log) before the
# runner kills it.
_INNER_TIMEOUT = int(os.environ.get("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "300"))
common_distributed.TIMEOUT_DEFAULT = _INNER_TIMEOUT
for _name in list(common_distributed.TIMEOUT_OVERRIDE):
    common_distributed.TIMEOUT_OVERRIDE[_name] = _INNER_TIMEOUT


#: Set per test by :func:`_serve`: rank ``r`` sends its stderr to ``<this>.rank<r>.stderr``.
_RANK_STDERR_ENV = "XCOMM_CONFORMANCE_RANK_STDERR"


def _rank_stderr(prefix: str, rank: int) -> Path:
    return Path(f"{prefix}.rank{rank}.stderr")


def _default_backend_type() -> str:
    if not dist.is_initialized():
        return "none"
    return type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__


def _xcomm_calls() -> int:
    if MODE == "gloo":
        return 0
    import xcomm

    return sum(int(s["calls"]) for s in xcomm.stats().values())


class ConformanceCase(TestDistBackend, DistributedTest._DistTestBase):
    """torch's ``TestDistBackendWithSpawn``, with the ranks forked (default:
    no re-import per rank, several seconds saved per test on a small host)
    or spawned as torch does (``XCOMM_CONFORMANCE_START=spawn``)."""

    @classmethod
    def _run(cls, rank: int, *args: Any, **kwargs: Any) -> None:
        # In each rank, first thing: its stderr to a file of its own, so that
        # a rank that dies is reported with what it printed last.
        prefix = os.environ.get(_RANK_STDERR_ENV)
        if prefix:
            fd = os.open(_rank_stderr(prefix, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 2)
            os.close(fd)
        super()._run(rank, *args, **kwargs)

    def tearDown(self) -> None:
        self.rank_exitcodes = [p.exitcode for p in self.processes]  # cleared by tearDown
        super().tearDown()

    def setUp(self) -> None:
        super().setUp()
        if START == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def run_test(self, test_name: str, parent_pipe: Any) -> None:
        # In each rank, after init_process_group: note what answers.
        backend_type = _default_backend_type()
        calls_before = _xcomm_calls()
        if test_name == os.environ.get("XCOMM_CONFORMANCE_HANG_TEST"):
            time.sleep(10**6)  # the runner's own tests: a rank that never returns
        try:
            super().run_test(test_name, parent_pipe)
            if test_name == os.environ.get("XCOMM_CONFORMANCE_DIE_TEST") and self.rank == 0:
                # the runner's own tests: a rank that dies without a result
                print("rank 0 dies on purpose", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            if PROOF_DIR and MODE != "gloo":
                proof = {
                    "rank": self.rank,
                    "backend_type": backend_type,
                    "xcomm_calls": _xcomm_calls() - calls_before,
                }
                path = Path(PROOF_DIR) / f"{test_name}.rank{self.rank}.json"
                path.write_text(json.dumps(proof))


def all_test_names() -> list[str]:
    return sorted(n for n in dir(ConformanceCase) if n.startswith("test_"))


def _exit_text(code: int | None) -> str:
    if code is None:
        return "was still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _tail(path: Path, lines: int = 4, chars: int = 400) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [x.strip() for x in text.splitlines() if x.strip()][-lines:]
    return " | ".join(kept)[-chars:]


def ranks_without_result(
    name: str, exitcodes: list[int | None], stderr_prefix: str | None
) -> list[str]:
    """One line per rank that wrote no result: no proof file where one is due
    (xcomm modes), or an exit by a signal or with a code a rank that ran its
    test to the end (passed, failed or skipped) does not give. Each line says
    how the rank ended and what its stderr said last."""
    normal = {0, common_distributed.MultiProcessTestCase.TEST_ERROR_EXIT_CODE}
    normal |= {s.exit_code for s in common_distributed.TEST_SKIPS.values()}
    out = []
    for rank, code in enumerate(exitcodes):
        no_proof = bool(PROOF_DIR) and MODE != "gloo"
        no_proof = no_proof and not (Path(PROOF_DIR) / f"{name}.rank{rank}.json").exists()
        if not no_proof and code in normal:
            continue
        line = f"rank {rank} wrote no result: it {_exit_text(code)}"
        tail = _tail(_rank_stderr(stderr_prefix, rank)) if stderr_prefix else ""
        out.append(line + (f"; its stderr ends: {tail}" if tail else "; its stderr is empty"))
    return out


def run_one(name: str) -> dict[str, Any]:
    """Runs one test in this process (its ranks forked or spawned) and classifies it."""
    result = unittest.TestResult()
    start = time.monotonic()
    case = ConformanceCase(name)
    unittest.TestSuite([case]).run(result)
    seconds = round(time.monotonic() - start, 2)
    exitcodes = getattr(case, "rank_exitcodes", [])
    dead = ranks_without_result(name, exitcodes, os.environ.get(_RANK_STDERR_ENV))
    out: dict[str, Any] = {"status": "pass", "reason": "", "seconds": seconds}
    if result.skipped:
        out.update(status="skip", reason=str(result.skipped[0][1])[:240])
    elif result.errors or result.failures:
        text = (result.errors or result.failures)[0][1]
        print(text, flush=True)
        status = "fail"
        if re.search(r"Process \d+ terminated or timed out after", text):
            status = "timeout"
        out.update(status=status, reason=one_line_reason(text))
    elif result.unexpectedSuccesses:
        out.update(status="fail", reason="unexpected success")
    elif result.expectedFailures:
        out.update(status="pass", reason="expected failure")
    if exitcodes:
        out["rank_exits"] = exitcodes
    if dead:
        out["reason"] = "; ".join([out["reason"], *dead] if out["reason"] else dead)
    return out


def _serve() -> None:
    """Reads ``name<TAB>log<TAB>result`` lines; runs each test, output to log."""
    ready = os.environ.get("XCOMM_CONFORMANCE_READY")
    if ready:
        Path(ready).touch()
    for line in sys.stdin:
        if not line.strip():
            continue
        name, log_path, result_path = line.rstrip("\n").split("\t")
        with open(log_path, "ab", buffering=0) as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        os.environ[_RANK_STDERR_ENV] = log_path
        try:
            out = run_one(name)
        except BaseException:  # noqa: BLE001  (the runner records it; the worker goes on)
            text = traceback.format_exc()
            print(text, flush=True)
            out = {"status": "error", "reason": one_line_reason(text), "seconds": 0.0}
        sys.stdout.flush()
        sys.stderr.flush()
        for f in sorted(Path(log_path).parent.glob(Path(log_path).name + ".rank*.stderr")):
            with open(log_path, "ab") as log:  # each rank's stderr, after the test's output
                log.write(f"---- {f.name} ----\n".encode() + f.read_bytes())
            f.unlink()
        tmp = result_path + ".tmp"
        Path(tmp).write_text(json.dumps(out))
        os.replace(tmp, result_path)


def main(argv: list[str] | None = None) -> None:
    """``--list`` prints the test names as JSON; otherwise serves tests from stdin.

    Started as ``python -c "from xcomm_bench._conformance_worker import main; main()"``
    rather than with ``-m``, so that a spawned rank finds :class:`ConformanceCase`
    under this module's own name.
    """
    args = sys.argv[1:] if argv is None else argv
    if args == ["--list"]:
        print(json.dumps(all_test_names()))
    else:
        _serve()
