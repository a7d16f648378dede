"""Tests of the emulated cluster (xcomm_bench/cluster).

The tests that build namespaces need root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and
iproute2; they are skipped otherwise. Each of them checks that nothing is
left behind: no namespace, no link in the root namespace, no rank process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from xcomm_bench.cluster import (
    ClusterError,
    ClusterPermissionError,
    EmulatedCluster,
    TbfConfig,
    check_privileges,
    cleanup_stale,
    measure_goodput,
    parse_rate,
)
from xcomm_bench.cluster import netns as netns_mod

REPO = Path(__file__).resolve().parents[2]

HAVE_PRIVILEGES = True
try:
    check_privileges()
except (ClusterPermissionError, ClusterError) as _e:
    HAVE_PRIVILEGES = False
    _WHY = str(_e)

needs_root = pytest.mark.skipif(
    not HAVE_PRIVILEGES,
    reason="needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2 to build network namespaces",
)


def _state() -> tuple[set[str], set[str], str]:
    """Namespaces, root-namespace links, root-namespace qdiscs."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    names = {line.split(":")[1].strip().split("@")[0] for line in links.stdout.splitlines()}
    qdiscs = subprocess.run(
        ["tc", "qdisc", "show"], capture_output=True, text=True, check=True
    ).stdout
    return set(netns_mod.list_netns()), names, _strip_handles(qdiscs)


def _strip_handles(qdiscs: str) -> str:
    lines = (
        " ".join(w for w in line.split() if not w.endswith(":")) for line in qdiscs.splitlines()
    )
    return "\n".join(sorted(lines))


def _procs_with(marker: str) -> list[int]:
    """PIDs whose command line contains ``marker``."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and str(os.getpid()) != d.name:
            pids.append(int(d.name))
    return pids


def _netns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


def _live_netns_inodes() -> set[int]:
    """Inodes of every network namespace a process is in or holds open, or that is mounted.

    A namespace that is no longer named (``ip netns list``) can still be alive,
    with its veth links and qdiscs, while a process sits in it or holds it open.
    """
    inodes: set[int] = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        links = [d / "ns" / "net"]
        try:
            links += list((d / "fd").iterdir())
        except OSError:
            pass
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target.startswith("net:["):
                inodes.add(int(target[5:-1]))
    with contextlib.suppress(OSError):
        for name in os.listdir("/run/netns"):
            with contextlib.suppress(OSError):
                inodes.add(_netns_inode(name))
    return inodes


@pytest.fixture
def no_leftovers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Asserts that the test left the host as it found it.

    Checked: no namespace of this process's clusters is named any more, and
    none is alive (no process in it, no open handle on it: a deleted but
    still referenced namespace keeps its links and qdiscs); the root
    namespace's links and qdiscs are unchanged. Namespaces of other users of
    the box (other test runs, benchmarks) are left out of the comparison.
    """
    from xcomm_bench.cluster import emulated

    created: dict[str, int] = {}
    real_build = emulated.EmulatedCluster._build

    def recording_build(self: EmulatedCluster) -> None:
        try:
            real_build(self)
        finally:
            for name in self._created:
                with contextlib.suppress(OSError):
                    created[name] = _netns_inode(name)

    monkeypatch.setattr(emulated.EmulatedCluster, "_build", recording_build)
    mine = f"xc{os.getpid()}-"
    before = _state()
    yield
    after = _state()
    left = sorted(n for n in after[0] - before[0] if n.startswith(mine) or n in created)
    assert not left, f"namespaces left behind: {left}"
    alive = _live_netns_inodes()
    still = sorted(name for name, ino in created.items() if ino in alive)
    assert not still, f"deleted namespaces still alive (a process or handle holds them): {still}"
    assert after[1] == before[1], (
        f"links changed in the root namespace: {sorted(after[1] ^ before[1])}"
    )
    assert after[2] == before[2], "qdiscs changed in the root namespace"


# ----------------------------------------------------------------- no root needed


def test_parse_rate_units_and_range() -> None:
    assert parse_rate("1gbit") == 1_000_000_000
    assert parse_rate("500mbit") == 500_000_000
    assert parse_rate("2.5gbit") == 2_500_000_000
    assert parse_rate("100000kbit") == 100_000_000
    assert parse_rate(1e9) == 1_000_000_000
    with pytest.raises(ValueError, match="units"):
        parse_rate("1gbps")  # tc's bps means bytes/s: refused on purpose
    with pytest.raises(ValueError, match=r"0\.1-10 Gbit/s"):
        parse_rate("50mbit")
    with pytest.raises(ValueError, match=r"0\.1-10 Gbit/s"):
        parse_rate("20gbit")


def test_tbf_defaults() -> None:
    assert TbfConfig.for_rate(100_000_000).burst_bytes == 32 * 1024
    assert TbfConfig.for_rate(1_000_000_000).burst_bytes == 125_000  # 1 ms
    assert TbfConfig.for_rate(10_000_000_000).burst_bytes == 5_000_000  # 4 ms
    tbf = TbfConfig.for_rate(1_000_000_000)
    assert tbf.latency_ms == 10
    assert tbf.tc_args() == ["tbf", "rate", "1000000000bit", "burst", "125000", "latency", "10ms"]
    with pytest.raises(ValueError):
        TbfConfig.for_rate(1_000_000_000, burst_bytes=100)


def test_privilege_refusal_message() -> None:
    with pytest.raises(ClusterPermissionError) as ei:
        check_privileges(capabilities=0)
    msg = str(ei.value)
    assert "root" in msg and "CAP_NET_ADMIN" in msg and "CAP_SYS_ADMIN" in msg


def test_privilege_refusal_in_context_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns_mod, "effective_capabilities", lambda: 0)
    before = netns_mod.list_netns() if shutil.which("ip") else []
    with pytest.raises(ClusterPermissionError, match="needs root"), EmulatedCluster(nodes=2):
        pytest.fail("the body must not run without privileges")
    if shutil.which("ip"):
        assert netns_mod.list_netns() == before


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        EmulatedCluster(nodes=0)
    with pytest.raises(ValueError):
        EmulatedCluster(nodes=2, ranks_per_node=0)
    with pytest.raises(ValueError):
        EmulatedCluster(nodes=2, rate="30gbit")
    for mtu in (50, 70000):
        with pytest.raises(ValueError, match="mtu must be in 68..65535"):
            EmulatedCluster(nodes=2, mtu=mtu)
    # tbf drops packets larger than its bucket: a jumbo MTU widens the default burst.
    assert EmulatedCluster(nodes=2, rate="100mbit", mtu=65000).tbf.burst_bytes >= 2 * 65000
    c = EmulatedCluster(nodes=2, ranks_per_node=2)
    assert c.world_size == 4
    assert c.rank_env(3)["NODE_RANK"] == "1"
    with pytest.raises(ClusterError, match="not running"):
        c.run(["true"])


# ----------------------------------------------------------------- root


@needs_root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv")
def test_cli_refuses_without_capabilities(no_leftovers: None) -> None:
    """A real unprivileged run: root with CAP_NET_ADMIN/CAP_SYS_ADMIN dropped."""
    proc = subprocess.run(
        [
            "setpriv",
            "--inh-caps=-all",
            "--bounding-set=-net_admin,-sys_admin",
            sys.executable,
            "-m",
            "xcomm_bench.cluster",
            "run",
            "--nodes",
            "2",
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 77, proc.stderr
    assert "needs root" in proc.stderr and "CAP_NET_ADMIN" in proc.stderr


@needs_root
def test_ranks_get_the_right_env(no_leftovers: None) -> None:
    probe = (
        "import json, os, subprocess\n"
        "def sh(*a): return subprocess.run(a, capture_output=True, text=True).stdout\n"
        "keys = ['MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE', 'LOCAL_RANK',\n"
        "        'LOCAL_WORLD_SIZE', 'NODE_RANK', 'GLOO_SOCKET_IFNAME', 'XCOMM_EXTRA']\n"
        "d = {k: os.environ.get(k) for k in keys}\n"
        "d['links'] = sh('ip', '-br', 'addr')\n"
        "d['lo'] = sh('ip', '-o', 'link', 'show', 'lo')\n"
        "d['qdisc'] = sh('tc', 'qdisc', 'show', 'dev', d['GLOO_SOCKET_IFNAME'])\n"
        "print(json.dumps(d))\n"
    )
    with EmulatedCluster(nodes=2, ranks_per_node=2, rate="1gbit", master_port=29555) as c:
        results = c.run(
            [sys.executable, "-c", probe], capture=True, env={"XCOMM_EXTRA": "x"}, timeout=60
        )
        addrs = [n.address for n in c.nodes]
        names = [n.netns for n in c.nodes]
        assert all(name in netns_mod.list_netns() for name in names)
    assert [r.rank for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r.returncode == 0, r.stderr
        env = json.loads(r.stdout)
        node = r.rank // 2
        assert env["MASTER_ADDR"] == addrs[0]
        assert env["MASTER_PORT"] == "29555"
        assert env["RANK"] == str(r.rank)
        assert env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(r.rank % 2)
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["NODE_RANK"] == str(node)
        assert env["GLOO_SOCKET_IFNAME"] == f"veth-n{node}"
        assert env["XCOMM_EXTRA"] == "x"
        links = {line.split()[0].split("@")[0]: line for line in env["links"].splitlines()}
        assert set(links) == {"lo", f"veth-n{node}"}, env["links"]
        assert "127.0.0.1" in links["lo"] and ",UP" in env["lo"], env["lo"]  # loopback is up
        assert addrs[node] in links[f"veth-n{node}"]
        assert "tbf" in env["qdisc"] and "rate 1Gbit" in env["qdisc"]


@needs_root
def test_nodes_reach_each_other_and_not_the_host(no_leftovers: None) -> None:
    script = (
        "import os, socket, sys\n"
        "if os.environ['RANK'] == '0':\n"
        "    s = socket.create_server(('0.0.0.0', 29600)); c, _ = s.accept(); c.sendall(b'hi'); c.close()\n"
        "else:\n"
        "    import time\n"
        "    for _ in range(100):\n"
        "        try:\n"
        "            c = socket.create_connection((os.environ['MASTER_ADDR'], 29600), timeout=2); break\n"
        "        except OSError: time.sleep(0.05)\n"
        "    print(c.recv(2).decode())\n"
    )
    with EmulatedCluster(nodes=2) as c:
        results = c.run([sys.executable, "-c", script], capture=True, timeout=60)
        # No route out of the namespace: the host's own address is unreachable.
        probe = c.run(["ip", "route", "get", "1.1.1.1"], capture=True, timeout=30)
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    assert results[1].stdout.strip() == "hi"
    assert all(r.returncode != 0 for r in probe), "a node has a route to the outside"


@needs_root
def test_failed_command_tears_down(no_leftovers: None) -> None:
    with EmulatedCluster(nodes=2, rate="500mbit") as c:
        results = c.run(["sh", "-c", "exit $((RANK + 3))"], capture=True, timeout=30)
    assert [r.returncode for r in results] == [3, 4]


@needs_root
def test_exception_in_body_tears_down(no_leftovers: None) -> None:
    marker = f"sleep 31{uuid.uuid4().int % 10000:04d}"
    with pytest.raises(RuntimeError, match="boom"), EmulatedCluster(nodes=2, rate="1gbit") as c:
        c.popen(0, ["sh", "-c", marker])
        c.popen(1, ["sh", "-c", marker])
        raise RuntimeError("boom")
    assert _procs_with(marker) == []


@needs_root
def test_rank_failure_kills_the_others_after_grace(no_leftovers: None) -> None:
    t0 = time.monotonic()
    with EmulatedCluster(nodes=2) as c:
        results = c.run(
            ["sh", "-c", 'if [ "$RANK" = 1 ]; then exit 5; fi; sleep 60'],
            fail_grace_s=0.5,
            timeout=30,
        )
    assert results[1].returncode == 5
    assert results[0].returncode < 0  # killed
    assert time.monotonic() - t0 < 20


@needs_root
def test_partial_build_failure_tears_down(
    no_leftovers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from xcomm_bench.cluster import emulated

    def broken_tc(*args: str, netns: str | None = None, check: bool = True) -> str:
        raise ClusterError("simulated tc failure")

    monkeypatch.setattr(emulated, "tc", broken_tc)
    with pytest.raises(ClusterError, match="simulated"), EmulatedCluster(nodes=3, rate="1gbit"):
        pytest.fail("unreachable")


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_cli_run_tears_down(no_leftovers: None, sig: signal.Signals) -> None:
    marker = f"sleep 47{uuid.uuid4().int % 10000:04d}"
    # The tool gets the signal's default action, as from a terminal: a test
    # run started in the background by a shell without job control has SIGINT
    # ignored, which the tool would inherit (and rightly keep running). A
    # Python handler here is the default again in the child after exec.
    previous = signal.signal(sig, lambda *_: None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "xcomm_bench.cluster",
            "run",
            "--nodes",
            "2",
            "--ranks-per-node",
            "2",
            "--rate",
            "1gbit",
            "--",
            "sh",
            "-c",
            marker,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    signal.signal(sig, previous)
    prefix = f"xc{proc.pid}-"
    try:
        deadline = time.monotonic() + 60
        while len(_procs_with(marker)) < 4:  # the 4 ranks (sh -c) are running
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        names = [n for n in netns_mod.list_netns() if n.startswith(prefix)]
        assert len(names) == 3, names  # the bridge's and the 2 nodes'
        inodes = {_netns_inode(n) for n in names}
        node0 = next(n for n in names if n.endswith("-n0"))
        qdisc = subprocess.run(
            ["tc", "-n", node0, "qdisc", "show", "dev", "veth-n0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc  # what must go away
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err.decode()
    assert b"torn down" in err
    assert not [n for n in netns_mod.list_netns() if n.startswith(prefix)]
    assert not inodes & _live_netns_inodes(), "a deleted namespace is still alive"
    assert _procs_with(marker) == []


@needs_root
def test_cleanup_stale_removes_dead_runs(no_leftovers: None) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"xc{dead.pid}-0-n0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        removed = cleanup_stale()
        assert name in removed
    finally:
        netns_mod.delete_netns(name)


@needs_root
def test_rate_limit_is_roughly_honoured(no_leftovers: None) -> None:
    with EmulatedCluster(nodes=2, rate="200mbit") as c:
        result = measure_goodput(c, seconds=1.5)
    assert 0.60 <= result.ratio <= 1.05, str(result)


@needs_root
def test_jumbo_mtu_is_set_and_the_rate_still_honoured(no_leftovers: None) -> None:
    with EmulatedCluster(nodes=2, rate="200mbit", mtu=65000) as c:
        links = [
            netns_mod.ip("-o", "link", "show", "dev", n.ifname, netns=n.netns) for n in c.nodes
        ]
        result = measure_goodput(c, seconds=1.5)
    assert all("mtu 65000" in line for line in links), links
    assert 0.60 <= result.ratio <= 1.05, str(result)


@needs_root
def test_set_rate_changes_a_running_clusters_links(no_leftovers: None) -> None:
    """The autoswitch benchmark slows the link mid-run: goodput follows the new rate."""
    with EmulatedCluster(nodes=2, rate="400mbit") as c:
        before = measure_goodput(c, seconds=1.0)
        c.set_rate("100mbit")
        after = measure_goodput(c, seconds=1.5)
    assert 0.60 <= before.ratio <= 1.05, str(before)
    assert after.rate_bps == parse_rate("100mbit")
    assert 0.60 <= after.ratio <= 1.05, str(after)
