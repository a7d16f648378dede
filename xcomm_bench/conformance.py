"""torch's own DistributedTest suite against xcomm, with gloo as the reference.

The suite is ``torch.testing._internal.distributed.distributed_test``, shipped
in the torch wheel (it needs ``expecttest``); torch drives it from
``test/distributed/test_distributed_spawn.py`` with the environment
variables ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR`` and ``INIT_METHOD``. This
runner does the same, one test at a time, in three modes:

- ``gloo``: the reference (xcomm is not imported).
- ``xcomm``: ``BACKEND=xcomm``. The suite sees the name ``xcomm``, so the
  tests it keeps for gloo skip; the skips are recorded with their reasons.
- ``standin``: ``BACKEND=gloo``, but every group the suite asks gloo for is
  an xcomm group (see :func:`xcomm_bench._conformance_worker.install_standin`).
  Each rank records the type of the default group's CPU backend and the ops
  ``xcomm.stats()`` counted in the test: the run's ``proof``, printed at the end,
  says whether xcomm really answered (``XcommBackend`` on every rank of every
  test that ran, and ops counted).

Every test gets a hard timeout: the worker process that runs the tests is
started in its own session and killed with all its ranks when a test runs
over; the next test gets a fresh worker. Results (pass / fail / skip /
timeout / error, a one-line reason, seconds) go to a JSON file, merged with
what it already holds, so the suite can be run in chunks (``-k``,
``--shard``, ``--resume``). Each test's full output is in ``--log-dir``.

Examples::

    python -m xcomm_bench.conformance --mode gloo --list
    python -m xcomm_bench.conformance --mode standin -k 'test_all_reduce_sum'
    python -m xcomm_bench.conformance --mode xcomm --shard 1/4 --resume
    python -m xcomm_bench.conformance --compare bench-results/conformance/{gloo,xcomm,standin}.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .launch import REPO, python_env

__all__ = [
    "MODES",
    "STATUSES",
    "compare_markdown",
    "list_tests",
    "load_results",
    "main",
    "one_line_reason",
    "proof",
    "run_tests",
]

MODES = ("gloo", "xcomm", "standin")
STATUSES = ("pass", "fail", "skip", "timeout", "error")
#: The CPU backend object an xcomm group has (``xcomm._C.XcommBackend``).
XCOMM_BACKEND_TYPE = "XcommBackend"
DEFAULT_OUT_DIR = REPO / "bench-results" / "conformance"
_WORKER_CODE = "from xcomm_bench._conformance_worker import main; main()"


def _worker_env(
    mode: str, world_size: int, start: str, timeout: float, tmp: Path, profiler_names: bool = True
) -> dict[str, str]:
    temp_dir = tmp / "temp"
    (temp_dir / "barrier").mkdir(parents=True, exist_ok=True)
    env = python_env()
    env.update(
        XCOMM_CONFORMANCE_MODE=mode,
        XCOMM_CONFORMANCE_START=start,
        XCOMM_CONFORMANCE_PROFILER_NAMES="1" if profiler_names else "0",
        XCOMM_CONFORMANCE_PROOF_DIR=str(tmp / "proof"),
        WORLD_SIZE=str(world_size),
        TEMP_DIR=str(temp_dir),
        # As torch's run_test.py does for its file-init run: the tests that
        # re-initialize the default group need a file:// init method.
        INIT_METHOD=f"file://{temp_dir}/shared_init_file",
        # torch's own per-test timeout fires first and logs the ranks' stacks.
        DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(max(10, int(timeout) - 15)),
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    return env


_EXC_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Failure|Interrupt|Timeout)\w*)(:|$)"
)
_WRAPPER = re.compile(r"^RuntimeError: Process \d+ exited with error code")


_SUITE_FRAME = re.compile(r'File ".*/(distributed_test\.py)", line (\d+), in (\w+)')


def one_line_reason(text: str) -> str:
    """One line from a traceback text: the innermost exception (a rank's, not
    torch's 'Process N exited with error code' wrapper), the next line of its
    message when the first says little (``Scalars are not equal!``), and
    where in the suite it was raised (``distributed_test.py:LINE: code``)."""
    lines = text.splitlines()
    at = None
    for i in range(len(lines) - 1, -1, -1):
        s = lines[i].strip()
        if _EXC_LINE.match(s) and not _WRAPPER.match(s):
            at = i
            break
    if at is None:
        rest = [
            x.strip()
            for x in lines
            if x.strip() and not x.startswith(("To execute", "This message"))
        ]
        return rest[-1][:300] if rest else ""
    reason = lines[at].strip()
    if len(reason.split(":", 1)[-1].strip()) < 40:
        for nxt in lines[at + 1 : at + 4]:
            nxt = nxt.strip()
            if nxt and not nxt.startswith(("To execute", "Traceback")):
                reason += " " + nxt
                break
    for j in range(at - 1, -1, -1):
        m = _SUITE_FRAME.search(lines[j])
        if m:
            code = lines[j + 1].strip() if j + 1 < at else ""
            reason += f" [{m.group(1)}:{m.group(2)} {m.group(3)}: {code}]"
            break
    return reason[:300]


def list_tests(pattern: str | None = None, names: Sequence[str] | None = None) -> list[str]:
    """The suite's test names (sorted), those matching the regex ``pattern``
    (searched, like ``pytest -k`` on one name) and, if given, in ``names``."""
    with tempfile.TemporaryDirectory(prefix="xcomm-conf-") as tmp:
        env = _worker_env("gloo", 2, "fork", 60, Path(tmp))
        out = subprocess.run(
            [sys.executable, "-c", _WORKER_CODE, "--list"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            cwd=REPO,
        ).stdout
    every = json.loads(out.strip().splitlines()[-1])
    chosen = [n for n in every if pattern is None or re.search(pattern, n)]
    if names is not None:
        unknown = sorted(set(names) - set(every))
        if unknown:
            raise ValueError(f"not tests of the suite: {', '.join(unknown)}")
        chosen = [n for n in chosen if n in set(names)]
    return chosen


class _Worker:
    """One worker process (its own session: killing it kills its ranks too)."""

    def __init__(self, env: dict[str, str], tmp: Path, log_dir: Path) -> None:
        ready = tmp / "ready"
        ready.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE],
            env={**env, "XCOMM_CONFORMANCE_READY": str(ready)},
            stdin=subprocess.PIPE,
            stdout=open(log_dir / "_worker.log", "ab"),  # noqa: SIM115 (closed with the process)
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,
            text=True,
        )
        deadline = time.monotonic() + 300
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"the conformance worker did not start; see {log_dir}/_worker.log"
                )
            time.sleep(0.05)

    def run(self, name: str, log: Path, result: Path, timeout: float) -> dict[str, Any]:
        result.unlink(missing_ok=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{name}\t{log}\t{result}\n")
        self.proc.stdin.flush()
        start = time.monotonic()
        while True:
            if result.exists():
                return json.loads(result.read_text())
            elapsed = time.monotonic() - start
            code = self.proc.poll()
            if code is not None:
                return {
                    "status": "error",
                    "reason": f"worker exited with {code}",
                    "seconds": round(elapsed, 2),
                }
            if elapsed > timeout:
                self.kill()
                reason = f"hard timeout: still running after {timeout:g}s, killed"
                return {
                    "status": "timeout",
                    "reason": reason,
                    "seconds": round(elapsed, 2),
                    "killed_session": self.proc.pid,
                }
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()  # also reaps anything left in its session


def _read_proof(proof_dir: Path, name: str) -> dict[str, Any] | None:
    files = sorted(proof_dir.glob(f"{name}.rank*.json"))
    if not files:
        return None
    ranks = [json.loads(f.read_text()) for f in files]
    for f in files:
        f.unlink()
    return {
        "backend_types": sorted({r["backend_type"] for r in ranks}),
        "xcomm_calls": sum(int(r["xcomm_calls"]) for r in ranks),
        "ranks": len(ranks),
    }


def run_tests(
    mode: str,
    names: Iterable[str],
    *,
    timeout: float = 120.0,
    world_size: int = 2,
    start: str = "fork",
    log_dir: Path | None = None,
    progress: bool = True,
    profiler_names: bool = True,
    on_result: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Runs each test in ``mode``; returns ``{name: record}``.

    A record has ``status`` (one of :data:`STATUSES`), ``reason`` (one line;
    the skip reason or the innermost exception), ``seconds`` and, in the
    ``xcomm``/``standin`` modes when ranks ran, ``backend_types`` (the default
    group's CPU backend type on the ranks) and ``xcomm_calls`` (ops counted by
    ``xcomm.stats()`` during the test, all ranks). ``profiler_names=False``
    skips the suite's checks of profiler event names (``<backend>:<op>``,
    once per op) and runs the rest of those tests. ``on_result(name, record)``
    is called after each test (the command line saves the file there, so a
    chunk cut short keeps what it ran).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    names = list(names)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="xcomm-conf-") as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "proof").mkdir()
        logs = Path(log_dir) if log_dir is not None else tmp / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = _worker_env(mode, world_size, start, timeout, tmp, profiler_names)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(names), desc=f"conformance[{mode}]", unit="test", file=sys.stderr)
        counts: Counter[str] = Counter()
        worker: _Worker | None = None
        try:
            for name in names:
                if worker is None or not worker.alive():
                    worker = _Worker(env, tmp, logs)
                log = logs / f"{name}.log"
                log.unlink(missing_ok=True)
                record = worker.run(name, log, tmp / "result.json", timeout)
                if record["status"] == "timeout" and worker.alive():
                    worker.kill()
                if not worker.alive():
                    worker = None
                proof_rec = _read_proof(tmp / "proof", name)
                if proof_rec is not None:
                    record.update(proof_rec)
                results[name] = record
                if on_result is not None:
                    on_result(name, record)
                counts[record["status"]] += 1
                if bar is not None:
                    bar.set_postfix({s: counts[s] for s in STATUSES if counts[s]}, refresh=False)
                    bar.update(1)
        finally:
            if worker is not None:
                worker.close()
            if bar is not None:
                bar.close()
    return results


def proof(mode: str, tests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Did xcomm really answer? For the ``xcomm``/``standin`` modes: the tests
    whose ranks ran, how many had ``XcommBackend`` as the default group's CPU
    backend on every rank, which did not, and the ops xcomm counted.
    ``ok`` is true when at least one test ran, every test that ran did so on
    xcomm, and xcomm counted ops."""
    if mode == "gloo":
        return {"ok": True, "note": "reference run; xcomm not imported"}
    ran = {n: r for n, r in tests.items() if "backend_types" in r}
    on_xcomm = [n for n, r in ran.items() if r["backend_types"] == [XCOMM_BACKEND_TYPE]]
    not_xcomm = sorted(set(ran) - set(on_xcomm))
    calls = sum(int(r.get("xcomm_calls", 0)) for r in ran.values())
    return {
        "ok": bool(ran) and not not_xcomm and calls > 0,
        "tests_with_ranks": len(ran),
        "tests_on_xcomm_backend": len(on_xcomm),
        "tests_not_on_xcomm": not_xcomm,
        "tests_with_xcomm_ops": sum(1 for r in ran.values() if int(r.get("xcomm_calls", 0)) > 0),
        "xcomm_ops": calls,
    }


def load_results(path: Path) -> dict[str, Any]:
    """A results file, or an empty one."""
    if Path(path).exists():
        return json.loads(Path(path).read_text())
    return {"tests": {}}


def _summary(data: dict[str, Any]) -> dict[str, int]:
    c = Counter(r["status"] for r in data["tests"].values())
    return {s: c[s] for s in STATUSES} | {"total": sum(c.values())}


def _torch_version() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip()


def _git_head() -> str:
    """HEAD, plus ``+dirty`` when csrc/ or python/ differ from it (the built
    extension may then hold uncommitted code)."""

    def git(*a: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO), *a], capture_output=True, text=True, check=False
        ).stdout

    head = git("rev-parse", "--short", "HEAD").strip()
    return head + ("+dirty" if git("status", "--porcelain", "--", "csrc", "python").strip() else "")


def _proof_line(mode: str, p: dict[str, Any]) -> str:
    if mode == "gloo":
        return "proof: reference run (gloo; xcomm not imported)"
    verdict = "OK" if p["ok"] else "FAILED"
    return (
        f"proof [{verdict}]: {p['tests_on_xcomm_backend']} of {p['tests_with_ranks']} tests whose ranks ran "
        f"had {XCOMM_BACKEND_TYPE} as the default group's CPU backend on every rank; "
        f"{p['tests_with_xcomm_ops']} counted xcomm ops ({p['xcomm_ops']} ops in all)"
        + (
            f"; NOT on xcomm: {', '.join(p['tests_not_on_xcomm'][:10])}"
            if p["tests_not_on_xcomm"]
            else ""
        )
    )


def compare_markdown(files: Sequence[Path]) -> str:
    """Counts per results file and, against the ``gloo`` file, every test gloo
    passes that another mode does not (with its reason), and the tests the
    ``xcomm`` mode skips that gloo runs."""
    data = {}
    for f in files:
        d = load_results(Path(f))
        data[d.get("label") or d.get("mode") or Path(f).stem] = d
    lines = [
        "| mode | total | pass | fail | skip | timeout | error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, d in data.items():
        s = _summary(d)
        lines.append(f"| {mode} | {s['total']} | " + " | ".join(str(s[k]) for k in STATUSES) + " |")
    gloo = next((d for d in data.values() if d.get("mode") == "gloo"), None)
    if gloo is None:
        return "\n".join(lines)
    for mode, d in data.items():
        if d is gloo:
            continue
        common = sorted(set(gloo["tests"]) & set(d["tests"]))
        lost = [
            n
            for n in common
            if gloo["tests"][n]["status"] == "pass" and d["tests"][n]["status"] not in ("pass",)
        ]
        lines += [
            "",
            f"### gloo passes, {mode} does not ({len(lost)} of {len(common)} run in both)",
            "",
        ]
        for n in lost:
            r = d["tests"][n]
            reason = r["reason"].replace("|", "\\|")
            lines.append(f"- `{n}`: {r['status']}: {reason}")
        gained = [
            n
            for n in common
            if gloo["tests"][n]["status"] != "pass" and d["tests"][n]["status"] == "pass"
        ]
        if gained:
            lines += [
                "",
                f"{mode} passes where gloo does not: " + ", ".join(f"`{n}`" for n in gained),
            ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m xcomm_bench.conformance", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--mode", choices=MODES, help="who answers: gloo (reference), xcomm (by name), standin"
    )
    p.add_argument("-k", dest="pattern", help="only tests whose name matches this regex")
    p.add_argument("--tests", help="comma-separated test names")
    p.add_argument("--shard", help="I/N: run the I-th of N interleaved slices of the chosen tests")
    p.add_argument("--list", action="store_true", help="print the chosen test names and exit")
    p.add_argument("--timeout", type=float, default=120.0, help="hard per-test timeout in seconds")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--start", choices=("fork", "spawn"), default="fork", help="how the ranks start")
    p.add_argument(
        "--out", type=Path, help="results JSON (default bench-results/conformance/MODE.json)"
    )
    p.add_argument(
        "--no-profiler-names",
        action="store_true",
        help="skip the suite's checks of profiler event names ('gloo:all_reduce' once per op)",
    )
    p.add_argument("--resume", action="store_true", help="skip tests already recorded in --out")
    p.add_argument(
        "--fresh", action="store_true", help="start --out anew instead of merging into it"
    )
    p.add_argument("--log-dir", type=Path, help="per-test logs (default: beside --out, MODE-logs/)")
    p.add_argument(
        "--compare", nargs="+", type=Path, metavar="JSON", help="print the markdown comparison"
    )
    args = p.parse_args(argv)

    if args.compare:
        print(compare_markdown(args.compare))
        return 0
    if args.mode is None:
        p.error("--mode is required (or --compare)")
    names = list_tests(args.pattern, args.tests.split(",") if args.tests else None)
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        if not 1 <= i <= n:
            p.error("--shard I/N needs 1 <= I <= N")
        names = names[i - 1 :: n]
    out = args.out or DEFAULT_OUT_DIR / f"{args.mode}.json"
    data = {"tests": {}} if args.fresh else load_results(out)
    if args.resume:
        names = [n for n in names if n not in data["tests"]]
    if args.list:
        print("\n".join(names))
        print(f"{len(names)} tests", file=sys.stderr)
        return 0
    log_dir = args.log_dir or out.parent / f"{args.mode}-logs"
    data.update(
        mode=args.mode,
        torch=_torch_version(),
        xcomm_head=_git_head(),
        world_size=args.world_size,
        start=args.start,
        timeout_s=args.timeout,
        profiler_names_checked=not args.no_profiler_names,
        label=f"{args.mode} ws={args.world_size}"
        + (" (profiler names unchecked)" if args.no_profiler_names else ""),
    )
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(name: str | None = None, record: dict[str, Any] | None = None) -> None:
        if name is not None:
            data["tests"][name] = record
        data["summary"] = _summary(data)
        data["proof"] = proof(args.mode, data["tests"])
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(out)

    wall = time.monotonic()
    results = run_tests(
        args.mode,
        names,
        timeout=args.timeout,
        world_size=args.world_size,
        start=args.start,
        log_dir=log_dir,
        profiler_names=not args.no_profiler_names,
        on_result=save,
    )
    wall = time.monotonic() - wall
    save()
    here = Counter(r["status"] for r in results.values())
    print(
        f"{len(results)} tests in {wall:.0f}s: "
        + ", ".join(f"{here[s]} {s}" for s in STATUSES if here[s])
        + f"; {out} now holds {data['summary']['total']}"
    )
    for n, r in results.items():
        if r["status"] in ("fail", "timeout", "error"):
            print(f"  {r['status']:7} {n}: {r['reason']}")
    print(_proof_line(args.mode, data["proof"]))
    here_proof = proof(args.mode, results)
    if args.mode != "gloo" and here_proof.get("tests_with_ranks") and not here_proof["ok"]:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
