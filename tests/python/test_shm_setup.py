"""Setting up a group's shared-memory segment (csrc/transport/ShmTransport)
against a hostile or unlucky host: a segment name planted in the store by
another local user is refused before any data is written to it, and a
segment whose creator is killed while its peer maps it is removed, not left
in /dev/shm.
"""

from __future__ import annotations

import datetime
import os
import random
import signal
import textwrap
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import xcomm
import xcomm.backend
from dist_harness import DelegatingStore, RankContext, rank_scripts, run_ranks

SHM_DIR = "/dev/shm"
PLANTED_BYTES = 1 << 22


def _creator_fields() -> tuple[int, int, int]:
    """(pid namespace inode, pid, start time) of this process, as xcomm names them."""
    link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    namespace = int(link[link.index("[") + 1 : link.index("]")])
    with open("/proc/self/stat") as f:
        stat = f.read()
    start = int(stat[stat.rindex(")") + 2 :].split()[19])
    return namespace, os.getpid(), start


def _xcomm_like_name() -> str:
    namespace, pid, start = _creator_fields()
    return f"xcomm-shm-{namespace}-{pid}-{start}-{random.getrandbits(128):032x}"


def _plant(how: str) -> str:
    """Creates the attacker's segment; returns the name to plant in the store."""
    name = _xcomm_like_name() if how != "foreign-name" else "some-other-segment"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, PLANTED_BYTES)
        if how == "same-user-mode-0666":
            os.fchmod(fd, 0o666)
        elif how == "other-user-mode-0600":
            os.fchown(fd, 65534, 65534)  # nobody: the test runs as root
    finally:
        os.close(fd)
    return "/" + name


class _PlantingStore(DelegatingStore):
    """This rank's view of a store in which another local user overwrote the
    key under which rank 0 publishes its segment's name (a TCPStore takes
    writes from any local process)."""

    def __init__(self, inner: dist.Store, planted: str) -> None:
        super().__init__(inner)
        self.planted = planted

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        return self.planted.encode() if key.endswith("/shm/name") else value


def _rank_with_planted_name(ctx: RankContext, how: str) -> dict[str, Any]:
    base = dist.FileStore(os.path.join(ctx.tmpdir, "planted-store"), ctx.world_size)
    store: dist.Store = base
    planted = None
    if ctx.rank == 1:
        planted = _plant(how)
        store = _PlantingStore(base, planted)
    try:
        options = xcomm.Options(timeout=datetime.timedelta(seconds=30)).to_cpp()
        backend = xcomm._C.build_group(
            store, ctx.rank, ctx.world_size, options, xcomm.backend._gloo
        )
        x = torch.arange(10_000, dtype=torch.float32) * (ctx.rank + 1)
        backend.allreduce([x]).wait()
        ref = torch.arange(10_000, dtype=torch.float32) * (ctx.rank + 1)
        dist.all_reduce(ref, group=ctx.ref)
        untouched = None
        if planted is not None and how != "foreign-name":
            with open(SHM_DIR + planted, "rb") as f:
                untouched = f.read() == bytes(PLANTED_BYTES)
        return {"plan": dict(backend.plan), "equal": torch.equal(x, ref), "untouched": untouched}
    finally:
        if planted is not None and os.path.exists(SHM_DIR + planted):
            os.unlink(SHM_DIR + planted)


@pytest.mark.parametrize(
    "how, refusal",
    [
        ("same-user-mode-0666", "with mode 0666, where rank 0's belongs to uid"),
        ("other-user-mode-0600", "belongs to uid 65534 with mode 0600"),
        ("foreign-name", "refusing segment name '/some-other-segment' from the store"),
    ],
)
def test_a_segment_name_planted_in_the_store_is_refused_and_the_group_uses_gloo(
    how: str, refusal: str
) -> None:
    """Another local user who writes the segment's key in the unauthenticated
    store, pointing rank 1 at a segment it can read, gets nothing: rank 1
    refuses to map a segment not its own uid's with mode 0600 (or a name that
    is not xcomm's), every rank learns why, the group falls back to Gloo and
    reduces as gloo does, and the planted segment stays all zeros."""
    if how == "other-user-mode-0600" and os.geteuid() != 0:
        pytest.skip("planting a segment of another uid needs root")
    for rank, r in enumerate(run_ranks(_rank_with_planted_name, 2, how)):
        plan = r["plan"]
        assert plan["shape"] == "plain", plan["description"]
        assert refusal in plan["why"], plan["why"]
        assert r["equal"], r
        if rank == 1 and how != "foreign-name":
            assert r["untouched"] is True, r


_RANK_SCRIPT = textwrap.dedent(
    """
    import datetime, sys, time
    import torch.distributed as dist
    import xcomm, xcomm.backend
    from dist_harness import DelegatingStore  # tests/python is on PYTHONPATH

    path, rank, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    base = dist.FileStore(path, 2)
    base.set_timeout(datetime.timedelta(seconds=4))

    class LateStore(DelegatingStore):
        # A peer that is slow to map the segment: rank 0 waits for it with
        # the segment created and not yet unlinked.
        def get(self, key):
            if key.endswith("/shm/name"):
                open(path + ".late", "w").close()  # the test kills rank 0 now
                time.sleep(delay)
            return self.inner.get(key)

    store = LateStore(base) if rank == 1 else base
    options = xcomm.Options(timeout=datetime.timedelta(seconds=4)).to_cpp()
    t0 = time.monotonic()
    try:
        xcomm._C.build_group(store, rank, 2, options, xcomm.backend._gloo)
        print("built", flush=True)
    except Exception as e:
        print(f"error after {time.monotonic() - t0:.1f} s: {type(e).__name__}", flush=True)
    """
)


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith("xcomm-shm-") and f"-{pid}-" in n]


def test_a_creator_killed_while_its_peer_maps_the_segment_leaves_nothing(tmp_path: Any) -> None:
    """Rank 0 is SIGKILLed after creating its segment and before unlinking it
    (it waits for a late peer, which reads the segment's name once its Gloo
    group is connected): the peer unlinks the name itself once it has
    mapped the segment, or, when its set-up fails first, removes the segment
    its dead creator left (the name holds the creator's pid and start time),
    so nothing stays in /dev/shm."""
    store_path = str(tmp_path / "store")
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    with rank_scripts(script, [[store_path, str(r), "3.0"] for r in range(2)]) as ranks:
        deadline = time.monotonic() + 60
        while not (_segments_of(ranks[0].pid) and os.path.exists(store_path + ".late")):
            assert time.monotonic() < deadline, "rank 0 never created its segment"
            assert ranks[0].poll() is None, ranks[0].communicate()[0]
            time.sleep(0.01)
        segment = _segments_of(ranks[0].pid)[0]
        ranks[0].send_signal(signal.SIGKILL)
        ranks[0].wait()
        out, _ = ranks[1].communicate(timeout=60)
    # Rank 0 had reported before it was killed, so the peer's set-up may
    # succeed (its first op then finds rank 0 dead) or time out; either way
    # the segment is gone.
    assert out.startswith(("built", "error after")), out
    assert not os.path.exists(os.path.join(SHM_DIR, segment)), f"{segment} left in /dev/shm ({out})"


def test_a_umask_does_not_change_the_segments_mode() -> None:
    """Peers accept only mode 0600, so rank 0 sets it explicitly: under a
    umask of 0277 shm_open alone would make the segment 0400, every peer
    would refuse it and the group would fall back to Gloo."""
    for r in run_ranks(_rank_plan_and_mode, 2):
        assert r["shape"] == "single-host shared memory", r


def _rank_plan_and_mode(ctx: RankContext) -> dict[str, Any]:
    os.umask(0o277)
    group = dist.new_group(backend="xcomm")
    x = torch.ones(100)
    dist.all_reduce(x, group=group)
    assert x[0].item() == ctx.world_size
    return {"shape": xcomm.group_plan(group)["shape"]}
