"""The chaos suite's infrastructure, proven on real namespaces, real TCP and a real etcd.

Needs root, ``ip`` and ``iptables``; fails (never skips) with a message naming
what is missing otherwise. No assertion is about timing: every wait is a
poll with a generous deadline, and "traffic blocked" is observed as a failed
connect or a missing reply, never as "took longer than".
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chaos.etcd_cluster import EtcdCluster
from chaos.faults import (
    Fault,
    FaultEvent,
    HealthCheckFailed,
    Isolate,
    Kill,
    OneWayDrop,
    Partition,
    Pause,
    ProxyOneWay,
    run_schedule,
    schedule,
)
from chaos.netns import (
    ChaosEnvironmentError,
    NetnsCluster,
    SubnetInUse,
    choose_subnet,
    cleanup_stale,
    list_namespaces,
    missing_requirements,
    namespace_pids,
    preflight,
)
from chaos.probe import Outcome, probe_from
from chaos.proxy import Proxy, start_proxy
from phalanx import procs
from tests.chaos.conftest import start_echo

pytestmark = pytest.mark.chaos

ECHO = 7000
REPO = Path(__file__).resolve().parents[2]


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    """Running or stopped, not a zombie (a reparented zombie may never be reaped in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def ours(prefix: str) -> list[str]:
    return [ns for ns in list_namespaces() if ns.startswith(prefix + "-")]


# ---------------------------------------------------------------------------
# Preflight and pure helpers


def test_preflight_names_every_missing_requirement() -> None:
    msgs = missing_requirements(euid=1000, which=lambda _: None, netns_supported=False)
    text = "\n".join(msgs)
    assert "not running as root (euid=1000)" in text
    assert "no `ip` command" in text and "iproute2" in text
    assert "no `iptables` command" in text
    assert "no network namespaces" in text
    assert missing_requirements(0, lambda n: f"/usr/sbin/{n}") == []
    # This machine is supposed to run the suite: if it cannot, fail loudly here.
    preflight()


def test_cluster_refuses_to_start_without_its_tools(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no ip, no iptables
    net = NetnsCluster()
    with pytest.raises(ChaosEnvironmentError, match=r"no `ip` command on PATH.*no `iptables` command"):
        net.start()
    monkeypatch.undo()
    assert ours(net.prefix) == []
    net.teardown()  # nothing was made; still safe


def test_subnet_overlapping_a_root_route_is_refused() -> None:
    import ipaddress

    used = [ipaddress.IPv4Network("10.213.0.0/20")]
    with pytest.raises(SubnetInUse, match="overlaps 10.213.0.0/20"):
        choose_subnet("abc", used, requested="10.213.5.0/24")
    picked = choose_subnet("abc", used)
    assert not picked.overlaps(used[0]) and picked.subnet_of(ipaddress.IPv4Network("10.213.0.0/16"))


# ---------------------------------------------------------------------------
# Hosts, bridge, iptables faults


def test_two_hosts_talk_over_the_bridge(net: NetnsCluster, tmp_path: Path) -> None:
    a = net.add_host("node-a", az="a")
    b = net.add_host("node-b", az="b")
    assert a.netns == f"{net.prefix}-node-a" and a.ip != b.ip
    links = a.run(["ip", "-o", "link"]).stdout
    assert re.findall(r"^\d+: (\S+?)[@:]", links, re.M) == ["lo", "eth0"]
    start_echo(a, ECHO, tmp_path / "a.log")
    assert probe_from(b, a.ip, ECHO, "hello") is Outcome.REPLIED
    assert (tmp_path / "a.log").read_text() == f"{b.ip} hello\n"


def test_partition_blocks_both_ways_and_heal_restores(net: NetnsCluster, tmp_path: Path) -> None:
    a, b, c = (net.add_host(n, az=n[-1]) for n in ("h-a", "h-b", "h-c"))
    for h in (a, b):
        start_echo(h, ECHO, tmp_path / f"{h.name}.log")
    history: list[FaultEvent] = []

    def a_b_connected() -> bool:
        return probe_from(b, a.ip, ECHO) is Outcome.REPLIED

    fault = Partition([a], [b], record=history.append, before=[a_b_connected], after=[a_b_connected])
    fault.inject()
    assert probe_from(b, a.ip, ECHO, connect_timeout=1) is Outcome.CONNECT_FAILED
    assert probe_from(a, b.ip, ECHO, connect_timeout=1) is Outcome.CONNECT_FAILED
    assert probe_from(c, a.ip, ECHO) is Outcome.REPLIED  # only a|b is cut
    assert f"-A INPUT -s {b.ip}/32 -j DROP" in a.iptables_save()
    fault.heal()  # the after-check proves a<->b works again
    assert probe_from(a, b.ip, ECHO) is Outcome.REPLIED
    assert "DROP" not in a.iptables_save() + b.iptables_save()
    assert [(e.name, e.action) for e in history] == [(fault.name, "inject"), (fault.name, "heal")]
    assert history[0].ts <= history[1].ts


def test_isolate_cuts_one_host_from_the_rest(net: NetnsCluster, tmp_path: Path) -> None:
    a, b, c = (net.add_host(n) for n in ("i-a", "i-b", "i-c"))
    start_echo(c, ECHO, tmp_path / "c.log")
    fault = Isolate(a, list(net.hosts.values()))
    fault.inject()
    try:
        assert probe_from(a, c.ip, ECHO, connect_timeout=1) is Outcome.CONNECT_FAILED
        assert probe_from(b, c.ip, ECHO) is Outcome.REPLIED
    finally:
        fault.heal()
    assert probe_from(a, c.ip, ECHO) is Outcome.REPLIED


def test_one_way_drop_breaks_tcp_in_both_directions(net: NetnsCluster, tmp_path: Path) -> None:
    a = net.add_host("w-a")
    b = net.add_host("w-b")
    for h in (a, b):
        start_echo(h, ECHO, tmp_path / f"{h.name}.log")
    fault = OneWayDrop([a], [b])
    fault.inject()
    try:
        assert f"-A OUTPUT -d {b.ip}/32 -j DROP" in a.iptables_save()
        assert "DROP" not in b.iptables_save()  # only the source has a rule...
        # ...yet TCP fails both ways: a's SYNs are dropped, and so are a's
        # SYN-ACKs to b's connection attempts.
        assert probe_from(a, b.ip, ECHO, connect_timeout=1) is Outcome.CONNECT_FAILED
        assert probe_from(b, a.ip, ECHO, connect_timeout=1) is Outcome.CONNECT_FAILED
    finally:
        fault.heal()
    assert probe_from(a, b.ip, ECHO) is Outcome.REPLIED
    assert probe_from(b, a.ip, ECHO) is Outcome.REPLIED


# ---------------------------------------------------------------------------
# Proxy


def test_proxy_one_way_delivers_requests_and_loses_replies(net: NetnsCluster, tmp_path: Path) -> None:
    server, px, client = net.add_host("srv"), net.add_host("px"), net.add_host("cli")
    log = tmp_path / "server.log"
    start_echo(server, ECHO, log)
    proxy = start_proxy(px, 7100, (server.ip, ECHO), tmp_path / "px.sock", seed=1)
    via = proxy.listen
    assert probe_from(client, *via, "through") is Outcome.REPLIED

    history: list[FaultEvent] = []
    reply_lost = ProxyOneWay(proxy.control, "s2c", record=history.append)
    reply_lost.inject()
    # The request arrives (logged by the server), the reply never comes back,
    # and the connection is still open when the client gives up.
    assert probe_from(client, *via, "req-1", reply_timeout=1) is Outcome.NO_REPLY
    wait_until(lambda: f"{px.ip} req-1\n" in log.read_text(), what="request at the server")
    wait_until(lambda: proxy.control.stats()["bytes_dropped_s2c"] > 0, what="reply dropped by the proxy")
    reply_lost.heal()
    assert probe_from(client, *via, "req-2") is Outcome.REPLIED

    request_lost = ProxyOneWay(proxy.control, "c2s", record=history.append)
    request_lost.inject()
    assert probe_from(client, *via, "req-3", reply_timeout=1) is Outcome.NO_REPLY
    # The proxy read those bytes and discarded them, so the server never will.
    wait_until(lambda: proxy.control.stats()["bytes_dropped_c2s"] > 0, what="request dropped by the proxy")
    request_lost.heal()
    assert probe_from(client, *via, "req-4") is Outcome.REPLIED
    assert "req-3" not in log.read_text()
    assert [e.action for e in history] == ["inject", "heal", "inject", "heal"]


def test_proxy_delay_holds_replies_until_lowered(net: NetnsCluster, tmp_path: Path) -> None:
    server, px, client = net.add_host("srv"), net.add_host("px"), net.add_host("cli")
    log = tmp_path / "server.log"
    start_echo(server, ECHO, log)
    proxy = start_proxy(px, 7100, (server.ip, ECHO), tmp_path / "px.sock")
    # Ten minutes: far beyond anything this test waits, so "not yet delivered"
    # is a fact about the proxy, not about scheduling.
    proxy.control.set_delay(c2s_ms=0, s2c_ms=600_000)
    waiting = client.popen(
        [sys.executable, "-m", "chaos.probe", "send", *map(str, proxy.listen),
         "--message", "slow", "--reply-timeout", "120"],
        stdout=subprocess.PIPE, text=True,
    )
    wait_until(lambda: "slow" in log.read_text(), what="request at the server")
    wait_until(lambda: proxy.control.stats()["held_chunks_s2c"] >= 1, what="reply held by the proxy")
    assert waiting.poll() is None
    proxy.control.set_delay(0, 0)  # applies to held chunks too: released now
    out, _ = waiting.communicate(timeout=60)
    assert waiting.returncode == Outcome.REPLIED, out
    assert out.strip() == "REPLIED echo slow"


def test_proxy_loss_close_aborts_connections(net: NetnsCluster, tmp_path: Path) -> None:
    server, px, client = net.add_host("srv"), net.add_host("px"), net.add_host("cli")
    start_echo(server, ECHO, tmp_path / "server.log")
    proxy = start_proxy(px, 7100, (server.ip, ECHO), tmp_path / "px.sock")
    proxy.control.set_loss(1.0, "close")
    assert probe_from(client, *proxy.listen) is Outcome.CLOSED
    assert proxy.control.stats()["connections_lost"] >= 1
    proxy.control.set_loss(0.0)
    assert probe_from(client, *proxy.listen) is Outcome.REPLIED


def test_proxy_loss_decisions_are_reproducible_from_the_seed() -> None:
    """Same seed and chunk sequence -> same chunks lost (in-process, no network)."""
    import asyncio

    class Chunks:
        def __init__(self, n: int) -> None:
            self.left = [bytes([i]) for i in range(n)]

        async def read(self, _: int) -> bytes:
            return self.left.pop(0) if self.left else b""

    def lost(seed: int) -> list[int]:
        proxy = Proxy(("127.0.0.1", 0), ("127.0.0.1", 1))
        proxy.command("LOSS 0.3 drop")
        queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        rng = random.Random(f"{seed}/0/c2s")  # what connection 0 draws from
        asyncio.run(proxy._read(None, "c2s", Chunks(64), queue, asyncio.Event(), rng))  # type: ignore[arg-type]
        kept = {d[0] for _, d in queue if d}
        return [i for i in range(64) if i not in kept]

    assert lost(7) == lost(7)
    assert lost(7) != lost(8)
    assert 0 < len(lost(7)) < 64


# ---------------------------------------------------------------------------
# Fault objects and schedules (no network)


class Flag(Fault):
    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.on = False

    def _inject(self) -> None:
        self.on = True

    def _heal(self) -> None:
        self.on = False


def test_health_checks_gate_inject_and_prove_heal() -> None:
    f = Flag("flag", before=[lambda: False], settle_timeout=0.2)
    with pytest.raises(HealthCheckFailed, match="before inject"):
        f.inject()
    assert not f.on and not f.active
    g = Flag("flag2", after=[lambda: 1 / 0 == 0], settle_timeout=0.2)
    g.inject()
    assert g.on
    with pytest.raises(HealthCheckFailed, match="raised ZeroDivisionError.*after heal"):
        g.heal()
    assert not g.on  # healed, and the failed check was reported


def test_schedule_is_reproducible_and_run_heals_everything() -> None:
    faults: list[Fault] = [Flag("x"), Flag("y"), Flag("z", hold=0.05)]
    s1 = [st.describe() for st in schedule(42, faults, 60.0)]
    assert s1 == [st.describe() for st in schedule(42, faults, 60.0)]
    assert s1 != [st.describe() for st in schedule(43, faults, 60.0)]
    for prev, nxt in zip(s1, s1[1:]):
        assert prev["at"] + prev["hold"] <= nxt["at"]  # one fault at a time
    assert s1[-1]["at"] + s1[-1]["hold"] <= 60.0

    history: list[FaultEvent] = []
    quick: list[Fault] = [Flag("p", record=history.append), Flag("q", record=history.append)]
    steps = schedule(3, quick, 1.0, hold=(0.01, 0.02), gap=(0.0, 0.01))
    run_schedule(steps)
    assert [e.action for e in history] == ["inject", "heal"] * len(steps)
    assert [e.name for e in history[::2]] == [st.fault.name for st in steps]
    assert not any(f.active for f in quick)

    stop = threading.Event()
    stop.set()
    run_schedule(schedule(3, quick, 1.0), stop=stop)  # returns at once, nothing left active
    assert not any(f.active for f in quick)


# ---------------------------------------------------------------------------
# A real 3-member etcd cluster, one member per AZ namespace


def test_etcd_three_members_survive_one_loss_not_two(net: NetnsCluster, tmp_path: Path) -> None:
    etcd = EtcdCluster.build(net, tmp_path / "etcd").start()
    assert etcd.member_health() == {"a": True, "b": True, "c": True}
    # Members serve TLS only, and only to a client certificate of their CA.
    a = etcd.members["a"]
    assert a.server.client_url == f"https://{a.host.ip}:2379" and a.server.peer_url.startswith("https://")
    assert etcd.root_dir is not None
    plain = etcd.client.run(["etcdctl", f"--endpoints=http://{a.endpoint}", "--dial-timeout=1s",
                             "--command-timeout=2s", "get", "x"], env={**os.environ, "ETCDCTL_API": "3"}, timeout=30)
    no_cert = etcd.client.run(["etcdctl", f"--endpoints={a.server.client_url}", f"--cacert={etcd.root_dir / 'ca.crt'}",
                               "--dial-timeout=1s", "--command-timeout=2s", "get", "x"],
                              env={**os.environ, "ETCDCTL_API": "3"}, timeout=30)
    assert plain.returncode != 0 and no_cert.returncode != 0, (plain.stderr, no_cert.stderr)

    history: list[FaultEvent] = []
    kill_a = Kill(etcd.process_ref("a"), restart=etcd.restarter("a"), name="kill-etcd-a",
                  record=history.append, before=[etcd.healthy], after=[etcd.healthy])
    kill_a.inject()
    # One of three down: the other two still form a quorum (after an election
    # if a led, hence a wait rather than a single try).
    wait_until(lambda: etcd.can_write(["b", "c"]), what="writes through b, c with a dead")
    assert etcd.member_health(["b", "c"]) == {"b": True, "c": True}

    etcd.kill("b")
    # Two of three down: no quorum, a write with a short timeout fails.
    assert not etcd.can_write(["c"], timeout=1.0)
    assert etcd.member_health(["c"]) == {"c": False}

    etcd.restart("b")  # back to two of three: quorum again
    kill_a.heal()  # restarts a; the after-check waits for all three healthy
    assert etcd.can_write()
    assert [(e.name, e.action) for e in history] == [("kill-etcd-a", "inject"), ("kill-etcd-a", "heal")]

    # An isolated member loses its leader; the majority keeps writing.
    iso = Isolate(etcd.members["a"].host, [etcd.members[z].host for z in "bc"],
                  after=[etcd.healthy], record=history.append)
    iso.inject()
    wait_until(lambda: etcd.can_write(["b", "c"]), what="writes through b, c with a isolated")
    wait_until(lambda: etcd.member_health(["a"]) == {"a": False}, what="isolated member unhealthy")
    iso.heal()

    # A paused (SIGSTOPped) member is the same as a dead one to its peers.
    pause_c = Pause(etcd.process_ref("c"), seconds=1.0, after=[etcd.healthy], record=history.append)
    pause_b = Pause(etcd.process_ref("b"), seconds=1.0, name="pause-b", record=history.append)
    assert etcd.member_health(["c"]) == {"c": True}  # it answers before the pause...
    pause_c.inject()
    try:
        # ...and not while paused (its sockets stay open, nothing replies), so
        # the pause took effect: what follows is survival of a real loss.
        assert etcd.member_health(["c"]) == {"c": False}
        wait_until(lambda: etcd.can_write(["a", "b"]), what="writes through a, b with c paused")
        # A second paused member is a second loss: no quorum, a write fails.
        pause_b.inject()
        assert etcd.member_health(["b"]) == {"b": False}
        assert not etcd.can_write(["a"], timeout=1.0)
    finally:
        pause_b.heal()  # no health check of its own: c may still be paused
        pause_c.heal()  # then all three healthy again
    assert etcd.healthy() and etcd.can_write()


# ---------------------------------------------------------------------------
# Teardown and leftovers


def root_state() -> dict[str, str]:
    """What the root namespace looks like, minus counters and timestamps."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    routes = subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True, text=True, check=True).stdout
    return {
        "links": "\n".join(sorted(re.findall(r"^\d+: (\S+?)[@:]", links, re.M))),
        "iptables": "\n".join(re.sub(r"\[\d+:\d+\]", "", ln) for ln in rules.splitlines() if not ln.startswith("#")),
        "routes": routes,
    }


def test_teardown_leaves_nothing_behind(tmp_path: Path) -> None:
    before = root_state()
    with NetnsCluster() as net:
        a, b = net.add_host("t-a"), net.add_host("t-b")
        # A child that forks a grandchild: only killing the whole group (or
        # the namespace's pids) gets both.
        sh = a.popen(["sh", "-c", "sleep 1000 & sleep 1000"])
        sleeper = b.popen(["sleep", "1000"])
        stopped = b.popen(["sleep", "1000"])
        os.kill(stopped.pid, signal.SIGSTOP)  # a stopped process must die too
        wait_until(lambda: len(a.pids()) >= 2, what="grandchild started")
        pids = a.pids() + [sleeper.pid, stopped.pid]
        Partition([a], [b]).inject()  # never healed: teardown must remove it
        prefix = net.prefix
        assert len(ours(prefix)) == 3
    assert ours(prefix) == []
    assert [p for p in pids if pid_alive(p)] == []
    assert all(p.poll() is not None for p in (sh, sleeper, stopped))
    assert not Path(f"/run/phalanx-chaos/{prefix}.lock").exists()
    assert root_state() == before
    net.teardown()  # idempotent


def test_teardown_runs_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with NetnsCluster() as net:
            h = net.add_host("x")
            proc = h.popen(["sleep", "1000"])
            raise RuntimeError("boom")
    assert ours(net.prefix) == [] and proc.poll() is not None


SCRIPT = textwrap.dedent("""
    import sys, time
    from chaos.netns import NetnsCluster
    net = NetnsCluster(clean_stale=False).start()
    h = net.add_host("victim")
    p = h.popen(["sleep", "1000"])
    print(net.prefix, p.pid, flush=True)
    if sys.argv[1] == "exit":
        sys.stdin.readline()
        sys.exit(3)  # no teardown call: atexit has to do it
    time.sleep(1000)
""")


def start_owner(tmp_path: Path, mode: str = "sleep") -> tuple[subprocess.Popen[str], str, int]:
    """A separate process that owns a cluster with one sleeping process in it."""
    script = tmp_path / "owner.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # TERM when this test run dies: the owner's handler then tears its cluster
    # down, so a killed pytest leaves neither the owner nor its namespaces.
    owner = procs.spawn([sys.executable, str(script), mode], die_with_parent=procs.TERM,
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert owner.stdout is not None
    line = owner.stdout.readline().split()
    assert len(line) == 2, f"owner did not start (exit {owner.poll()})"
    return owner, line[0], int(line[1])


@pytest.mark.parametrize("ending", ["SIGTERM", "SIGINT", "exit"])
def test_owner_ending_tears_the_cluster_down(tmp_path: Path, ending: str) -> None:
    owner, prefix, sleeper = start_owner(tmp_path, "exit" if ending == "exit" else "sleep")
    assert len(ours(prefix)) == 2 and pid_alive(sleeper)
    if ending == "exit":
        owner.communicate("go\n", timeout=60)
        assert owner.returncode == 3
    else:
        sig = getattr(signal, ending)
        owner.send_signal(sig)
        # The handler tears down, then lets the signal do what it did before
        # (SIGTERM: die by it; SIGINT: KeyboardInterrupt, which also ends in it).
        assert owner.wait(timeout=60) == -sig
    assert ours(prefix) == []
    assert not pid_alive(sleeper)


def test_cleanup_stale_removes_a_killed_runs_leftovers_only(tmp_path: Path) -> None:
    # A run that died by SIGKILL leaves its namespaces behind (its processes
    # die with it: Host.popen starts them with a parent-death signal)...
    owner, prefix, sleeper = start_owner(tmp_path)
    owner.kill()
    owner.wait(timeout=30)
    assert len(ours(prefix)) == 2
    wait_until(lambda: not pid_alive(sleeper), what="the killed run's process dying with it")
    # ...and so does someone's hand-made namespace with a process in it.
    hand = "phx0stale0"
    subprocess.run(["ip", "netns", "add", f"{hand}-x"], check=True)
    # Through spawn like Host.popen (the signal survives ip netns exec's exec):
    # a killed test run leaves no sleeper behind, only the namespace for the
    # next run's cleanup_stale().
    hand_proc = procs.spawn(["ip", "netns", "exec", f"{hand}-x", "sleep", "1000"], die_with_parent=procs.KILL)
    wait_until(lambda: hand_proc.pid in namespace_pids(f"{hand}-x"),
               what="hand-made process in its namespace")
    with NetnsCluster(clean_stale=False) as live:
        live.add_host("keep")
        report = cleanup_stale()
        # The live run holds its lock: untouched.
        assert sorted(ours(live.prefix)) == [f"{live.prefix}-br", f"{live.prefix}-keep"]
    assert ours(prefix) == [] and ours(hand) == []
    assert {f"{prefix}-br", f"{prefix}-victim", f"{hand}-x"} <= set(report.namespaces)
    assert hand_proc.pid in report.killed_pids
    assert hand_proc.wait(timeout=30) == -signal.SIGKILL
    assert not pid_alive(sleeper)
    assert not Path(f"/run/phalanx-chaos/{prefix}.lock").exists()
