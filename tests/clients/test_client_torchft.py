"""torchft (its ``Manager``, lighthouse, DDP and checkpoint transport) on
xcomm: ``xcomm.torchft.ProcessGroupXcomm`` as the group between the replicas.

Two replica groups of one rank each (torchft_client.py, real processes) and a
``LighthouseServer`` in this process. Each replica trains the tiny regression
model on batches of its own, with torchft's ``DistributedDataParallel`` or
its ``DiLoCo`` (two local steps, then an outer step on the averaged
pseudo-gradients).

* Healthy run, DDP and DiLoCo: every step (DiLoCo: outer step) is committed
  by both replicas, whose parameters are bit for bit the same after every
  step and equal, step by step, to the same run on torchft's own
  ``ProcessGroupGloo`` (the reference: a 2-replica sum is exact on both);
  the loss on a fixed set falls; xcomm ran the allreduces
  (``xcomm.stats()`` in each replica, the group's backend and shape).
* The wrapper alone, as the ``Manager`` drives it: ``configure()`` on a
  new store prefix builds a new xcomm group each time (the allreduce is the
  sum), and ``abort()`` returns and releases a pending op at once
  (reference: the 30 s timeout), which ``errored()`` then reports.
* Kill and rejoin: replica 1 SIGKILLs itself inside its gradient allreduce of
  step 4, while replica 0 waits in its own. xcomm releases replica 0's op
  ("died") long before the 10 s timeout, torchft skips that step, forms a
  quorum of replica 0 alone, which trains on; a fresh replica 1 then rejoins
  through the Manager, receives the survivor's model and optimizer by
  torchft's HTTP checkpoint transport, and from then on both replicas'
  parameters are bit for bit the same after every step (its first
  iteration already ends at the survivor's step, with the survivor's
  parameters). With torchft's ``ProcessGroupGloo`` the survivor ends at the kill
  (torchft 0.2.0's DDP hook asserts when ``wait()`` raises), so that run has
  no reference here.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import RankContext, error_of, run_ranks

pytest.importorskip("torchft")
from torchft.coordination import LighthouseServer

HERE = Path(__file__).resolve().parent
CLIENT = HERE / "torchft_client.py"
HEALTHY_STEPS = 10
KILL_AT = 4
REJOIN_STEPS = 14
HOLD_ALONE = 3  # steps the survivor trains alone before it waits for the restarted replica
PROCESS_TIMEOUT = 90.0
OP_TIMEOUT_S = 10.0  # torchft_client.OP_TIMEOUT


@pytest.fixture
def lighthouse() -> Any:
    # Replicas heartbeat every 100 ms: a dead one is out of the next quorum
    # after 1 s; the first quorum waits up to 2 s for a replica still starting.
    server = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000
    )
    yield server
    server.shutdown()


def _configure_and_abort(ctx: RankContext, route: str) -> dict[str, Any]:
    import xcomm
    from xcomm.torchft import ProcessGroupXcomm

    store = None
    port = [None]
    if ctx.rank == 0:
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        port = [store.port]
    dist.broadcast_object_list(port)  # on the harness's gloo group
    options = xcomm.Options(shm=route == "shm")
    pg = ProcessGroupXcomm(timeout=datetime.timedelta(seconds=30), options=options)
    out: dict[str, Any] = {"name": pg.getBackendName()}
    first = None
    for quorum in (1, 2):
        # what the Manager passes at a new quorum: a fresh prefix, the replica's rank
        pg.configure(f"localhost:{port[0]}/torchft/{quorum}/0", str(ctx.rank), ctx.rank, 2, quorum)
        t = torch.full((1000,), float(ctx.rank + 1) * quorum)
        out[f"waited{quorum}"] = pg.allreduce([t], dist.ReduceOp.SUM).wait()
        out[f"sum{quorum}"] = t.unique().tolist()
        out[f"errored{quorum}"] = pg.errored()
        out[f"shape{quorum}"] = pg.backend.plan["shape"]
        first = first or pg.backend  # kept alive to be read after the next configure()
    out["first_group_after_reconfigure"] = first.get_error().name
    out["allreduces"] = xcomm.stats()["ALLREDUCE"]["calls"]
    if ctx.rank == 1:  # never joins rank 0's next op
        ctx.wait_signal("released", 60)
        pg.abort()
        return out
    work = pg.allreduce([torch.ones(1 << 16)], dist.ReduceOp.SUM)
    current = pg.backend
    aborted_at: list[float] = []

    def abort() -> None:
        aborted_at.append(time.monotonic())
        pg.abort()
        out["abort_returned_after_s"] = time.monotonic() - aborted_at[0]

    timer = threading.Timer(0.5, abort)
    timer.start()
    out["pending_waited"] = work.wait()  # False: the op failed
    out["released_after_abort_s"] = time.monotonic() - aborted_at[0]
    timer.join()
    out["future_error"] = error_of(work.get_future().wait)
    out["errored_after_abort"] = str(pg.errored())
    # Dropping the aborted group, once the abort is over, does not wait for
    # Gloo's op either: the transports the abort let go of finish on their own.
    del work
    time.sleep(0.2)
    dropped_at = time.monotonic()
    del current
    out["dropped_after_s"] = time.monotonic() - dropped_at
    ctx.signal("released")
    return out


@pytest.mark.parametrize("route", ["shm", "plain"])
def test_configure_builds_a_new_group_and_abort_releases_a_pending_op(route: str) -> None:
    rank0, rank1 = run_ranks(
        _configure_and_abort, 2, route, backend="gloo", ref_group=False, timeout=120
    )
    shape = {"shm": "single-host shared memory", "plain": "plain"}[route]
    for r in (rank0, rank1):
        assert r["name"] == "torchft-xcomm"
        for quorum in (1, 2):
            assert r[f"waited{quorum}"] is True and r[f"sum{quorum}"] == [3.0 * quorum], r
            assert r[f"errored{quorum}"] is None and r[f"shape{quorum}"] == shape, r
        assert r["first_group_after_reconfigure"] == "COMM_ERROR", r  # aborted by configure()
        assert r["allreduces"] >= 2, r  # counted by xcomm
    # released by the abort within a second, not by the 30 s timeout
    assert rank0["pending_waited"] is False, rank0
    assert rank0["released_after_abort_s"] < 1.0, rank0
    # abort() itself returns at once too (the Manager calls it before each new
    # group), also while Gloo's route still holds the op rank 1 never joins
    assert rank0["abort_returned_after_s"] < 1.0, rank0
    assert rank0["dropped_after_s"] < 1.0, rank0
    assert rank0["future_error"] is not None and "aborted" in rank0["future_error"], rank0
    assert "aborted" in rank0["errored_after_abort"], rank0


class Replicas:
    """The replica processes of one run; every one is killed at the end."""

    def __init__(self, tmp: Path, pg: str, lighthouse_addr: str) -> None:
        self.tmp, self.pg, self.addr = tmp, pg, lighthouse_addr
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join(
                [str(HERE), str(HERE.parent / "python"), os.environ.get("PYTHONPATH", "")]
            ),
        }

    def start(self, tag: str, replica: int, steps: int, *flags: str) -> None:
        log = open(self.tmp / f"{tag}.log", "wb")  # noqa: SIM115 - the child holds it
        self.procs[tag] = subprocess.Popen(
            [sys.executable, str(CLIENT), self.pg, str(replica), self.addr]
            + [str(self.tmp / tag), str(steps), *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
        )
        log.close()

    def wait(self, tag: str) -> int:
        try:
            return self.procs[tag].wait(timeout=PROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.pg} replica {tag} hung:\n{self.log(tag)}")

    def log(self, tag: str) -> str:
        return (self.tmp / f"{tag}.log").read_text(errors="replace")[-4000:]

    def records(self, tag: str) -> list[dict[str, Any]]:
        path = self.tmp / f"{tag}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def result(self, tag: str) -> dict[str, Any]:
        return json.loads((self.tmp / f"{tag}.json").read_text())

    def kill_all(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()


@contextlib.contextmanager
def replicas(tmp: Path, pg: str, lighthouse_addr: str) -> Any:
    run = Replicas(tmp, pg, lighthouse_addr)
    try:
        yield run
    finally:
        run.kill_all()


def _ready(tmp: Path, name: str) -> str:
    return str(tmp / f"ready.{name}")


def _healthy_run(tmp: Path, pg: str, algo: str, lighthouse_addr: str) -> list[list[dict[str, Any]]]:
    tmp.mkdir()
    with replicas(tmp, pg, lighthouse_addr) as run:
        for r in (0, 1):
            run.start(
                f"r{r}",
                r,
                HEALTHY_STEPS,
                *("--ready", _ready(tmp, str(r)), "--wait", _ready(tmp, str(1 - r))),
                *("--algo", algo),
            )
        for tag in ("r0", "r1"):
            assert run.wait(tag) == 0, f"{pg} {tag}:\n{run.log(tag)}"
        return [run.records(t) + [run.result(t)] for t in ("r0", "r1")]


@pytest.mark.parametrize("algo", ["ddp", "diloco"])
def test_training_on_xcomm_matches_torchfts_gloo(
    tmp_path: Path, lighthouse: Any, algo: str
) -> None:
    started = time.monotonic()
    xcomm_run = _healthy_run(tmp_path / "xcomm", "xcomm", algo, lighthouse.address())
    gloo_run = _healthy_run(tmp_path / "gloo", "gloo", algo, lighthouse.address())
    print(f"{algo}, both runs: {time.monotonic() - started:.1f} s")

    for name, run in (("xcomm", xcomm_run), ("gloo", gloo_run)):
        for records in run:
            steps = records[:-1]
            assert [s["step"] for s in steps] == list(range(1, HEALTHY_STEPS + 1)), (name, steps)
            assert all(s["committed"] and s["participants"] == 2 for s in steps), (name, steps)
        # bit for bit the same parameters on both replicas after every step
        assert [s["hash"] for s in run[0]] == [s["hash"] for s in run[1]], name
    # ... and the same as on torchft's own Gloo group, step by step
    assert [s["hash"] for s in xcomm_run[0]] == [s["hash"] for s in gloo_run[0]]

    losses = [s["eval_loss"] for s in xcomm_run[0][:-1]]
    assert losses[-1] < 0.6 * losses[0], losses

    for records in xcomm_run:
        result = records[-1]
        assert result["pg"] == "torchft-xcomm" and result["backend_type"] == "XcommBackend"
        assert result["shape"] == "single-host shared memory", result
        # DDP: one gradient bucket per step; DiLoCo: a pseudo-gradient per parameter
        assert result["stats"]["ALLREDUCE"]["calls"] >= HEALTHY_STEPS, result
        assert result["stats"]["ALLREDUCE"]["failures"] == 0, result
    assert gloo_run[0][-1]["pg"] == "torchft-gloo"


def test_sigkilled_replica_rejoins_with_the_survivors_state(
    tmp_path: Path, lighthouse: Any
) -> None:
    started = time.monotonic()
    with replicas(tmp_path, "xcomm", lighthouse.address()) as run:
        run.start(
            "survivor",
            0,
            REJOIN_STEPS,
            *("--ready", _ready(tmp_path, "0"), "--wait", _ready(tmp_path, "1")),
            *("--hold-alone", str(HOLD_ALONE), "--hold-for", _ready(tmp_path, "1b")),
        )
        run.start(
            "killed",
            1,
            REJOIN_STEPS,
            *("--ready", _ready(tmp_path, "1"), "--wait", _ready(tmp_path, "0")),
            *("--kill-at", str(KILL_AT)),
        )
        assert run.wait("killed") == -9, run.log("killed")
        run.start("rejoined", 1, REJOIN_STEPS, "--ready", _ready(tmp_path, "1b"))
        for tag in ("survivor", "rejoined"):
            assert run.wait(tag) == 0, f"{tag}:\n{run.log(tag)}"
        survivor, killed, rejoined = (run.records(t) for t in ("survivor", "killed", "rejoined"))
        results = {t: run.result(t) for t in ("survivor", "rejoined")}
    print(f"kill and rejoin: {time.monotonic() - started:.1f} s")

    # Before the kill: the same parameters on both replicas after every step.
    assert [s["step"] for s in killed] == list(range(1, KILL_AT + 1)), killed
    assert [s["hash"] for s in survivor[:KILL_AT]] == [s["hash"] for s in killed]

    # The survivor's allreduce of the kill step was released by xcomm (the
    # dead peer), not by the timeout, and the step was not committed.
    failed = survivor[KILL_AT]
    assert not failed["committed"] and failed["step"] == KILL_AT, failed
    assert failed["error"] is not None and "died" in failed["error"], failed
    assert failed["seconds"] < OP_TIMEOUT_S / 2, failed
    assert results["survivor"]["stats"]["ALLREDUCE"]["failures"] >= 1, results

    # It trained on alone, then with the rejoined replica.
    after = survivor[KILL_AT + 1 :]
    alone = [s for s in after if s["committed"] and s["participants"] == 1]
    together = [s for s in after if s["committed"] and s["participants"] == 2]
    assert len(alone) >= HOLD_ALONE, survivor
    assert len(together) >= 3, survivor
    assert all(s["committed"] for s in after), survivor
    assert survivor[-1]["step"] == REJOIN_STEPS

    # The rejoined replica's first iteration ends at the survivor's step with
    # the survivor's parameters (on its own it would be at step 1), and so
    # does every later step, bit for bit.
    by_step = {s["step"]: s["hash"] for s in survivor if s["committed"]}
    assert rejoined[0]["step"] > KILL_AT + HOLD_ALONE, rejoined
    assert [s["hash"] for s in rejoined] == [by_step[s["step"]] for s in rejoined]
    assert rejoined[-1]["step"] == REJOIN_STEPS
    assert results["rejoined"]["hash"] == results["survivor"]["hash"]
    assert results["rejoined"]["stats"]["ALLREDUCE"]["calls"] > 0, results
    assert results["rejoined"]["shape"] == "single-host shared memory", results

    # Training went on through it all: the fixed-set loss fell.
    assert survivor[-1]["eval_loss"] < 0.6 * survivor[0]["eval_loss"], survivor


def test_the_kill_and_rejoin_example_runs_across_two_emulated_nodes() -> None:
    """``examples/torchft_kill_rejoin.py --nodes``: each replica on its own
    emulated node (1 Gbit/s), the lighthouse on node 0. Replica 1 is
    SIGKILLed, the survivor trains alone, and the restarted replica rejoins
    with the survivor's state fetched across the link; its parameters equal
    the survivor's bit for bit. The xcomm group between them is the plain
    route (one rank per host), so the allreduces crossed the link too."""
    sys.path.insert(0, str(HERE.parents[1]))
    from xcomm_bench.cluster import ClusterError, ClusterPermissionError, check_privileges

    try:
        check_privileges()
    except (ClusterPermissionError, ClusterError) as e:
        pytest.skip(f"needs root to build network namespaces: {e}")
    example = HERE.parents[1] / "examples" / "torchft_kill_rejoin.py"
    args = ["--nodes", "--rate", "1gbit", "--steps", "150", "--kill-at", "40"]
    proc = subprocess.run(
        [sys.executable, str(example), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "replicas bitwise equal at 150 of 150 steps" in out, out
    assert "the replicas' xcomm group: plain" in out, out
    assert "replica 1 SIGKILLed at step" in out and "rejoined at step" in out, out
    shared = re.search(r"bit for bit at all (\d+) shared steps: True", out)
    assert shared and int(shared.group(1)) >= 10, out  # --shared-steps' default
    kill = re.search(r"SIGKILLed at step (\d+)", out)
    rejoin = re.search(r"rejoined at step (\d+)", out)
    assert kill and rejoin and int(rejoin.group(1)) > int(kill.group(1)), out
