"""torchft on xcomm: a replica is SIGKILLed mid-run, the survivor trains on,
and a restarted replica rejoins with the survivor's state.

Two replica groups (one process each) train the same small MLP with torchft's
``Manager`` and ``DistributedDataParallel``; the group between them is
``xcomm.torchft.ProcessGroupXcomm``, and a torchft lighthouse runs in this
process. The script runs twice:

1. uninterrupted: both replicas train ``--steps`` steps;
2. interrupted: once replica 1 has done ``--kill-at`` steps it is SIGKILLed
   (wherever it is in its step), the survivor's pending allreduce fails
   at once on xcomm, torchft forms a quorum of the survivor alone, which
   trains on; replica 1 is restarted ``--restart-after`` seconds later, joins
   the next quorum and receives the survivor's model and optimizer by
   torchft's checkpoint transport. A restart takes seconds (the
   interpreter and its imports), so in this run both replicas train on past
   ``--steps`` until the rejoined replica has shared ``--shared-steps`` steps
   with the survivor: a slow restart cannot miss the run.

It prints the loss on a fixed evaluation set for both runs, how long the
survivor took from the kill to its first step alone and the restarted
replica from its start to its first step, and whether the rejoined replica's
parameters equal the survivor's bit for bit after every step they share.
``--plot FILE`` draws both loss curves with the kill and the rejoin marked.

    python examples/torchft_kill_rejoin.py
    python examples/torchft_kill_rejoin.py --steps 400 --kill-at 100 --plot loss.png
    python examples/torchft_kill_rejoin.py --nodes --rate 1gbit   # as root

With ``--nodes`` each replica runs on a node of its own of xcomm's emulated
cluster (``xcomm_bench.cluster``: network namespaces joined by a shaped link;
needs root), and the lighthouse on replica 0's node: the allreduce, the
quorum and the state transfer to the rejoining replica all cross the link.

Needs torchft (``pip install torchft``), tqdm, and matplotlib for ``--plot``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPLICAS = 2


# --------------------------------------------------------------------------- #
# One replica (this script run with --replica)
# --------------------------------------------------------------------------- #


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same start on every replica
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def _teacher_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of a fixed random teacher network's 16 -> 4 map, plus noise."""
    teacher = torch.Generator().manual_seed(12345)
    w1 = torch.randn(16, 32, generator=teacher) / 4
    w2 = torch.randn(32, 4, generator=teacher) / 6
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(n, 4, generator=g)


def _params_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _wait_for(path: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.02)


def replica_main(args: argparse.Namespace) -> None:
    """Trains until the Manager's step reaches ``--steps``; one JSON line per iteration."""
    from torchft import Manager
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    import xcomm
    from xcomm.torchft import ProcessGroupXcomm

    torch.set_num_threads(1)
    # On the emulated cluster every node shares this machine's hostname, which
    # resolves to loopback; a replica advertises its node's address instead
    # (torchft's checkpoint server names itself by socket.gethostname()).
    node_addr = os.environ.get("XCOMM_CLUSTER_NODE_ADDR")
    if node_addr:
        socket.gethostname = lambda: node_addr  # type: ignore[assignment]
    host = node_addr or "localhost"
    net = _model()
    sgd = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    timeout = timedelta(seconds=args.timeout)
    store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupXcomm(timeout=timeout, options=xcomm.Options())
    manager = Manager(
        pg=pg,
        load_state_dict=lambda sd: (
            net.load_state_dict(sd["model"]),
            sgd.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": net.state_dict(), "optim": sgd.state_dict()},
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=str(args.replica),
        hostname=node_addr or socket.gethostname(),
    )
    model = DistributedDataParallel(manager, net)
    optimizer = OptimizerWrapper(manager, sgd)
    eval_x, eval_y = _teacher_data(256, seed=999)
    Path(args.out + ".ready").touch()
    for other in args.wait:
        _wait_for(other)

    def more() -> bool:  # the driver's stop file says the run may end at --steps
        return manager.current_step() < args.steps or not os.path.exists(args.stop_file)

    with open(args.out, "w") as log:
        while more():
            before = manager.current_step()
            x, y = _teacher_data(32, seed=1000 * before + args.replica)
            optimizer.zero_grad()  # starts the quorum
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()  # steps SGD only if every replica's allreduce succeeded
            with torch.no_grad():
                loss = nn.functional.mse_loss(net(eval_x), eval_y).item()
            record = {
                "step": manager.current_step(),
                "committed": manager.current_step() == before + 1,
                "participants": manager.num_participants(),
                "loss": loss,
                "hash": _params_hash(net),
                "time": time.time(),
                # The xcomm group's route (plain across the emulated nodes).
                "shape": pg.backend.plan["shape"] if pg.backend is not None else None,
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            time.sleep(args.step_pause)  # a step of a bigger model; leaves the kill room
    manager.shutdown(wait=False)
    os._exit(0)  # the Manager's servers need no orderly teardown


# --------------------------------------------------------------------------- #
# The driver
# --------------------------------------------------------------------------- #


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


class Run:
    """The replica processes of one run, and their logs."""

    def __init__(
        self,
        name: str,
        folder: Path,
        args: argparse.Namespace,
        lighthouse: str,
        cluster: Any = None,
    ) -> None:
        self.folder = folder / name
        self.folder.mkdir()
        self.args, self.lighthouse, self.cluster = args, lighthouse, cluster
        self.procs: dict[str, subprocess.Popen] = {}
        self.stop_file = self.folder / "stop"

    def allow_stop(self) -> None:
        """Lets the replicas end once they reach ``--steps``."""
        self.stop_file.touch()

    def start(self, tag: str, replica: int, wait: list[str]) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--replica", str(replica)]
        cmd += ["--lighthouse", self.lighthouse, "--out", str(self.folder / f"{tag}.jsonl")]
        cmd += ["--steps", str(self.args.steps), "--lr", str(self.args.lr)]
        cmd += ["--timeout", str(self.args.timeout), "--step-pause", str(self.args.step_pause)]
        cmd += ["--stop-file", str(self.stop_file)]
        for w in wait:
            cmd += ["--wait", str(self.folder / f"{w}.jsonl.ready")]
        with open(self.folder / f"{tag}.log", "wb") as out:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "error"}
            io = {"stdout": out, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
            if self.cluster is None:
                self.procs[tag] = subprocess.Popen(cmd, env=env, **io)
            else:  # replica r on node r; `ip netns exec` execs the replica (same pid)
                env.update(self.cluster.node_env(replica))
                self.procs[tag] = self.cluster.popen(replica, cmd, env=env, **io)

    def records(self, tag: str) -> list[dict[str, Any]]:
        return _records(self.folder / f"{tag}.jsonl")

    def shared_records(self, tag: str) -> list[dict[str, Any]]:
        """``tag``'s committed steps with more than one participant. Before it
        reaches the survivor, a restarted replica may form a quorum of its own
        (torchft's min_replica_size=1): its rejoin is the first of these."""
        return [r for r in self.records(tag) if r["committed"] and r["participants"] > 1]

    def check_alive(self, *tags: str) -> None:
        for tag in tags:
            rc = self.procs[tag].poll()
            if rc not in (None, 0):
                log = (self.folder / f"{tag}.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"replica {tag} failed (exit {rc}):\n{log}")

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()


def _drive(run: Run, args: argparse.Namespace, interrupted: bool) -> dict[str, Any]:
    from tqdm import tqdm

    if not interrupted:
        run.allow_stop()
    run.start("r0", 0, ["r1"])
    run.start("r1", 1, ["r0"])
    events: dict[str, float] = {}
    deadline = time.monotonic() + args.deadline
    label = "interrupted" if interrupted else "uninterrupted"
    with tqdm(total=args.steps, desc=label, unit="step") as bar:
        while run.procs["r0"].poll() is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"{label}: not done within {args.deadline} s")
            survivor = run.records("r0")
            bar.update(max(0, (survivor[-1]["step"] if survivor else 0) - bar.n))
            if interrupted and "kill" not in events and len(run.records("r1")) >= args.kill_at:
                os.kill(run.procs["r1"].pid, signal.SIGKILL)
                run.procs["r1"].wait()
                events["kill"] = time.time()
                bar.write(f"SIGKILLed replica 1 after its step {run.records('r1')[-1]['step']}")
            restart_due = "kill" in events and time.time() - events["kill"] >= args.restart_after
            if restart_due and "restart" not in events:
                run.start("r1b", 1, [])
                events["restart"] = time.time()
                bar.write("restarted replica 1")
            if "restart" in events and len(run.shared_records("r1b")) >= args.shared_steps:
                run.allow_stop()
            run.check_alive(*(t for t in run.procs if not (t == "r1" and "kill" in events)))
            time.sleep(0.05)
    for tag in run.procs:
        if not (tag == "r1" and interrupted):
            run.procs[tag].wait(timeout=args.deadline)
            run.check_alive(tag)
    return events


def _summary(name: str, run: Run, events: dict[str, float]) -> dict[str, Any]:
    survivor = run.records("r0")
    out: dict[str, Any] = {
        "name": name,
        "steps": [r["step"] for r in survivor if r["committed"]],
        "loss": [r["loss"] for r in survivor if r["committed"]],
        "final_loss": survivor[-1]["loss"],
        "shapes": sorted({r["shape"] for r in survivor if r["participants"] > 1 and r["shape"]}),
    }
    if not events:
        other = {r["step"]: r["hash"] for r in run.records("r1")}
        out["bitwise_equal_steps"] = sum(other.get(r["step"]) == r["hash"] for r in survivor)
        return out
    alone = [r for r in survivor if r["committed"] and r["participants"] == 1]
    rejoined = run.shared_records("r1b")
    by_step = {r["step"]: r["hash"] for r in survivor if r["committed"]}
    shared = [r for r in rejoined if r["step"] in by_step]
    out.update(
        kill_step=run.records("r1")[-1]["step"],
        alone_steps=len(alone),
        recovery_s=(alone[0]["time"] - events["kill"]) if alone else None,
        rejoin_step=rejoined[0]["step"] if rejoined else None,
        rejoin_s=(rejoined[0]["time"] - events["restart"]) if rejoined else None,
        shared_steps=len(shared),
        bitwise_equal=bool(shared) and all(r["hash"] == by_step[r["step"]] for r in shared),
    )
    return out


def _plot(path: str, runs: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(r["steps"], r["loss"], label=r["name"])
    interrupted = runs[-1]
    ax.axvline(interrupted["kill_step"], color="red", ls="--", label="replica 1 SIGKILLed")
    if interrupted["rejoin_step"] is not None:
        ax.axvline(interrupted["rejoin_step"], color="green", ls="--", label="replica 1 rejoined")
    ax.set_xlabel("step")
    ax.set_ylabel("evaluation loss (MSE)")
    ax.set_yscale("log")
    ax.set_title("torchft on xcomm: kill and rejoin")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# A dead replica leaves the quorum 1 s after its last heartbeat.
LIGHTHOUSE = {"min_replicas": 1, "join_timeout_ms": 2000, "heartbeat_timeout_ms": 1000}
LIGHTHOUSE_PORT = 29510


def _cluster_lighthouse(stack: contextlib.ExitStack, rate: str | None) -> tuple[Any, str]:
    """Two emulated nodes, one per replica, and a lighthouse on node 0 (its
    own process: this one is outside the nodes' network)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # xcomm_bench
    from xcomm_bench.cluster import EmulatedCluster

    cluster = stack.enter_context(EmulatedCluster(REPLICAS, 1, rate))
    serve = (
        "import time; from torchft.coordination import LighthouseServer; "
        f"server = LighthouseServer(bind='[::]:{LIGHTHOUSE_PORT}', **{LIGHTHOUSE!r}); time.sleep(1e6)"
    )
    env = {**os.environ, "RUST_LOG": "error"}
    proc = cluster.popen(0, [sys.executable, "-c", serve], env=env, stdin=subprocess.DEVNULL)
    stack.callback(lambda: (proc.kill(), proc.wait()))
    address = f"http://{cluster.nodes[0].address}:{LIGHTHOUSE_PORT}"
    up = time.monotonic() + 60
    while time.monotonic() < up:  # serving once node 0 accepts on the port
        probe = [sys.executable, "-c", _PROBE.format(cluster.nodes[0].address, LIGHTHOUSE_PORT)]
        quiet = {"stdin": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        if cluster.popen(0, probe, **quiet).wait() == 0:
            return cluster, address
        if proc.poll() is not None:
            raise SystemExit(f"the lighthouse on node 0 exited ({proc.returncode})")
        time.sleep(0.2)
    raise SystemExit("the lighthouse on node 0 did not start within 60 s")


_PROBE = "import socket; socket.create_connection(({!r}, {}), timeout=1).close()"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="steps of each run (default 300)")
    p.add_argument("--kill-at", type=int, default=80, help="replica 1's steps before the SIGKILL")
    p.add_argument(
        "--restart-after", type=float, default=0.0, help="seconds from the kill to the restart"
    )
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument(
        "--step-pause", type=float, default=0.02, help="seconds each step sleeps (default 0.02)"
    )
    p.add_argument(
        "--shared-steps",
        type=int,
        default=10,
        help="steps the rejoined replica shares with the survivor before the run may end",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="collective timeout, seconds")
    p.add_argument("--deadline", type=float, default=300.0, help="give up on a run after this")
    p.add_argument("--plot", metavar="FILE", help="draw both loss curves into FILE (a .png)")
    p.add_argument(
        "--nodes",
        action="store_true",
        help="each replica on its own emulated node (xcomm_bench.cluster; root)",
    )
    p.add_argument(
        "--rate", help="with --nodes: the nodes' link rate, e.g. 1gbit (default unshaped)"
    )
    # internal: one replica
    p.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--wait", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--stop-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.replica is not None:
        replica_main(args)
        return
    if not 0 < args.kill_at < args.steps:
        raise SystemExit("--kill-at must be between 0 and --steps")
    if args.rate and not args.nodes:
        raise SystemExit("--rate needs --nodes")
    with contextlib.ExitStack() as stack:
        cluster, lighthouse = None, None
        if args.nodes:
            cluster, address = _cluster_lighthouse(stack, args.rate)
        else:
            from torchft.coordination import LighthouseServer

            lighthouse = LighthouseServer(bind="[::]:0", **LIGHTHOUSE)
            stack.callback(lighthouse.shutdown)
            address = lighthouse.address()
        summaries = []
        with tempfile.TemporaryDirectory(prefix="torchft-xcomm-") as tmp:
            for name, interrupted in (("uninterrupted", False), ("interrupted", True)):
                run = Run(name, Path(tmp), args, address, cluster)
                try:
                    events = _drive(run, args, interrupted)
                finally:
                    run.kill_all()
                summaries.append(_summary(name, run, events))

    plain, hit = summaries
    print(
        f"uninterrupted: final loss {plain['final_loss']:.4f}, replicas bitwise equal "
        f"at {plain['bitwise_equal_steps']} of {len(plain['steps'])} steps"
    )
    print(f"interrupted:   final loss {hit['final_loss']:.4f}")
    print(f"  the replicas' xcomm group: {', '.join(sorted({*hit['shapes'], *plain['shapes']}))}")
    if not hit["alone_steps"] or hit["rejoin_step"] is None:
        raise SystemExit("no step alone, or no rejoin within --deadline")
    print(
        f"  replica 1 SIGKILLed at step {hit['kill_step']}; the survivor trained "
        f"{hit['alone_steps']} steps alone, the first {hit['recovery_s']:.2f} s after the kill"
    )
    print(
        f"  restarted replica 1 rejoined at step {hit['rejoin_step']}, "
        f"{hit['rejoin_s']:.2f} s after its start (interpreter start included)"
    )
    print(
        f"  rejoined replica's parameters equal the survivor's bit for bit at all "
        f"{hit['shared_steps']} shared steps: {hit['bitwise_equal']}"
    )
    marks = sorted({0, len(plain["loss"]) // 4, len(plain["loss"]) // 2, len(plain["loss"]) - 1})
    print("  step   uninterrupted   interrupted")
    hit_loss = dict(zip(hit["steps"], hit["loss"], strict=True))
    for i in marks:
        step = plain["steps"][i]
        other = hit_loss.get(step)
        print(
            f"  {step:5d}   {plain['loss'][i]:13.4f}   {'-' if other is None else f'{other:11.4f}'}"
        )
    if args.plot:
        _plot(args.plot, summaries)
    if not hit["bitwise_equal"]:
        raise SystemExit("the rejoined replica's parameters differ from the survivor's")


if __name__ == "__main__":
    main()
