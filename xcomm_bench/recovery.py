"""Recovery from a dead rank: time from a SIGKILL to the survivors' first correct allreduce.

``python -m xcomm_bench.recovery`` starts fresh ranks for each trial, on
loopback or with ``--nodes N`` spread over N emulated nodes
(:class:`xcomm_bench.launch.RankSpawner`); they loop 1 MiB all_reduces on the default
group until the controller SIGKILLs the last rank (rank 0 hosts the
``env://`` store, so it is never the victim). Every survivor then

``xcomm-shrink`` / ``xcomm-shrink-plain``
    calls ``dist.shrink_group([victim], shrink_flags=SHRINK_ABORT)`` on an
    xcomm group (single-host shared memory; ``shm=False``: the checked Gloo
    route), which builds the survivors' group without the victim;
``xcomm-reconfigure`` / ``gloo-reconfigure`` (torch 2.14)
    call ``dist._reconfigure(uuid, handles)`` with the survivors' handles
    (published before the fault) on the default group, which becomes theirs;
``gloo-recreate``
    destroys the old group and creates a fresh ``ProcessGroupGloo`` for the
    survivors on a new prefix
    of the same store, as torchft re-creates its cross-replica group at
    every quorum change;

and runs one all_reduce on the new group, checked against the survivors'
exact sum. Measured per trial (``time.monotonic()``, the system-wide
``CLOCK_MONOTONIC``, the fault's time taken by the controller just before
the signal): when each survivor's collective raised (detect), when its
first correct allreduce on the new group finished (recovered), and the
slowest survivor of each. The methods alternate within each repetition, so
they share the machine's state.

Example::

    python -m xcomm_bench.recovery --world-sizes 2,3,4 --reps 7 --out recovery.json \\
        --plot docs/img/recovery.png
    python -m xcomm_bench.recovery --nodes 2 --rate 1gbit --world-sizes 2,3,4 --reps 5
"""

from __future__ import annotations

import argparse
import datetime
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

from .launch import RankSpawner, module_command

METHODS = (
    "xcomm-shrink",
    "xcomm-shrink-plain",
    "xcomm-reconfigure",
    "gloo-recreate",
    "gloo-reconfigure",
)
# torch 2.14's dist._reconfigure; skipped on earlier torch.
RECONFIGURE = ("xcomm-reconfigure", "gloo-reconfigure")
# Those that also let a newcomer in (--join): in place, or by a new group.
JOIN = ("xcomm-reconfigure", "gloo-reconfigure", "gloo-recreate")
NUMEL = 1 << 18  # 1 MiB of float32
SETTLE_S = 0.3  # the ranks loop collectives this long before the kill


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(data))
    os.replace(tmp, path)


def _newcomer(args: argparse.Namespace) -> int:
    """The victim's replacement: joins the survivors' group and reduces once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    import xcomm  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args.timeout)
    backend = "gloo" if args.method.startswith("gloo") else "xcomm"
    # No communicator yet: the group is made when the survivors let it in.
    dist.init_process_group(backend, timeout=timeout, enable_reconfigure=True)
    store = _get_default_store()
    t_ready = time.monotonic()
    if args.method in RECONFIGURE:
        store.set("recovery/join/handle", dist._get_reconfigure_handle())
        handles = [store.get(f"recovery/join/handle/{r}").decode() for r in range(world - 1)]
        dist._reconfigure(2, [*handles, dist._get_reconfigure_handle()], timeout=timeout).wait()
        data = torch.full((NUMEL,), float(rank + 1))
        dist.all_reduce(data)
    else:
        store.set("recovery/join/handle", "gloo")
        group = dist.ProcessGroupGloo(
            dist.PrefixStore("recovery/regrown", store), rank, world, timeout
        )
        data = torch.full((NUMEL,), float(rank + 1))
        group.allreduce([data]).wait()
    result = {
        "t_ready": t_ready,
        "t_joined": time.monotonic(),
        "correct": bool((data == float(sum(range(1, world + 1)))).all()),
    }
    _write(os.path.join(args.dir, "newcomer.json"), result)
    os._exit(0)


def _let_the_newcomer_in(
    args: argparse.Namespace, rank: int, world: int, group: Any, store: Any
) -> bool:
    """A survivor's side of --join: the whole group again, with the newcomer last.
    ``store`` is the default group's (still served by rank 0 after gloo-recreate
    destroyed that group)."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=args.timeout)
    store.set_timeout(datetime.timedelta(seconds=120))  # the newcomer imports torch first
    if args.method in RECONFIGURE:
        store.set(f"recovery/join/handle/{rank}", dist._get_reconfigure_handle())
        handles = [store.get(f"recovery/join/handle/{r}").decode() for r in range(world - 1)]
        handles.append(store.get("recovery/join/handle").decode())
        dist._reconfigure(2, handles, timeout=timeout).wait()
        data = torch.full((NUMEL,), float(rank + 1))
        dist.all_reduce(data)
    else:
        store.get("recovery/join/handle")  # the newcomer is up
        del group  # as torchft at a quorum change: the old group goes first
        regrown = dist.ProcessGroupGloo(
            dist.PrefixStore("recovery/regrown", store), rank, world, timeout
        )
        data = torch.full((NUMEL,), float(rank + 1))
        regrown.allreduce([data]).wait()
    return bool((data == float(sum(range(1, world + 1)))).all())


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import SHRINK_ABORT, _get_default_store

    import xcomm

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args.timeout)
    init_timeout = datetime.timedelta(seconds=60)
    if args.method.startswith("gloo"):
        dist.init_process_group("gloo", timeout=timeout)
    else:
        shm = args.method != "xcomm-shrink-plain"
        options = xcomm.Options(timeout=timeout, shm=shm)
        dist.init_process_group("xcomm", pg_options=options, timeout=init_timeout)
    store = base_store = _get_default_store()
    if args.method in RECONFIGURE:  # the survivors' handles, known before the fault
        store.set(f"recovery/handle/{rank}", dist._get_reconfigure_handle())
    data = torch.ones(NUMEL)
    for _ in range(3):
        dist.all_reduce(data)
    result: dict[str, Any] = {"rank": rank}
    if not args.method.startswith("gloo"):
        result["shape"] = xcomm.group_plan()["shape"]  # the route that ran
    _write(os.path.join(args.dir, f"ready{rank}"), {})
    give_up = time.monotonic() + 3 * args.timeout + 30
    while time.monotonic() < give_up:
        try:
            dist.all_reduce(data)
        except Exception as e:  # noqa: BLE001 - the failure is what we wait for
            result["t_error"] = time.monotonic()
            result["error"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            break
    survivors = [r for r in range(world) if r != args.victim]
    if args.method == "gloo-recreate":
        # As torchft does at a quorum change: the old group goes first.
        store = dist.PrefixStore("recovery/survivors", _get_default_store())
        dist.destroy_process_group()  # drops the last reference, as torchft's `self._pg = None`
        group = dist.ProcessGroupGloo(store, survivors.index(rank), len(survivors), timeout)
    elif args.method in RECONFIGURE:
        handles = [store.get(f"recovery/handle/{r}").decode() for r in survivors]
        dist._reconfigure(1, handles, timeout=timeout).wait()
        group = dist.distributed_c10d._get_default_group()
    else:
        group = dist.shrink_group([args.victim], shrink_flags=SHRINK_ABORT)
    after = torch.full((NUMEL,), float(rank + 1))
    if args.method == "gloo-recreate":
        group.allreduce([after]).wait()
    else:
        dist.all_reduce(after, group=group)
    result["t_recovered"] = time.monotonic()
    result["correct"] = bool((after == float(sum(r + 1 for r in survivors))).all())
    _write(os.path.join(args.dir, f"rank{rank}.json"), result)
    if args.join:  # the victim's slot is last: the survivors keep their ranks
        result["join_correct"] = _let_the_newcomer_in(args, rank, world, group, base_store)
        _write(os.path.join(args.dir, f"rank{rank}.json"), result)
    os._exit(0)  # the old group's peer is dead: skip torch's teardown of it


def run_trial(
    method: str,
    world: int,
    *,
    timeout_s: float,
    deadline_s: float,
    join: bool = False,
    spawner: RankSpawner | None = None,
) -> dict[str, Any]:
    """One kill and recovery in fresh ranks (placed by ``spawner``, default
    loopback); the survivors' timings. With
    ``join`` (methods in :data:`JOIN`), a newcomer then takes the victim's
    place: the time from its process's start, and from its
    ``init_process_group`` returning, to its first correct allreduce.

    Example::

        >>> r = run_trial("xcomm-shrink", 3, timeout_s=20, deadline_s=90)  # doctest: +SKIP
        >>> r["ok"], r["recover_ms"] < 1000  # doctest: +SKIP
        (True, True)
    """
    victim = world - 1
    with tempfile.TemporaryDirectory(prefix="xcomm-recovery-") as tmp:
        command = module_command(
            "xcomm_bench.recovery",
            "--worker",
            "--dir",
            tmp,
            "--method",
            method,
            "--victim",
            str(victim),
            "--timeout",
            str(timeout_s),
            *(["--join"] if join else []),
        )
        spawner = spawner or RankSpawner()
        port = spawner.new_group()
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        t_fault = t_spawn = None
        deadline = time.monotonic() + deadline_s
        try:
            for r in range(world):
                log = open(os.path.join(tmp, f"log{r}"), "wb")  # noqa: SIM115 - closed below
                logs.append(log)
                procs.append(spawner.spawn(r, world, port, command, stdout=log, stderr=log))
            ready = [os.path.join(tmp, f"ready{r}") for r in range(world)]
            while time.monotonic() < deadline and not all(map(os.path.exists, ready)):
                if any(p.poll() is not None for p in procs):
                    break
                time.sleep(0.01)
            if all(map(os.path.exists, ready)):
                time.sleep(SETTLE_S)
                t_fault = time.monotonic()
                procs[victim].send_signal(signal.SIGKILL)
            if join and t_fault is not None:
                recovered = [os.path.join(tmp, f"rank{r}.json") for r in range(world - 1)]
                while time.monotonic() < deadline and not all(map(os.path.exists, recovered)):
                    time.sleep(0.01)
                log = open(os.path.join(tmp, "log_newcomer"), "wb")  # noqa: SIM115 - closed below
                logs.append(log)
                t_spawn = time.monotonic()
                procs.append(
                    spawner.spawn(
                        victim, world, port, [*command, "--newcomer"], stdout=log, stderr=log
                    )
                )
            for r, p in enumerate(procs):
                if r != victim:
                    try:
                        p.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            for log in logs:
                log.close()
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            if r != victim:
                results.append(json.loads(Path(path).read_text()) if os.path.exists(path) else None)
        tail = "" if all(results) else Path(os.path.join(tmp, "log0")).read_text()[-1500:]
        newcomer = None
        if join and os.path.exists(os.path.join(tmp, "newcomer.json")):
            newcomer = json.loads(Path(os.path.join(tmp, "newcomer.json")).read_text())
        if join and not newcomer and os.path.exists(os.path.join(tmp, "log_newcomer")):
            tail += Path(os.path.join(tmp, "log_newcomer")).read_text()[-1500:]
    ok = t_fault is not None and all(r and r.get("correct") for r in results)
    if join:
        ok = ok and bool(newcomer and newcomer["correct"])
        ok = ok and all(r and r.get("join_correct") for r in results)
    record: dict[str, Any] = {
        "method": method,
        "world": world,
        "where": spawner.where,
        "ok": ok,
        "log_tail": tail,
    }
    if join and ok and newcomer and t_spawn is not None:
        record["join_ms"] = 1000 * (newcomer["t_joined"] - t_spawn)
        record["join_after_init_ms"] = 1000 * (newcomer["t_joined"] - newcomer["t_ready"])
    if ok:
        record["detect_ms"] = max(1000 * (r["t_error"] - t_fault) for r in results)
        record["recover_ms"] = max(1000 * (r["t_recovered"] - t_fault) for r in results)
        record["rebuild_ms"] = max(1000 * (r["t_recovered"] - r["t_error"]) for r in results)
        record["errors"] = sorted({r["error"] for r in results})
        record["shapes"] = sorted({r["shape"] for r in results if "shape" in r})
    return record


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per world size and method: trials, failures, median and max of the
    slowest survivor's recovery, and its ratio to xcomm's shrink."""
    rows = []
    for world in sorted({r["world"] for r in records}):
        medians: dict[str, float] = {}
        for method in METHODS:
            rs = [r for r in records if r["world"] == world and r["method"] == method]
            good = [r for r in rs if r["ok"]]
            if not rs:
                continue
            row = {
                "world": world,
                "method": method,
                "trials": len(rs),
                "failed": len(rs) - len(good),
            }
            for key in ("detect_ms", "rebuild_ms", "recover_ms"):
                values = [r[key] for r in good]
                row[key] = round(statistics.median(values), 1) if values else None
                row[key + "_max"] = round(max(values), 1) if values else None
            if row["recover_ms"] is not None:
                medians[method] = row["recover_ms"]
            rows.append(row)
        for row in rows:
            if row["world"] == world and "xcomm-shrink" in medians and row["recover_ms"]:
                row["vs_xcomm_shrink"] = round(row["recover_ms"] / medians["xcomm-shrink"], 2)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table (medians, worst in parentheses)."""
    head = (
        "| ranks | method | trials (failed) | detect, ms | rebuild + first allreduce, ms "
        "| death to first correct allreduce, ms | / xcomm shrink |"
    )
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['method']} | {r['trials']} ({r['failed']}) "
            f"| {r['detect_ms']} ({r['detect_ms_max']}) | {r['rebuild_ms']} ({r['rebuild_ms_max']}) "
            f"| {r['recover_ms']} ({r['recover_ms_max']}) | {r.get('vs_xcomm_shrink', '')} |"
        )
    return "\n".join(lines)


def format_join_table(records: list[dict[str, Any]]) -> str:
    """--join's results as a Markdown table (medians, worst in parentheses)."""
    head = (
        "| ranks | method | trials (failed) | newcomer's start to its first allreduce, ms "
        "| from its init_process_group, ms |"
    )
    lines = [head, "|" + "---|" * 5]
    for world in sorted({r["world"] for r in records}):
        for method in JOIN:
            rs = [r for r in records if (r["world"], r["method"]) == (world, method)]
            good = [r for r in rs if r["ok"] and "join_ms" in r]
            if not rs:
                continue
            cells = []
            for key in ("join_ms", "join_after_init_ms"):
                values = [r[key] for r in good]
                cells.append(
                    f"{statistics.median(values):.1f} ({max(values):.1f})" if values else "-"
                )
            lines.append(
                f"| {world} | {method} | {len(rs)} ({len(rs) - len(good)}) | {cells[0]} | {cells[1]} |"
            )
    return "\n".join(lines)


def plot(path: str, records: list[dict[str, Any]], where: str = "one host") -> None:
    """Each trial's death-to-first-correct-allreduce time, per world size and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in records})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(METHODS)
    for i, method in enumerate(METHODS):
        for j, world in enumerate(worlds):
            ys = [
                r["recover_ms"]
                for r in records
                if r["ok"] and (r["method"], r["world"]) == (method, world)
            ]
            xs = [j + (i - (len(METHODS) - 1) / 2) * width] * len(ys)
            ax.scatter(xs, ys, s=14, color=f"C{i}", label=method if j == 0 else None)
            if ys:
                ax.hlines(
                    statistics.median(ys), xs[0] - width / 2.5, xs[0] + width / 2.5, color=f"C{i}"
                )
    ax.set_xticks(range(len(worlds)), [f"{w} ranks" for w in worlds])
    ax.set_yscale("log")
    ax.set_ylabel("SIGKILL to first correct allreduce, ms")
    ax.set_title(f"Recovery from a dead rank, {where}\n(each trial; line: median)")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit status 1 when any trial failed (a hang, a wrong sum)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = parser.add_argument
    a("--world-sizes", default="2,3,4")
    a("--methods", default=",".join(METHODS), help=f"comma-separated, of {','.join(METHODS)}")
    a("--reps", type=int, default=7, help="trials per world size and method")
    a("--timeout", type=float, default=20.0, help="the groups' timeout, seconds")
    a("--deadline", type=float, default=120.0, help="a trial still running then failed")
    a("--out", help="the JSON of every trial and the summary")
    a("--plot", help="a PNG of every trial's recovery time")
    a("--no-progress", action="store_true")
    a("--join", action="store_true", help="then a newcomer takes the victim's place")
    a("--nodes", type=int, default=0, help="spread the ranks over N emulated nodes (root)")
    a("--rate", help="the emulated nodes' link rate, e.g. 1gbit (default unshaped)")
    a("--worker", action="store_true", help=argparse.SUPPRESS)
    a("--newcomer", action="store_true", help=argparse.SUPPRESS)
    a("--dir", help=argparse.SUPPRESS)
    a("--method", help=argparse.SUPPRESS)
    a("--victim", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _newcomer(args) if args.newcomer else _worker(args)

    from tqdm import tqdm

    methods = _csv(args.methods)
    worlds = [int(w) for w in _csv(args.world_sizes)]
    if not set(methods) <= set(METHODS) or any(w < 2 for w in worlds):
        parser.error(f"methods are {METHODS}; world sizes >= 2")
    import torch.distributed as dist

    if not hasattr(dist, "_reconfigure"):
        methods = [m for m in methods if m not in RECONFIGURE]
        if args.join:
            parser.error("--join needs torch 2.14 (init_process_group(enable_reconfigure=True))")
    if args.join:
        methods = [m for m in methods if m in JOIN]
    trials = [(w, m) for _ in range(args.reps) for w in worlds for m in methods]
    records = []
    bar = tqdm(trials, desc="recovery trials", unit="trial", disable=args.no_progress)
    if args.nodes and any(w < args.nodes for w in worlds):
        parser.error(f"every world size needs a rank on each of the {args.nodes} nodes")
    with RankSpawner(args.nodes, args.rate) as spawner:
        for world, method in bar:
            bar.set_postfix_str(f"{method} {world} ranks")
            records.append(
                run_trial(
                    method,
                    world,
                    timeout_s=args.timeout,
                    deadline_s=args.deadline,
                    join=args.join,
                    spawner=spawner,
                )
            )
    rows = summarize(records)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"argv": sys.argv[1:], "where": spawner.where, "rows": rows, "trials": records},
                indent=1,
            )
        )
    if args.plot:
        plot(args.plot, records, spawner.where)
    print(format_table(rows))
    if args.join:
        print()
        print(format_join_table(records))
    bad = [r for r in records if not r["ok"]]
    for r in bad:
        print(f"FAILED {r['method']} at {r['world']} ranks: {r['log_tail'][-600:]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
