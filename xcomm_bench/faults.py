"""Fault injection: one rank of an xcomm group is killed, stopped or leaves mid-collective.

``python -m xcomm_bench.faults`` runs one trial per (fault, world size,
route) and, with ``--setup-trials``, kills the rank that creates the
shared-memory segment while the group forms. Each trial starts fresh ranks
on loopback, or with ``--nodes N`` spread over N emulated nodes (rank ``r``
of ``w`` on node ``r * N // w``; root; :class:`xcomm_bench.launch.RankSpawner`),
lets them reduce a few times, then injects the fault into one rank, the victim:

``sigkill``
    The controller SIGKILLs the victim while every rank loops collectives.
``sigstop``
    The controller SIGSTOPs the victim, so its sockets stay open and only
    the group timeout (``--timeout``) can tell; it is SIGKILLed once the
    survivors have answered.
``destroy``
    The victim stops issuing collectives, so the others block in one, and
    calls ``dist.destroy_process_group()``; it stays alive afterwards, so
    what the survivors notice is the departure, not a dead process.
``setup-kill``
    Shared memory only: rank 0 creates the group's segment before the
    group's Gloo connects, and the other ranks read its name after, late (a
    delay of ``--setup-delay`` seconds, as a slow peer would); the
    controller SIGKILLs rank 0 as soon as the segment appears in /dev/shm,
    while the others still connect, before any of them has its name (rank 0
    hosts the store too, as with ``env://``).

Routes: ``shm`` (single-host shared memory, a 1 MiB all_reduce), ``plain``
(``shm=False``: the checked Gloo route, a 1 MiB all_reduce), ``int8``
(``shm=False``, ``compression="int8"``: the 1 MiB all_reduce compressed)
and ``fusion`` (fusion on demand, bursts of eight 256 B async all_reduces).
Every survivor records when its collective raised and the first line of the
error; the group's plan shows the route really ran.

Per trial: whether every survivor raised, its latency from the fault (all
times ``time.monotonic()``, the system-wide ``CLOCK_MONOTONIC``, taken by the
controller just before it sends the signal, or by the victim just before it
calls ``destroy_process_group``; for ``setup-kill`` from the later of the
kill and the end of the survivor's artificial delay, since it cannot notice
anything before it returns from the store), whether any process outlived the
trial's deadline (a hang: it is killed) and which ``/dev/shm/xcomm-*`` files
exist after the trial that did not before it. Bound: 100 ms after a kill or a
departure, the timeout plus 100 ms for a stopped rank, and for a survivor of a
``setup-kill`` caught waiting in Gloo's connect (its error says ``Connect
timeout``): nothing there can see the death, as nothing can see a stopped rank.

Example::

    python -m xcomm_bench.faults --world-sizes 2,3,4 --setup-trials 2 --out faults.json
    python -m xcomm_bench.faults --faults destroy --routes shm --world-sizes 2 --no-progress
    python -m xcomm_bench.faults --nodes 2 --rate 1gbit --world-sizes 2,3,4 --out faults-2n.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from xcomm_bench.launch import RankSpawner, module_command

__all__ = ["FAULTS", "ROUTES", "Trial", "main", "run_trial", "summarize"]

FAULTS = ("sigkill", "sigstop", "destroy")
ROUTES = ("shm", "plain", "int8", "fusion")
SHM_DIR = "/dev/shm"
#: How long after a kill or a departure every survivor must have raised.
BOUND_S = 0.1
#: Seconds the ranks loop collectives between "ready" and the fault.
SETTLE_S = 0.3
BIG_NUMEL = 1 << 18  # 1 MiB of float32: above carry_small_ops' 128 KiB
BURST = 8
BURST_NUMEL = 64


@dataclasses.dataclass(frozen=True)
class Trial:
    """One fault injected into one group."""

    fault: str  # one of FAULTS, or "setup-kill"
    world_size: int
    route: str  # one of ROUTES
    victim: int

    @property
    def name(self) -> str:
        return f"{self.fault}-ws{self.world_size}-{self.route}-v{self.victim}"


def _options_kwargs(route: str) -> dict[str, Any]:
    if route == "shm":
        return {"shm": True}
    if route == "plain":
        return {"shm": False}
    if route == "int8":
        return {"shm": False, "compression": "int8", "compression_min_bytes": 8192}
    if route == "fusion":
        return {"fusion_threshold_bytes": 4096}
    raise ValueError(f"unknown route {route!r}; choose from {ROUTES}")


def _shm_files() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("xcomm-")}


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(data))
    os.replace(tmp, path)  # the controller never reads half a file


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _raised(e: BaseException) -> dict[str, Any]:
    """What a survivor records of its error: the first line to show, and
    whether it was a wait for a connection that nothing could have cut short.
    The test is on the whole text: xcomm's set-up error puts Gloo's
    ``Connect timeout`` after 300 characters of context, past the line shown."""
    return {"error": _first_line(e), "waited_out": waited_out_in_connect(str(e))}


def waited_out_in_connect(error_text: str) -> bool:
    """Whether ``error_text`` is Gloo's connect giving up at its timeout, the
    one set-up wait that cannot see its peer die (it has the address already
    and waits for the peer's connection, not on the store).

    Example::

        >>> waited_out_in_connect("Gloo connectFullMesh failed with [pair.cc:144] Connect timeout")
        True
        >>> waited_out_in_connect("DistNetworkError: Connection reset by peer")
        False
    """
    return "Connect timeout" in error_text


# --------------------------------------------------------------------- ranks


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import xcomm

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = os.path.join(args.dir, f"rank{rank}.json")
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.fault == "setup-kill":
        return _setup_worker(args, rank, world, out, timeout)
    options = xcomm.Options(timeout=timeout, **_options_kwargs(args.route))
    # The store's own timeout covers start-up on a busy machine; the
    # collectives get --timeout from the options.
    dist.init_process_group("xcomm", pg_options=options, timeout=datetime.timedelta(seconds=60))
    plan = xcomm.group_plan()
    if args.route == "fusion":
        tensors = [torch.ones(BURST_NUMEL) for _ in range(BURST)]

        def op() -> None:
            for w in [dist.all_reduce(t, async_op=True) for t in tensors]:
                w.wait()
    else:
        big = torch.ones(BIG_NUMEL)

        def op() -> None:
            dist.all_reduce(big)

    for _ in range(3):  # the group works before the fault
        op()
    result: dict[str, Any] = {"rank": rank, "shape": plan["shape"], "why": plan.get("why", "")}
    _write(os.path.join(args.dir, f"ready{rank}"), {"t": time.monotonic()})
    if rank == args.victim and args.fault == "destroy":
        go = os.path.join(args.dir, "go")
        while not os.path.exists(go):
            time.sleep(0.001)
        result["t_fault"] = time.monotonic()
        dist.destroy_process_group()
        result["destroy_s"] = time.monotonic() - result["t_fault"]
        _write(out, result)
        time.sleep(3600)  # alive: the survivors see the departure alone
        return 0
    ops, give_up = 0, time.monotonic() + 3 * args.timeout + 30
    while time.monotonic() < give_up:
        try:
            op()
            ops += 1
        except Exception as e:  # noqa: BLE001 - what the survivor saw is the result
            result.update(t_error=time.monotonic(), ops=ops, **_raised(e))
            break
    else:
        result.update(t_error=None, error=None, ops=ops)
    _write(out, result)
    started = time.monotonic()
    dist.destroy_process_group()
    result["teardown_s"] = time.monotonic() - started
    _write(out, result)
    return 0


def _setup_worker(
    args: argparse.Namespace, rank: int, world: int, out: str, timeout: datetime.timedelta
) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    import xcomm
    import xcomm.backend

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    inner = dist.PrefixStore("faults-setup", _get_default_store())
    result: dict[str, Any] = {"rank": rank}

    class LateStore(dist.Store):
        """A peer slow to read the segment's name: rank 0 waits with it created."""

        def set(self, key: str, value: Any) -> None:
            inner.set(key, value)

        def get(self, key: str) -> bytes:
            if key.endswith("/shm/name") and rank != 0:
                time.sleep(args.setup_delay)
                result["t_resume"] = time.monotonic()
            return inner.get(key)

        def add(self, key: str, value: int) -> int:
            return inner.add(key, value)

        def check(self, keys: list[str]) -> bool:
            return inner.check(keys)

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            inner.wait(keys) if timeout is None else inner.wait(keys, timeout)

        def deleteKey(self, key: str) -> bool:
            return inner.delete_key(key)

        def num_keys(self) -> int:
            return inner.num_keys()

    options = xcomm.Options(timeout=timeout, shm=True).to_cpp()
    try:
        backend = xcomm._C.build_group(LateStore(), rank, world, options, xcomm.backend._gloo)
        result["built"] = True
        backend.allreduce([torch.ones(BIG_NUMEL)]).wait()
        result.update(t_error=None, error=None)
    except Exception as e:  # noqa: BLE001
        result.update(t_error=time.monotonic(), **_raised(e))
    _write(out, result)
    os._exit(0)  # the default group's store died with rank 0: skip its teardown


# ---------------------------------------------------------------- controller


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def run_trial(
    trial: Trial,
    *,
    timeout_s: float = 3.0,
    deadline_s: float = 90.0,
    setup_delay_s: float = 1.5,
    spawner: RankSpawner | None = None,
) -> dict[str, Any]:
    """Runs one trial in fresh ranks and returns what happened; ``spawner``
    places them (default: loopback).

    Example::

        >>> r = run_trial(Trial("sigkill", 2, "shm", 1))  # doctest: +SKIP
        >>> r["survivors_raised"], r["max_latency_s"] < 0.1, r["segments_left"]  # doctest: +SKIP
        (True, True, [])
    """
    before = _shm_files()
    with tempfile.TemporaryDirectory(prefix="xcomm-faults-") as tmp:
        command = module_command(
            "xcomm_bench.faults",
            "--worker",
            "--dir",
            tmp,
            "--fault",
            trial.fault,
            "--route",
            trial.route,
            "--victim",
            str(trial.victim),
            "--timeout",
            str(timeout_s),
            "--setup-delay",
            str(setup_delay_s),
        )
        spawner = spawner or RankSpawner()
        port = spawner.new_group()
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        t_fault = None
        note = ""
        start = time.monotonic()
        deadline = start + deadline_s
        try:
            for r in range(trial.world_size):
                log = open(os.path.join(tmp, f"log{r}"), "wb")  # noqa: SIM115 - closed below
                logs.append(log)
                procs.append(
                    spawner.spawn(r, trial.world_size, port, command, stdout=log, stderr=log)
                )
            victim = procs[trial.victim]
            if trial.fault == "setup-kill":
                tag = f"-{victim.pid}-"
                while time.monotonic() < deadline and victim.poll() is None:
                    if any(n.startswith("xcomm-shm-") and tag in n for n in os.listdir(SHM_DIR)):
                        t_fault = time.monotonic()
                        victim.send_signal(signal.SIGKILL)
                        break
                    time.sleep(0.0005)
                else:
                    note = "rank 0 never showed its segment (set-up window missed)"
            else:
                ready = [os.path.join(tmp, f"ready{r}") for r in range(trial.world_size)]
                while time.monotonic() < deadline and not all(map(os.path.exists, ready)):
                    if any(p.poll() is not None for p in procs):
                        note = "a rank exited before the fault"
                        break
                    time.sleep(0.01)
                if not note and time.monotonic() < deadline:
                    time.sleep(SETTLE_S)
                    if trial.fault == "destroy":
                        Path(os.path.join(tmp, "go")).touch()
                    else:
                        sig = signal.SIGKILL if trial.fault == "sigkill" else signal.SIGSTOP
                        t_fault = time.monotonic()
                        victim.send_signal(sig)
                elif not note:
                    note = "ranks not ready by the deadline"
            # Survivors answer within the timeout; past the deadline they hang.
            if t_fault is not None or trial.fault == "destroy":
                deadline = min(deadline, time.monotonic() + 3 * timeout_s + 30)
            survivors = [p for r, p in enumerate(procs) if r != trial.victim]
            while time.monotonic() < deadline and any(p.poll() is None for p in survivors):
                time.sleep(0.01)
            hung = [r for r, p in enumerate(procs) if r != trial.victim and p.poll() is None]
            if trial.fault == "destroy":
                # The victim's own destroy_process_group must return too.
                done = os.path.join(tmp, f"rank{trial.victim}.json")
                while time.monotonic() < deadline and not os.path.exists(done):
                    time.sleep(0.01)
                if not os.path.exists(done):
                    hung.append(trial.victim)
        finally:
            _kill(procs)  # the victim (stopped, or alive after destroy) and any hung rank
            for log in logs:
                log.close()
        wall = time.monotonic() - start
        results: list[dict[str, Any] | None] = []
        for r in range(trial.world_size):
            path = os.path.join(tmp, f"rank{r}.json")
            results.append(json.loads(Path(path).read_text()) if os.path.exists(path) else None)
        if trial.fault == "destroy" and results[trial.victim]:
            t_fault = results[trial.victim]["t_fault"]
        tails = {
            r: Path(os.path.join(tmp, f"log{r}")).read_text(errors="replace")[-1500:]
            for r in range(trial.world_size)
            if r != trial.victim and (results[r] is None or results[r].get("error") is None)
        }
    time.sleep(0.05)  # a survivor's last unlink, if any, has landed
    left = sorted(_shm_files() - before)
    survivors_out = []
    for r, res in enumerate(results):
        if r == trial.victim:
            continue
        res = res or {}
        t_err = res.get("t_error")
        since = t_fault
        if trial.fault == "setup-kill" and res.get("t_resume") and since is not None:
            since = max(since, res["t_resume"])
        latency = None if t_err is None or since is None else round(t_err - since, 4)
        unseen = trial.fault == "sigstop" or (
            trial.fault == "setup-kill" and bool(res.get("waited_out"))
        )
        survivors_out.append(
            {
                "rank": r,
                "raised": t_err is not None,
                "latency_s": latency,
                "bound_s": timeout_s + BOUND_S if unseen else BOUND_S,
                "error": res.get("error"),
                "shape": res.get("shape"),
                "teardown_s": res.get("teardown_s"),
                "exited": r not in hung,
            }
        )
    latencies = [s["latency_s"] for s in survivors_out if s["latency_s"] is not None]
    bound = timeout_s + BOUND_S if trial.fault == "sigstop" else BOUND_S
    record = {
        **dataclasses.asdict(trial),
        "name": trial.name,
        "where": spawner.where,
        "injected": t_fault is not None,
        "note": note,
        "hang": bool(hung),
        "hung_ranks": hung,
        "survivors_raised": all(s["raised"] for s in survivors_out),
        "max_latency_s": max(latencies, default=None),
        "bound_s": bound,
        "segments_left": left,
        "survivors": survivors_out,
        "victim_result": results[trial.victim],
        "wall_s": round(wall, 2),
        "log_tails": tails,
    }
    record["ok"] = (
        record["injected"]
        and not record["hang"]
        and record["survivors_raised"]
        and not left
        and len(latencies) == len(survivors_out)
        and all(s["latency_s"] <= s["bound_s"] for s in survivors_out)
    )
    return record


def trials_for(
    faults: list[str], world_sizes: list[int], routes: list[str], setup_trials: int, nodes: int = 0
) -> list[Trial]:
    """The sweep: every fault x world size x route (victims rotate over the
    ranks, so rank 0, which hosts the store, is a victim too), then
    ``setup_trials`` set-up kills of rank 0 per world size where rank 0
    shares its host (``nodes`` emulated nodes, 0 for one host) with another
    rank, so makes a segment."""
    out = []
    for i, (fault, ws, route) in enumerate(itertools.product(faults, world_sizes, routes)):
        out.append(Trial(fault, ws, route, (i + 1) % ws))
    for ws in world_sizes:
        if RankSpawner(nodes).node_of(1, ws) == 0:  # rank 1 shares rank 0's host
            out += [Trial("setup-kill", ws, "shm", 0) for _ in range(setup_trials)]
    return out


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per fault kind: trials, hangs, segments left, survivors that
    did not raise, latencies (max, median) and trials over their bound."""
    rows = []
    for fault in dict.fromkeys(r["fault"] for r in records):
        rs = [r for r in records if r["fault"] == fault]
        lat = [s["latency_s"] for r in rs for s in r["survivors"] if s["latency_s"] is not None]
        rows.append(
            {
                "fault": fault,
                "trials": len(rs),
                "not_injected": sum(not r["injected"] for r in rs),
                "hangs": sum(r["hang"] for r in rs),
                "segments_left": sum(len(r["segments_left"]) for r in rs),
                "survivors": sum(len(r["survivors"]) for r in rs),
                "did_not_raise": sum(not s["raised"] for r in rs for s in r["survivors"]),
                "max_latency_ms": round(1000 * max(lat), 1) if lat else None,
                "median_latency_ms": round(1000 * statistics.median(lat), 1) if lat else None,
                "over_bound": sum(
                    any(
                        s["latency_s"] is not None
                        and s["latency_s"] > s.get("bound_s", r["bound_s"])
                        for s in r["survivors"]
                    )
                    for r in rs
                ),
                "bound_ms": round(1000 * rs[0]["bound_s"]),
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table."""
    head = (
        "| fault | trials | hangs | segments left | survivors (did not raise) "
        "| max / median latency, ms | over the bound (ms) |"
    )
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        lines.append(
            f"| {r['fault']} | {r['trials']} | {r['hangs']} | {r['segments_left']} "
            f"| {r['survivors']} ({r['did_not_raise']}) "
            f"| {r['max_latency_ms']} / {r['median_latency_ms']} "
            f"| {r['over_bound']} ({r['bound_ms']}) |"
        )
    return "\n".join(lines)


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit status 1 when any trial hung, left a segment, had a
    survivor that did not raise or raised past its bound."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = parser.add_argument
    a("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    a("--world-sizes", default="2,3,4")
    a("--routes", default=",".join(ROUTES), help=f"comma-separated, of {','.join(ROUTES)}")
    a("--setup-trials", type=int, default=2, help="set-up kills of rank 0 per world size")
    a("--timeout", type=float, default=3.0, help="the group's timeout, seconds (default 3)")
    a("--deadline", type=float, default=90.0, help="a trial still running then is a hang")
    a("--setup-delay", type=float, default=1.5, help="how late the peers read the name")
    a("--nodes", type=int, default=0, help="spread the ranks over N emulated nodes (root)")
    a("--rate", help="the emulated nodes' link rate, e.g. 1gbit (default unshaped)")
    a("--out", help="the JSON of every trial and the summary")
    a("--no-progress", action="store_true")
    # Worker arguments (one rank of one trial).
    a("--worker", action="store_true", help=argparse.SUPPRESS)
    a("--dir", help=argparse.SUPPRESS)
    a("--fault", help=argparse.SUPPRESS)
    a("--route", help=argparse.SUPPRESS)
    a("--victim", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)

    from tqdm import tqdm

    faults, routes = _csv(args.faults), _csv(args.routes)
    world_sizes = [int(w) for w in _csv(args.world_sizes)]
    if not set(faults) <= set(FAULTS) or not set(routes) <= set(ROUTES):
        parser.error(f"faults are {FAULTS}, routes {ROUTES}")
    if any(w < 2 for w in world_sizes):
        parser.error("a fault needs a survivor: world sizes >= 2")
    if args.nodes and any(w < args.nodes for w in world_sizes):
        parser.error(f"every world size needs a rank on each of the {args.nodes} nodes")
    trials = trials_for(faults, world_sizes, routes, args.setup_trials, args.nodes)
    records = []
    bar = tqdm(trials, desc="fault trials", unit="trial", disable=args.no_progress)
    with RankSpawner(args.nodes, args.rate) as spawner:
        for trial in bar:
            bar.set_postfix_str(trial.name)
            records.append(
                run_trial(
                    trial,
                    timeout_s=args.timeout,
                    deadline_s=args.deadline,
                    setup_delay_s=args.setup_delay,
                    spawner=spawner,
                )
            )
    rows = summarize(records)
    bad = [r for r in records if not r["ok"]]
    if args.out:
        summary = {
            "argv": sys.argv[1:] if argv is None else list(argv),
            "timeout_s": args.timeout,
            "where": records[0]["where"] if records else "",
            "rows": rows,
            "failed": [r["name"] for r in bad],
            "trials": records,
        }
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(format_table(rows))
    for r in bad:
        worst = [s for s in r["survivors"] if not s["raised"]] or r["survivors"]
        print(
            f"FAILED {r['name']}: injected={r['injected']} hang={r['hang']} "
            f"left={r['segments_left']} max latency={r['max_latency_s']} {r['note']} "
            f"{worst[0]['error'] if worst else ''}"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
