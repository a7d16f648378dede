"""Multi-process test harness for the xcomm torch.distributed backend.

``run_ranks(fn, world_size, ...)`` runs ``fn(ctx, *args, **kwargs)`` in
``world_size`` real processes that talk over loopback.  In every rank the
default process group uses the backend under test (``BACKEND``, taken from the
``XCOMM_TEST_BACKEND`` environment variable, default ``"xcomm"``) and
``ctx.ref`` is a reference group created with ``dist.new_group(backend="gloo")``
over the same ranks.  The list of per-rank return values comes back to the
caller; the harness

* re-raises any rank's exception (``RankError``) with that rank's traceback,
  its captured output, and the original exception chained as ``__cause__``;
* never hangs: a hard per-run timeout SIGKILLs every rank and fails with the
  Python stacks of the ranks that were stuck (dumped by ``faulthandler``);
* reports ranks that crash (signal / non-zero exit without a result) and
  ranks that return but then hang in ``destroy_process_group`` or exit.

Two launchers exist:

``"forkserver"`` (default)
    a multiprocessing forkserver with ``torch`` and what DDP and FSDP2 import
    preloaded (``FORKSERVER_PRELOAD``), so a 4-rank run costs a fraction of a
    second instead of ~4 s of imports per rank and run.  The
    function must be a module-level function of an importable module.
``"subprocess"``
    a fresh ``python`` interpreter per rank.  Slower (~3-5 s per run on 2 cores)
    but exercises real interpreter start-up and shutdown (atexit, static
    destructors of the C++ extension); used by the fault and import tests.

The module also holds the helpers shared by the test files: dtype lists,
deterministic per-rank inputs, tolerances and a mismatch collector.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

#: Backend under test.  Set ``XCOMM_TEST_BACKEND=gloo`` to develop the suite
#: against gloo (then every comparison is gloo vs gloo and must pass).
BACKEND: str = os.environ.get("XCOMM_TEST_BACKEND", "xcomm")

#: Hard wall-clock limit for one ``run_ranks`` call (seconds).
DEFAULT_RUN_TIMEOUT: float = float(os.environ.get("XCOMM_TEST_RUN_TIMEOUT", "60"))

#: Timeout given to the process groups themselves (must be < run timeout so a
#: stuck collective raises inside the rank before the harness kills it).
DEFAULT_PG_TIMEOUT = datetime.timedelta(
    seconds=float(os.environ.get("XCOMM_TEST_PG_TIMEOUT", "40"))
)

#: After the first rank fails, the others get this long to finish or fail.
FAILURE_GRACE: float = 5.0

#: After a rank wrote its result it gets this long to tear down and exit.
SHUTDOWN_GRACE: float = 20.0

Launcher = Literal["forkserver", "subprocess"]
InitMethod = Literal["file", "tcp", "env"]

IS_XCOMM: bool = BACKEND == "xcomm"


# --------------------------------------------------------------------------- #
# Per-rank context
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class RankContext:
    """What a rank function gets as its first argument."""

    rank: int
    world_size: int
    backend: str
    #: Per-run scratch directory shared by all ranks of the run.
    tmpdir: str
    #: Reference group (gloo over all ranks); ``None`` if ``ref_group=False``.
    ref: dist.ProcessGroup | None
    #: Arguments used for the default group; handy for re-initialisation.
    init_kwargs: dict[str, Any]

    @property
    def is_xcomm(self) -> bool:
        return self.backend == "xcomm"

    def generator(self, salt: int = 0, rank: int | None = None) -> torch.Generator:
        """A CPU generator seeded from (rank, salt): identical across backends.

        ``rank`` defaults to this rank; pass another rank to regenerate the
        input that rank used (for math references such as send/recv)."""
        g = torch.Generator()
        g.manual_seed(1_000_003 * (salt + 1) + 7919 * (self.rank if rank is None else rank))
        return g

    def fresh_store_path(self, name: str) -> str:
        return os.path.join(self.tmpdir, f"store_{name}")

    def signal(self, name: str) -> None:
        """Out-of-band flag (a file) other ranks can ``wait_signal`` for; used
        where the process group itself may be broken."""
        _atomic_write(os.path.join(self.tmpdir, f"signal_{name}"), b"")

    def wait_signal(self, name: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        path = os.path.join(self.tmpdir, f"signal_{name}")
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


def error_of(call: Callable[[], object]) -> str | None:
    """``"Type: message"`` of what ``call()`` raised, or None when it returned."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the caller compares messages across ranks
        return f"{type(e).__name__}: {e}"
    return None


def backend_pg_options(timeout: datetime.timedelta | None, backend: str = BACKEND) -> Any:
    """``xcomm.Options(timeout=...)`` for xcomm; ``None`` for other backends."""
    if backend != "xcomm":
        return None
    import xcomm

    return xcomm.Options(timeout=timeout)


def init_default_group(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    pg_timeout: datetime.timedelta | None,
    use_pg_options: bool,
) -> dict[str, Any]:
    """Initialise the default group; returns the kwargs that were used."""
    kwargs: dict[str, Any] = {
        "backend": backend,
        "init_method": init_method,
        "rank": rank,
        "world_size": world_size,
    }
    if use_pg_options and backend == "xcomm":
        kwargs["pg_options"] = backend_pg_options(pg_timeout, backend)
    elif pg_timeout is not None:
        kwargs["timeout"] = pg_timeout
    dist.init_process_group(**kwargs)
    return kwargs


# --------------------------------------------------------------------------- #
# Child side
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class _RunSpec:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    world_size: int
    backend: str
    tmpdir: str
    init: bool
    ref_group: bool
    init_method: str
    pg_timeout: datetime.timedelta | None
    use_pg_options: bool
    stack_dump_after: float
    destroy: bool
    env: dict[str, str]
    sys_path: list[str]


def _result_path(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"result_{rank}.pkl")


def _log_path(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"log_{rank}.txt")


def _stack_path(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"stack_{rank}.txt")


def _done_path(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"done_{rank}")


def _atomic_write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _encode_exception(exc: BaseException) -> dict[str, Any]:
    info: dict[str, Any] = {
        "ok": False,
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "pickled": None,
    }
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
        info["pickled"] = blob
    except Exception:  # noqa: BLE001, S110 - unpicklable exceptions are reported as text
        pass
    return info


def _rank_main(rank: int, spec: _RunSpec) -> None:
    """Entry point of one rank (both launchers)."""
    # Child output goes to a per-rank log file: the forkserver's inherited
    # stdio would otherwise point at whatever pytest capture was active when
    # the server started.
    log_fd = os.open(_log_path(spec.tmpdir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    stack_file = open(_stack_path(spec.tmpdir, rank), "w")  # noqa: SIM115 - kept open for faulthandler
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.dump_traceback_later(spec.stack_dump_after, exit=False, file=stack_file)
    os.environ.update({k: v.replace("{rank}", str(rank)) for k, v in spec.env.items()})
    torch.set_num_threads(1)

    result: dict[str, Any]
    try:
        if spec.backend == "xcomm":
            import xcomm  # noqa: F401 - registers the backend
        init_kwargs: dict[str, Any] = {}
        ref: dist.ProcessGroup | None = None
        if spec.init:
            init_kwargs = init_default_group(
                rank,
                spec.world_size,
                spec.backend,
                spec.init_method,
                spec.pg_timeout,
                spec.use_pg_options,
            )
            if dist.get_backend() != spec.backend:
                raise AssertionError(
                    f"default group backend is {dist.get_backend()!r}, expected {spec.backend!r}"
                )
            if spec.ref_group:
                ref = dist.new_group(backend="gloo", timeout=spec.pg_timeout)
        ctx = RankContext(
            rank=rank,
            world_size=spec.world_size,
            backend=spec.backend,
            tmpdir=spec.tmpdir,
            ref=ref,
            init_kwargs=init_kwargs,
        )
        value = spec.fn(ctx, *spec.args, **spec.kwargs)
        result = {"ok": True, "value": value}
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        result = _encode_exception(exc)
    try:
        blob = pickle.dumps(result)
    except Exception as exc:  # noqa: BLE001
        blob = pickle.dumps(_encode_exception(exc))
    _atomic_write(_result_path(spec.tmpdir, rank), blob)

    if spec.destroy and dist.is_initialized():
        dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    _atomic_write(_done_path(spec.tmpdir, rank), b"")
    sys.stdout.flush()
    sys.stderr.flush()


def _subprocess_entry() -> None:
    """``python -c 'import dist_harness; dist_harness._subprocess_entry()' SPEC RANK``."""
    spec_path, rank = sys.argv[1], int(sys.argv[2])
    with open(spec_path, "rb") as f:
        sys.path[:0] = pickle.load(f)  # sys.path first: unpickling the spec needs it
        spec: _RunSpec = pickle.load(f)
    _rank_main(rank, spec)


# --------------------------------------------------------------------------- #
# Parent side
# --------------------------------------------------------------------------- #


class RankError(AssertionError):
    """One or more ranks failed, crashed or hung."""


_FORKSERVER_CTX: multiprocessing.context.ForkServerContext | None = None

#: Imported once by the forkserver, so every forked rank has them for free.
#: Beyond torch itself: what DistributedDataParallel's constructor and
#: fully_shard import on first use (torch._dynamo pulls in sympy and inductor):
#: 1.6 s of one core per rank on this machine, paid by every rank of every
#: test that builds a DDP or FSDP2 model. They start no thread (the forked
#: children need none they do not make themselves).
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.testing",
    "torch._dynamo",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.algorithms.ddp_comm_hooks",
]


def _forkserver() -> multiprocessing.context.ForkServerContext:
    global _FORKSERVER_CTX
    if _FORKSERVER_CTX is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        _FORKSERVER_CTX = ctx
    return _FORKSERVER_CTX


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Proc:
    """Uniform view of a forkserver Process or a subprocess.Popen."""

    def __init__(self, handle: multiprocessing.process.BaseProcess | subprocess.Popen[bytes]):
        self.handle = handle

    @property
    def pid(self) -> int | None:
        return self.handle.pid

    def exitcode(self) -> int | None:
        if isinstance(self.handle, subprocess.Popen):
            return self.handle.poll()
        return self.handle.exitcode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            if self.pid is not None and self.exitcode() is None:
                os.kill(self.pid, signal.SIGKILL)

    def reap(self) -> None:
        if isinstance(self.handle, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.handle.wait(timeout=10)
        else:
            self.handle.join(timeout=10)


def _read_text(path: str, limit: int = 6000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    if len(text) > limit:
        text = "...[truncated]...\n" + text[-limit:]
    return text


def _signal_name(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    init: bool = True,
    ref_group: bool = True,
    backend: str | None = None,
    init_method: InitMethod = "file",
    pg_timeout: datetime.timedelta | None = DEFAULT_PG_TIMEOUT,
    use_pg_options: bool = False,
    launcher: Launcher = "forkserver",
    may_die: Sequence[int] = (),
    destroy: bool = True,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks; see module doc.

    ``may_die`` lists ranks that are expected to die without a result (fault
    injection); their entries in the returned list are ``None``.  Every other
    rank must return, tear down and exit with code 0.

    ``env`` is set in every rank before anything else runs there; ``{rank}``
    in a value becomes the rank (``{"NCCL_HOSTID": "host-{rank}"}``).
    """
    backend = backend or BACKEND
    timeout = timeout if timeout is not None else DEFAULT_RUN_TIMEOUT
    tmpdir = tempfile.mkdtemp(prefix=f"xcomm_test_ws{world_size}_")
    env = dict(env or {})
    if init_method == "file":
        method = "file://" + os.path.join(tmpdir, "store_default")
    elif init_method == "tcp":
        method = f"tcp://127.0.0.1:{free_port()}"
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        method = "env://"
    spec = _RunSpec(
        fn=fn,
        args=args,
        kwargs=kwargs,
        world_size=world_size,
        backend=backend,
        tmpdir=tmpdir,
        init=init,
        ref_group=ref_group,
        init_method=method,
        pg_timeout=pg_timeout,
        use_pg_options=use_pg_options,
        stack_dump_after=max(1.0, timeout - 3.0),
        destroy=destroy,
        env=env,
        sys_path=list(sys.path),
    )
    procs: list[_Proc] = []
    start = time.monotonic()
    try:
        procs = _launch(spec, launcher)
        return _supervise(procs, spec, timeout, start, set(may_die))
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.reap()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _launch(spec: _RunSpec, launcher: Launcher) -> list[_Proc]:
    procs: list[_Proc] = []
    if launcher == "forkserver":
        ctx = _forkserver()
        for rank in range(spec.world_size):
            p = ctx.Process(target=_rank_main, args=(rank, spec), name=f"rank{rank}", daemon=True)
            p.start()
            procs.append(_Proc(p))
        return procs
    spec_path = os.path.join(spec.tmpdir, "spec.pkl")
    with open(spec_path, "wb") as f:
        f.write(pickle.dumps(spec.sys_path))
        pickle.dump(spec, f)
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path.insert(0, {here!r}); "
        "import dist_harness; dist_harness._subprocess_entry()"
    )
    child_env = {**os.environ, **spec.env, "XCOMM_TEST_BACKEND": spec.backend}
    for rank in range(spec.world_size):
        with open(_log_path(spec.tmpdir, rank), "ab") as log:
            popen = subprocess.Popen(
                [sys.executable, "-c", code, spec_path, str(rank)],
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append(_Proc(popen))
    return procs


def _supervise(
    procs: list[_Proc], spec: _RunSpec, timeout: float, start: float, may_die: set[int]
) -> list[Any]:
    n = spec.world_size
    results: dict[int, dict[str, Any]] = {}
    result_time: dict[int, float] = {}
    deadline = start + timeout
    timed_out = False

    def read_results(now: float) -> None:
        nonlocal deadline
        for r in range(n):
            if r not in results and os.path.exists(_result_path(spec.tmpdir, r)):
                with open(_result_path(spec.tmpdir, r), "rb") as f:
                    results[r] = pickle.load(f)
                result_time[r] = now
                if not results[r]["ok"]:
                    deadline = min(deadline, now + FAILURE_GRACE)

    while True:
        now = time.monotonic()
        read_results(now)
        exited = [p.exitcode() is not None for p in procs]
        for r in range(n):
            code = procs[r].exitcode()
            if code not in (None, 0) and r not in results and r not in may_die:
                deadline = min(deadline, now + FAILURE_GRACE)
        if all(exited):
            break
        if may_die and all(exited[r] for r in range(n) if r not in may_die):
            break  # only ranks allowed to die (e.g. a stopped victim) are left
        # A rank that returned its value gets SHUTDOWN_GRACE to exit.
        for r, t in result_time.items():
            if procs[r].exitcode() is None and now - t > SHUTDOWN_GRACE:
                deadline = min(deadline, now)
        if now >= deadline:
            timed_out = True
            break
        time.sleep(0.02)
    # A rank may write its result and exit between the read above and the
    # exit check: read once more, or it would count as dead without one.
    read_results(time.monotonic())

    # Let faulthandler-less ranks die; capture stacks of the stuck ones first.
    stuck = [r for r in range(n) if procs[r].exitcode() is None and r not in may_die]
    for r in may_die:
        procs[r].kill()
    if stuck:
        for r in stuck:
            pid = procs[r].pid
            if pid is not None:
                # SIGABRT makes faulthandler dump every thread's Python stack.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGABRT)
        time.sleep(0.5)
        for p in procs:
            p.kill()
        for p in procs:
            p.reap()

    problems: list[str] = []
    cause: BaseException | None = None
    elapsed = time.monotonic() - start
    for r in range(n):
        res = results.get(r)
        code = procs[r].exitcode()
        if res is not None and not res["ok"]:
            problems.append(
                f"--- rank {r} raised {res['type']}: {res['message']}\n{res['traceback']}"
            )
            if cause is None and res["pickled"] is not None:
                with contextlib.suppress(Exception):
                    cause = pickle.loads(res["pickled"])
        elif res is None and r not in may_die:
            if r in stuck:
                problems.append(f"--- rank {r} HUNG (no result after {elapsed:.1f}s, killed)")
            else:
                problems.append(f"--- rank {r} died without a result ({_signal_name(code or 0)})")
        elif res is not None and r in stuck:
            problems.append(
                f"--- rank {r} returned but HUNG during teardown "
                "(destroy_process_group / exit); killed"
            )
        elif (
            res is not None
            and code not in (0, None)
            and not os.path.exists(_done_path(spec.tmpdir, r))
        ):
            problems.append(
                f"--- rank {r} returned but crashed during teardown ({_signal_name(code)})"
            )
        elif res is not None and code not in (0, None):
            problems.append(f"--- rank {r} exited with {_signal_name(code)} after returning")
    if problems:
        details: list[str] = []
        for r in range(n):
            log = _read_text(_log_path(spec.tmpdir, r))
            stack = _read_text(_stack_path(spec.tmpdir, r)) if r in stuck or timed_out else ""
            if log.strip():
                details.append(f"--- rank {r} output:\n{log}")
            if stack.strip():
                details.append(f"--- rank {r} python stacks:\n{stack}")
        header = (
            f"{len(problems)} rank problem(s) in {spec.fn.__module__}.{spec.fn.__qualname__} "
            f"(world_size={n}, backend={spec.backend}, elapsed={elapsed:.1f}s"
            f"{', TIMED OUT' if timed_out else ''})"
        )
        raise RankError("\n".join([header, *problems, *details])) from cause
    return [results[r]["value"] if r in results else None for r in range(n)]


def run_program(args: list[str], cwd: str, timeout: float, label: str) -> str:
    """Runs ``python ARGS`` as a program that launches its own ranks (in a
    session of its own, killed whole if it hangs), without the launcher
    variables of this process; fails the test unless it exits 0. Its log.

    A hung program's processes get SIGABRT first: with ``faulthandler`` on
    (``PYTHONFAULTHANDLER``, inherited by every rank it starts) each prints
    every thread's Python stack into the log the failure shows."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
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
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            log, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a rank that outlived its launcher
        import pytest

        pytest.fail(f"{label} hung; its stacks at the kill:\n{log.decode()[-20000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.decode(errors="replace")
    assert proc.returncode == 0, f"{label} failed:\n{text[-6000:]}"
    return text


@contextlib.contextmanager
def rank_scripts(
    script: str | os.PathLike[str], args_per_rank: Sequence[Sequence[str]]
) -> Iterator[list[subprocess.Popen[str]]]:
    """One fresh interpreter per rank running ``script`` with its arguments
    (stdout and stderr together, as text; this process's ``sys.path`` as
    ``PYTHONPATH``), for tests that signal or time a rank from outside.
    Any still running when the block ends is killed.

    Example::

        with rank_scripts(path, [[store, "0"], [store, "1"]]) as ranks:
            out, _ = ranks[1].communicate(timeout=60)
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for args in args_per_rank
    ]
    try:
        yield ranks
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()


# --------------------------------------------------------------------------- #
# Shared helpers for the tests (used inside ranks)
# --------------------------------------------------------------------------- #


class DelegatingStore(dist.Store):
    """A store that passes every call to ``inner``: a test's store that
    changes one thing (a value read back, a delay) subclasses it and
    overrides only that.

    Example::

        class Slow(DelegatingStore):
            def get(self, key: str) -> bytes:
                time.sleep(1.0)
                return super().get(key)
    """

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner

    def set(self, key: str, value: bytes | str) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    # c10d's trampoline calls the C++ name (a ``delete_key`` here would never run).
    def deleteKey(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def num_keys(self) -> int:
        return self.inner.num_keys()


WORLD_SIZES: tuple[int, ...] = (1, 2, 3, 4)

FLOAT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
)
INT_DTYPES: tuple[torch.dtype, ...] = (torch.int8, torch.uint8, torch.int32, torch.int64)
ALL_DTYPES: tuple[torch.dtype, ...] = (*FLOAT_DTYPES, *INT_DTYPES, torch.bool)

R = dist.ReduceOp
#: name -> ReduceOp for the ops every backend is expected to implement.
BASIC_OPS: dict[str, Any] = {
    "SUM": R.SUM,
    "AVG": R.AVG,
    "PRODUCT": R.PRODUCT,
    "MIN": R.MIN,
    "MAX": R.MAX,
    "BAND": R.BAND,
    "BOR": R.BOR,
    "BXOR": R.BXOR,
}
BITWISE_OPS: frozenset[str] = frozenset({"BAND", "BOR", "BXOR"})


def make_input(
    ctx: RankContext,
    dtype: torch.dtype,
    shape: Sequence[int],
    salt: int = 0,
    *,
    small: bool = False,
    rank: int | None = None,
) -> torch.Tensor:
    """Deterministic per-rank input.

    Floats are ``randn`` (scaled down with ``small=True`` so products stay in
    range); integers are random in a range that avoids overflow of SUM over
    four ranks for int8 and keeps PRODUCT wrap-around deterministic (integer
    wrap-around is exact anyway, so any value range is comparable bitwise).
    """
    g = ctx.generator(salt, rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    if dtype.is_floating_point:
        t = torch.randn(tuple(shape), generator=g, dtype=torch.float64)
        if small:
            t = 0.5 + t.abs().clamp(max=2.0) / 2  # in [0.5, 1.5]: products of 4 stay tame
            t = t * torch.where(torch.rand(tuple(shape), generator=g) < 0.5, -1.0, 1.0).to(t)
        return t.to(dtype)
    lo, hi = (0, 30) if dtype == torch.uint8 else (-30, 30)
    return torch.randint(lo, hi, tuple(shape), generator=g, dtype=torch.int64).to(dtype)


def tolerances(dtype: torch.dtype, n_terms: int) -> tuple[float, float]:
    """(rtol, atol) allowing for any summation order of ``n_terms`` values."""
    if not dtype.is_floating_point:
        return 0.0, 0.0
    eps = torch.finfo(dtype).eps
    k = max(2, n_terms + 1)
    return 2 * k * eps, 8 * k * eps


def describe_mismatch(
    label: str, got: torch.Tensor, expected: torch.Tensor, n_terms: int
) -> str | None:
    """``None`` if ``got`` matches ``expected`` (bitwise for ints/bool), else a
    one-paragraph description of the difference."""
    if not isinstance(got, torch.Tensor):
        return f"{label}: expected a tensor, got {type(got).__name__}: {got!r}"
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return (
            f"{label}: dtype/shape mismatch: got {got.dtype}{tuple(got.shape)}, "
            f"expected {expected.dtype}{tuple(expected.shape)}"
        )
    rtol, atol = tolerances(expected.dtype, n_terms)
    try:
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        flat_g, flat_e = got.flatten(), expected.flatten()
        shown = min(8, flat_g.numel())
        return (
            f"{label}: {str(e).strip()}\n    got[:{shown}]={flat_g[:shown].tolist()}\n"
            f"    expected[:{shown}]={flat_e[:shown].tolist()}"
        )
    return None


class Mismatches:
    """Collects per-case failures inside a rank so one spawn reports them all."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.items: list[str] = []

    def compare(
        self, label: str, got: torch.Tensor, expected: torch.Tensor, n_terms: int = 0
    ) -> None:
        msg = describe_mismatch(
            f"[rank {self.ctx.rank}/{self.ctx.world_size}] {label}",
            got,
            expected,
            n_terms or self.ctx.world_size,
        )
        if msg is not None:
            self.items.append(msg)

    def fail(self, label: str, why: str) -> None:
        self.items.append(f"[rank {self.ctx.rank}/{self.ctx.world_size}] {label}: {why}")

    @contextlib.contextmanager
    def case(self, label: str) -> Iterator[None]:
        """Record (instead of propagate) an unexpected exception of one case."""
        try:
            yield
        except Exception as e:  # noqa: BLE001
            tb = traceback.format_exc(limit=-3)
            self.fail(label, f"unexpected {type(e).__name__}: {e}\n{tb}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def try_run(fn: Callable[[], T]) -> tuple[bool, T | BaseException]:
    """(True, value) or (False, exception)."""
    try:
        return True, fn()
    except Exception as e:  # noqa: BLE001
        return False, e


def assert_no_mismatches(per_rank: Sequence[Sequence[str]]) -> None:
    """Flatten the per-rank mismatch lists and fail listing every one."""
    flat = [m for ranks in per_rank for m in ranks]
    if flat:
        shown = flat[:60]
        more = f"\n... and {len(flat) - len(shown)} more" if len(flat) > len(shown) else ""
        raise AssertionError(
            f"{len(flat)} mismatch(es) between {BACKEND} and the reference:\n"
            + "\n".join(shown)
            + more
        )


# --------------------------------------------------------------------------- #
# Reference comparison of one collective call (used inside ranks)
# --------------------------------------------------------------------------- #

Outputs = list[torch.Tensor]
#: ``case(group, async_op) -> (work_or_None, outputs)``.  A case builds fresh,
#: deterministic inputs on every call, runs one operation on ``group`` and
#: returns the tensors whose contents are compared.
CaseFn = Callable[[dist.ProcessGroup | None, bool], tuple[Any, Outputs]]

Mode = Literal["sync", "async", "future"]
MODES: tuple[Mode, ...] = ("sync", "async", "future")


def execute(case: CaseFn, group: dist.ProcessGroup | None, mode: Mode) -> tuple[Outputs, Any]:
    """Run ``case`` in ``mode``: ``sync`` (async_op=False), ``async``
    (async_op=True then ``work.wait()``) or ``future`` (async_op=True then
    ``work.get_future().wait()``).  Returns (outputs, future value or None)."""
    work, outputs = case(group, mode != "sync")
    if mode == "sync":
        return outputs, None
    if work is None:
        raise AssertionError("async_op=True returned None instead of a Work")
    if mode == "async":
        ret = work.wait()
        if ret is not True:
            raise AssertionError(f"work.wait() returned {ret!r}, expected True")
        return outputs, None
    return outputs, work.get_future().wait()


def _short_exc(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


class Checker(Mismatches):
    """Runs cases on the group under test and on the gloo reference group and
    records every difference.

    * reference raises  -> the backend under test must raise too;
    * reference passes  -> the backend under test must give the same outputs
      (bitwise for integer/bool, ``tolerances`` for floating point) and, in
      ``future`` mode, a future value equal to the reference's future value.
    """

    def __init__(
        self,
        ctx: RankContext,
        group: dist.ProcessGroup | None = None,
        ref_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(ctx)
        self.group = group
        self.ref_group = ref_group if ref_group is not None else ctx.ref
        self.cases = 0
        #: Labels of the cases the reference rejected (for self-checks).
        self.rejected: list[str] = []

    def run(
        self,
        label: str,
        case: CaseFn,
        *,
        ref_case: CaseFn | None = None,
        modes: Sequence[Mode] = MODES,
        n_terms: int | None = None,
    ) -> None:
        ref_case = ref_case or case
        n = n_terms or self.ctx.world_size
        for mode in modes:
            self.cases += 1
            lab = f"{label} [{mode}]"
            ok_ref, ref_res = try_run(lambda m=mode: execute(ref_case, self.ref_group, m))
            ok, res = try_run(lambda m=mode: execute(case, self.group, m))
            if not ok_ref:
                self.rejected.append(lab)
                if ok:
                    self.fail(
                        lab,
                        f"gloo rejects this ({_short_exc(ref_res)}) but {self.ctx.backend} "
                        "accepted it without an exception",
                    )
                continue
            if not ok:
                self.fail(lab, f"gloo accepts this but {self.ctx.backend} raised {_short_exc(res)}")  # type: ignore[arg-type]
                continue
            (ref_out, ref_fut), (out, fut) = ref_res, res  # type: ignore[misc]
            self._compare_lists(lab, out, ref_out, n)
            if mode == "future":
                self._compare_future(lab, fut, ref_fut, n)

    def expect(
        self,
        label: str,
        case: CaseFn,
        expected: Outputs,
        *,
        modes: Sequence[Mode] = MODES,
        n_terms: int | None = None,
        may_raise_match: str | None = None,
    ) -> None:
        """Compare with a mathematical reference instead of gloo.

        With ``may_raise_match`` (a regex, matched case-insensitively) the
        backend may instead raise an exception whose message matches it."""
        n = n_terms or self.ctx.world_size
        for mode in modes:
            self.cases += 1
            lab = f"{label} [{mode}]"
            ok, res = try_run(lambda m=mode: execute(case, self.group, m))
            if not ok:
                msg = str(res)
                if may_raise_match is None:
                    self.fail(lab, f"raised {_short_exc(res)}")  # type: ignore[arg-type]
                elif not re.search(may_raise_match, msg, re.IGNORECASE):
                    self.fail(
                        lab,
                        f"raised, but the message does not match /{may_raise_match}/i: "
                        f"{_short_exc(res)}",  # type: ignore[arg-type]
                    )
                continue
            out, _ = res  # type: ignore[misc]
            self._compare_lists(lab, out, expected, n)

    def _compare_lists(self, lab: str, out: Outputs, ref: Outputs, n: int) -> None:
        if len(out) != len(ref):
            self.fail(lab, f"got {len(out)} outputs, expected {len(ref)}")
            return
        for i, (o, r) in enumerate(zip(out, ref, strict=True)):
            self.compare(f"{lab} output[{i}]", o, r, n)

    def _compare_future(self, lab: str, fut: Any, ref_fut: Any, n: int) -> None:
        if not isinstance(ref_fut, list):
            return  # nothing to compare against
        if not isinstance(fut, list) or not all(isinstance(t, torch.Tensor) for t in fut):
            self.fail(
                lab,
                f"get_future().wait() returned {type(fut).__name__} ({fut!r:.200}), "
                f"expected a list of {len(ref_fut)} tensor(s) like gloo",
            )
            return
        if len(fut) != len(ref_fut):
            self.fail(lab, f"future value has {len(fut)} tensors, gloo's has {len(ref_fut)}")
            return
        for i, (o, r) in enumerate(zip(fut, ref_fut, strict=True)):
            self.compare(f"{lab} future[{i}]", o, r, n)


def world_size_params(sizes: Sequence[int] = WORLD_SIZES) -> list[Any]:
    """``pytest.param`` per world size; sizes > 2 carry the ``large_world``
    marker (still run by default; ``-m 'not large_world'`` for a quick pass)."""
    import pytest

    return [
        pytest.param(ws, id=f"ws{ws}", marks=[pytest.mark.large_world] if ws > 2 else [])
        for ws in sizes
    ]
