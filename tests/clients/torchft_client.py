"""One torchft replica group (one rank), run as a real program by
test_client_torchft.py: ``python torchft_client.py PG REPLICA LIGHTHOUSE OUT STEPS [flags]``.

torchft's ``Manager`` (its lighthouse at LIGHTHOUSE) with PG as the process
group between the replicas: ``xcomm`` (``xcomm.torchft.ProcessGroupXcomm``)
or ``gloo`` (torchft's own ``ProcessGroupGloo``, the reference). The replica
trains the clients' tiny regression model with torchft's
``DistributedDataParallel`` and ``OptimizerWrapper`` (SGD with momentum, so
a rejoining replica needs the optimizer's state too), or with ``--algo
diloco`` torchft's ``DiLoCo`` (that SGD as the inner optimizer, 2 inner
steps per outer Nesterov step), until the Manager's step reaches STEPS; its
batch depends on the replica and the step, the start on neither.

After every iteration (DiLoCo: every outer step) it appends a JSON line to OUT.jsonl (flushed, so a
killed replica leaves its lines): the Manager's step, whether the step was
committed, how many replicas took part, the loss on a fixed evaluation set
and a SHA-256 of its parameters' bytes. At the end it writes OUT.json:
``xcomm.stats()``, the group's backend name and shape, and the final
parameters' hash.

Flags (files as signals between the test and the replicas):
``--ready F`` writes F once the Manager runs; ``--wait F`` waits for F before
the first step; ``--kill-at K`` SIGKILLs this process inside its gradient
allreduce of step K, once the step's quorum is formed (so its peer waits in
its own allreduce); ``--hold-alone N --hold-for F`` (the survivor) waits for
F once it has committed N steps alone, so the restarted replica rejoins
before the run ends.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from client_common import regression_data, tiny_net
from torch import nn
from torchft import Manager
from torchft.ddp import DistributedDataParallel
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

FILE_WAIT_S = 60.0
#: Collectives, checkpoint transfer and should_commit (a dead peer fails faster).
OP_TIMEOUT = timedelta(seconds=10)


def _wait_file(path: str) -> None:
    deadline = time.monotonic() + FILE_WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {FILE_WAIT_S} s")
        time.sleep(0.02)


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = regression_data(16, seed=1000 * step + replica)
    return data.tensors


def params_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pg", choices=("xcomm", "gloo"))
    ap.add_argument("replica", type=int)
    ap.add_argument("lighthouse")
    ap.add_argument("out")
    ap.add_argument("steps", type=int)
    ap.add_argument("--algo", choices=("ddp", "diloco"), default="ddp")
    ap.add_argument("--ready")
    ap.add_argument("--wait", action="append", default=[])
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--hold-alone", type=int)
    ap.add_argument("--hold-for")
    args = ap.parse_args()

    torch.manual_seed(0)  # the same start on every replica
    net = tiny_net()
    sgd = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    def state_dict() -> dict[str, Any]:
        return {"model": net.state_dict(), "optim": sgd.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        net.load_state_dict(sd["model"])
        sgd.load_state_dict(sd["optim"])

    if args.pg == "xcomm":
        import xcomm
        from xcomm.torchft import ProcessGroupXcomm

        pg: Any = ProcessGroupXcomm(timeout=OP_TIMEOUT, options=xcomm.Options())
    else:
        pg = ProcessGroupGloo(timeout=OP_TIMEOUT)

    # The replica group's own store (one rank here); the quorum's groups use
    # the store of the quorum's first replica.
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=OP_TIMEOUT,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=str(args.replica),
        use_async_quorum=args.algo == "ddp",  # DiLoCo requires a synchronous quorum
    )
    if args.kill_at is not None:
        allreduce = manager.allreduce

        def allreduce_or_die(tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
            if manager.current_step() == args.kill_at:
                manager.wait_quorum()
                time.sleep(0.3)  # the peer is inside its allreduce by now
                os.kill(os.getpid(), signal.SIGKILL)
            return allreduce(tensor, *a, **kw)

        manager.allreduce = allreduce_or_die  # DDP's hook calls manager.allreduce
    eval_x, eval_y = regression_data(64, seed=7).tensors

    if args.ready:
        _touch(args.ready)
    for f in args.wait:
        _wait_file(f)

    log = open(args.out + ".jsonl", "w")  # noqa: SIM115 - flushed per line, closed at the end
    if args.algo == "diloco":
        _diloco(args, manager, net, sgd, log, eval_x, eval_y)
    else:
        _ddp(args, manager, net, sgd, log, eval_x, eval_y)
    log.close()

    result: dict[str, Any] = {"hash": params_hash(net), "pg": pg.getBackendName()}
    if args.pg == "xcomm":
        backend = pg.backend
        result["stats"] = {k: dict(v) for k, v in xcomm.stats().items()}
        result["backend_type"] = type(backend).__name__
        result["shape"] = backend.plan["shape"] if backend is not None else None
    with open(args.out + ".json", "w") as f:
        json.dump(result, f)
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)  # the Manager's threads and servers need no orderly teardown here


def _record(
    manager: Manager,
    net: nn.Module,
    eval_x: torch.Tensor,
    eval_y: torch.Tensor,
    committed: bool,
    started: float,
) -> str:
    with torch.no_grad():
        eval_loss = nn.functional.mse_loss(net(eval_x), eval_y).item()
    record = {
        "step": manager.current_step(),
        "committed": committed,
        "participants": manager.num_participants(),
        "eval_loss": eval_loss,
        "hash": params_hash(net),
        "seconds": time.monotonic() - started,
        "error": None if manager.errored() is None else str(manager.errored())[:300],
    }
    return json.dumps(record) + "\n"


def _diloco(
    args: argparse.Namespace,
    manager: Manager,
    net: nn.Module,
    sgd: torch.optim.Optimizer,
    log: Any,
    eval_x: torch.Tensor,
    eval_y: torch.Tensor,
) -> None:
    """DiLoCo: 2 local SGD steps, then an outer Nesterov step on the replicas'
    averaged pseudo-gradients; one line per outer step."""
    from torchft.local_sgd import DiLoCo

    outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.5, nesterov=True)
    inner_steps = 0
    with DiLoCo(manager, [net], sgd, outer, sync_every=2, pin_memory=False):
        while manager.current_step() < args.steps:
            before = manager.current_step()
            started = time.monotonic()
            x, y = _batch(args.replica, 1000 + inner_steps)
            sgd.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            sgd.step()  # every second step: the outer sync (quorum, allreduce, commit)
            inner_steps += 1
            if manager.current_step() != before or inner_steps % 2 == 0:
                committed = manager.current_step() == before + 1
                log.write(_record(manager, net, eval_x, eval_y, committed, started))
                log.flush()


def _ddp(
    args: argparse.Namespace,
    manager: Manager,
    net: nn.Module,
    sgd: torch.optim.Optimizer,
    log: Any,
    eval_x: torch.Tensor,
    eval_y: torch.Tensor,
) -> None:
    model = DistributedDataParallel(manager, net)
    optimizer = OptimizerWrapper(manager, sgd)
    alone = 0
    held = False
    while manager.current_step() < args.steps:
        if args.hold_for and not held and alone >= (args.hold_alone or 0):
            _wait_file(args.hold_for)
            held = True
        before = manager.current_step()
        started = time.monotonic()
        x, y = _batch(args.replica, before)
        optimizer.zero_grad()  # starts the quorum
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()  # steps SGD only if every replica's allreduce succeeded
        committed = manager.current_step() == before + 1
        if committed and manager.num_participants() == 1:
            alone += 1
        log.write(_record(manager, net, eval_x, eval_y, committed, started))
        log.flush()


if __name__ == "__main__":
    main()
