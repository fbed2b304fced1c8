"""``phalanx up``: starts a whole cluster, secure by default (mutual TLS on
every gRPC hop, etcd over TLS with client certificates and per-cluster
users), serves the API through the client config it prints, and leaves
nothing behind when stopped (no process, no temp state dir).

Every child of ``up`` leads its own session, so "nothing left behind" is
checked as: no live process remains in any session that ``up``'s children
led, and ``up``'s direct children are all gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from phalanx import etcd_pki, procs
from phalanx.client import AsyncClient
from phalanx.errors import PhalanxError
from phalanx.etcd_server import EtcdServer
from phalanx.programs import require
from phalanx.metrics import ScrapeError, scrape
from phalanx.tls import TlsFiles
from phalanx.up import UpProcess
from phalanx.up.credentials import ADMIN_NAME
from phalanx.up.up_process import proc_stat
from tests.conftest import etcdctl
from tests.pki import EtcdPki

pytestmark = pytest.mark.integration


def child_sessions(pid: int) -> dict[int, int]:
    """pid -> session id of every direct child of ``pid``."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None and st[0] == pid:
                out[int(entry)] = st[2]
    return out


def live_in_sessions(sessions: set[int]) -> list[int]:
    """Processes (zombies excluded: they hold nothing) in any of ``sessions``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None and st[2] in sessions and st[3] != "Z":
                found.append(int(entry))
    return found


def agents_cmdline(pid: int) -> list[str] | None:
    """The argv of ``pid`` when it is an agents process (agent.sim), else None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    return argv if "agent.sim" in argv else None


def assert_agents_reach_no_etcd(argv: list[str], etcd_endpoint: str, foreign: list[str]) -> None:
    """An agents process's command line names no etcd endpoint and no etcd
    credential, and no coordinator of another AZ (``foreign``)."""
    text = " ".join(argv)
    assert "--etcd" not in text and "etcd-pki" not in text and etcd_endpoint not in text, argv
    assert "--coordinators" in argv, argv
    given = argv[argv.index("--coordinators") + 1].split(",")
    assert given and not set(given) & set(foreign), (given, foreign)


def processes_mentioning(token: str) -> list[int]:
    """Live processes whose command line contains ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            st = proc_stat(int(entry))
            if token.encode() in cmdline and st is not None and st[3] != "Z":
                found.append(int(entry))
    return found


async def leaders(up: UpProcess) -> set[str]:
    async with AsyncClient(up.address, **up.client_kwargs()) as client:
        st = await client.status()
        return {az.az for az in st.azs if az.has_leader}


async def plaintext_status(address: str) -> str:
    """A client without certificates: what it gets (an error) as text."""
    async with AsyncClient(address, timeout=5.0, insecure=True) as client:
        try:
            await client.status()
        except PhalanxError as exc:
            return str(exc)
    return "answered"


def etcdctl_fails(*argv: str) -> str:
    """Run etcdctl; it must fail: its error output."""
    done = subprocess.run([require("etcdctl"), *argv], env=dict(os.environ, ETCDCTL_API="3"), capture_output=True, text=True,
                          timeout=30)
    assert done.returncode != 0, f"etcdctl {' '.join(argv)} succeeded: {done.stdout[:300]}"
    return done.stderr


def metrics_lines(up: UpProcess, scheme: str) -> dict[str, str]:
    """Process name -> HOST:PORT of its /metrics, from up's lines (all of them ``scheme``)."""
    urls = up.metrics_urls()
    assert all(u.startswith(f"{scheme}://") for u in urls.values()), urls
    return {name: u.removeprefix(f"{scheme}://").removesuffix("/metrics") for name, u in urls.items()}


def scrape_families(address: str, tls: TlsFiles | None, cluster: str) -> dict[str, object]:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(scrape(address, tls=tls, cluster=cluster))}


def wait_agents_connected(address: str, tls: TlsFiles | None, cluster: str, nodes: int, timeout: float = 60.0) -> None:
    """Until the agent process's session gauge counts ``nodes`` (it sums its agents)."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        family = scrape_families(address, tls, cluster)["phalanx_agent_sessions_connected"]
        value = family.samples[0].value  # type: ignore[attr-defined]
        if value == nodes:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{address}: phalanx_agent_sessions_connected is {value}, not {nodes}, after {timeout}s")


def test_up_no_workload_starts_everything_and_leaves_nothing_behind() -> None:
    cluster = "t" + uuid.uuid4().hex[:10]
    up = UpProcess([
        "--no-workload", "--cluster", cluster, "--azs", "2", "--coordinators-per-az", "2", "--nodes-per-az", "2",
        "--base-port", "0",
    ])
    try:
        up.start()
        assert up.proc is not None
        # Exactly one address line, naming every coordinator (2 AZs x 2).
        assert len([line for line in up.lines if line.startswith("PHALANX_ADDRESS=")]) == 1
        assert len(up.addresses) == 4 and len(set(up.addresses)) == 4
        assert asyncio.run(leaders(up)) >= {"az-a", "az-b"}
        # etcd + 4 coordinators + 2 agent processes, each leading its own session.
        children = child_sessions(up.proc.pid)
        assert len(children) == 7, children
        assert all(pid == sid for pid, sid in children.items())
        assert up.state_dir is not None and (up.state_dir / "logs").is_dir()
        assert any(p.name == "etcd.log" for p in (up.state_dir / "logs").iterdir())

        # The one line that tells the user how the CLI finds its credentials,
        # and the CLI, given only that, reaches the cluster over mutual TLS.
        assert up.config is not None and up.config.parent == up.state_dir
        assert up.find_line(r"^phalanx up: for the CLI, the SDK and `phalanx logs` in any shell, run the next line ")
        assert f" PHALANX_CONFIG={up.config} PHALANX_STATE_DIR={up.state_dir}" in up.activation, up.activation
        done = subprocess.run([sys.executable, "-m", "phalanx", "status"], env=up.client_env(), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"cluster {cluster} " in done.stdout and "az-b" in done.stdout, done.stdout
        # Every coordinator serves TLS only: a client without a certificate is refused by each.
        for address in up.addresses:
            refused = asyncio.run(plaintext_status(address))
            assert refused != "answered" and "no coordinator could answer" in refused, (address, refused)

        # One metrics line per process, each served over HTTPS to the
        # cluster's client certificates only; each agent process's gauge
        # counts its 2 simulated nodes.
        metrics = metrics_lines(up, "https")
        assert sorted(metrics) == ["az-a-agents", "az-a-c0", "az-a-c1", "az-b-agents", "az-b-c0", "az-b-c1"], up.lines
        assert up.admin_dir is not None
        admin = TlsFiles(up.admin_dir / "ca.crt", up.admin_dir / "client.crt", up.admin_dir / "client.key")
        for name, address in metrics.items():
            if name.endswith("-agents"):
                wait_agents_connected(address, admin, cluster, 2)
            else:
                assert any(n.startswith("phalanx_") for n in scrape_families(address, admin, cluster)), name
            with pytest.raises(ScrapeError):
                scrape(address, tls=None, cluster=cluster)

        # etcd: TLS with client certificates, and least-privilege users.
        m = up.find_line(r"^phalanx up: etcd at (\S+) \(TLS, client certificates; pid \d+\)")
        assert m is not None, "\n".join(up.lines)
        endpoint, prefix = m.group(1), f"/phalanx/{cluster}/"
        pki = up.state_dir / "etcd-pki"
        root = etcd_pki.files(pki / etcd_pki.ROOT_USER)
        # Plaintext: refused (the member speaks TLS only).
        etcdctl_fails("--endpoints", f"http://{endpoint}", "--dial-timeout", "3s", "--command-timeout", "5s",
                      "get", "--prefix", prefix)
        # TLS without a client certificate: refused by the handshake.
        etcdctl_fails("--endpoints", f"https://{endpoint}", "--cacert", str(root.ca), "--dial-timeout", "3s",
                      "--command-timeout", "5s", "get", "--prefix", prefix)
        # Agents hold no etcd credentials (they read through their AZ's
        # coordinators): no agent etcd user issued, none given.
        assert not (pki / etcd_pki.user_for(cluster, "agent")).exists(), sorted(p.name for p in pki.iterdir())
        given = []
        for pid in children:
            cmdline = agents_cmdline(pid)
            if cmdline is not None:
                assert_agents_reach_no_etcd(cmdline, endpoint, [])
                given.append(set(cmdline[cmdline.index("--coordinators") + 1].split(",")))
        # Each AZ's agents are given its own 2 coordinators: all 4, none twice.
        assert len(given) == 2 and given[0].isdisjoint(given[1]) and given[0] | given[1] == set(up.addresses), given
        # The coordinators' user is confined to its cluster's prefix.
        coordinator = etcd_pki.files(pki / etcd_pki.user_for(cluster, "coordinator"))
        denied = etcdctl_fails("--endpoints", f"https://{endpoint}", "--cacert", str(coordinator.ca), "--cert",
                               str(coordinator.cert), "--key", str(coordinator.key), "get", "/phalanx/other/x")
        assert "permission denied" in denied, denied
    finally:
        code = up.stop(signal.SIGINT)
    assert code == 0, "\n".join(up.lines[-40:])
    assert live_in_sessions(set(children.values())) == []
    assert processes_mentioning(cluster) == [] and processes_mentioning(str(up.state_dir)) == []
    assert not up.state_dir.exists(), "a state dir that up created must be removed (its keys and CA with it)"
    assert any("stopped" in line for line in up.lines)


def test_up_with_workload_on_given_etcd_keeps_given_state_dir(
    etcd_server: EtcdServer, etcd_pki: EtcdPki, cluster_name: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    up = UpProcess([
        "--etcd", f"https://{etcd_server.endpoint}", "--etcd-pki", str(etcd_pki.dir), "--cluster", cluster_name,
        "--azs", "1", "--coordinators-per-az", "1", "--nodes-per-az", "2", "--base-port", "0",
        "--state-dir", str(state),
    ])
    try:
        up.start()
        assert up.proc is not None
        children = child_sessions(up.proc.pid)
        assert len(children) == 2, children  # no etcd of its own this time
        # The workload runs: gangs get admitted and finish (waited for, not timed).
        up.wait_for_line(r"admitted [1-9]", timeout=240)
        up.wait_for_line(r"succeeded [1-9]", timeout=240)
    finally:
        code = up.stop(signal.SIGTERM)
    assert code == 0, "\n".join(up.lines[-40:])
    assert live_in_sessions(set(children.values())) == []
    assert processes_mentioning(cluster_name) == []
    assert state.is_dir() and (state / "logs" / "az-a-c0.log").is_file(), "a given state dir is kept"
    # The workload went over TLS as up's admin: the gangs record that owner.
    owners = etcdctl(etcd_server.endpoint, "get", "--prefix", f"/phalanx/{cluster_name}/gangs/", "--print-value-only")
    assert f"admin/{ADMIN_NAME}" in owners, owners[:500]


def test_up_reports_a_failed_start_and_cleans_up(etcd_pki: EtcdPki, tmp_path: Path) -> None:
    """An etcd nobody serves: its users cannot be provisioned, no leader can
    be elected; with a short start timeout ``up`` gives up, exits 1, and
    still stops what it started."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    cluster = "t" + uuid.uuid4().hex[:10]
    up = UpProcess([
        "--no-workload", "--etcd", dead, "--etcd-pki", str(etcd_pki.dir), "--cluster", cluster, "--azs", "1",
        "--coordinators-per-az", "1", "--nodes-per-az", "1", "--base-port", "0", "--start-timeout", "20",
        "--state-dir", str(tmp_path / "state"),
    ])
    with pytest.raises(RuntimeError) as info:
        up.start(timeout=240)  # waits for PHALANX_ADDRESS, which never comes
    assert "exited with code 1" in str(info.value)
    assert up.stop() == 1
    assert any("error:" in line and dead in line for line in up.lines), "\n".join(up.lines)
    assert processes_mentioning(cluster) == []


# --- pure decisions, by table -------------------------------------------------------------

from phalanx.up.config import choose_cluster_name  # noqa: E402
from phalanx.up.ports import replaced_ports  # noqa: E402
from phalanx.up.startup import LeaderSeen, leaders_of_this_run  # noqa: E402
from phalanx.up.state_dir import stale_verdict  # noqa: E402
from phalanx.up.workload import LAUNCH_MEMBER_BUDGET  # noqa: E402

CLUSTER_NAMES = [
    ("given wins", "mine", "local-aaaaaa", "abc123", "mine"),
    ("remembered by a kept state dir", "", "local-aaaaaa", "abc123", "local-aaaaaa"),
    ("a garbled remembered name is ignored", "", "Not A Label\n", "abc123", "local-abc123"),
    ("fresh", "", "", "abc123", "local-abc123"),
]


@pytest.mark.parametrize("given, remembered, token, want", [c[1:] for c in CLUSTER_NAMES], ids=[c[0] for c in CLUSTER_NAMES])
def test_choose_cluster_name(given: str, remembered: str, token: str, want: str) -> None:
    assert choose_cluster_name(given, remembered, token) == want


REPLACED = [
    ("all asked for, all got", 7070, [7070, 7071], []),
    ("one taken", 7070, [7070, 40001], [(7071, 40001)]),
    ("all taken", 7070, [40000, 40001], [(7070, 40000), (7071, 40001)]),
    ("base 0 asks for nothing", 0, [40000, 40001], []),
]


@pytest.mark.parametrize("base, ports, want", [c[1:] for c in REPLACED], ids=[c[0] for c in REPLACED])
def test_replaced_ports(base: int, ports: list[int], want: list[tuple[int, int]]) -> None:
    assert replaced_ports(base, ports) == want


OURS = {"127.0.0.1:7070", "127.0.0.1:7071"}
LEADERS = [
    ("elected in this run", [LeaderSeen("az-a", "az-a-c0", "127.0.0.1:7070", 120)], {"az-a"}, set()),
    # The same id and address as this run's (fixed ports, kept state dir), but
    # created before this run started: not ours.
    ("an earlier run's key, same address", [LeaderSeen("az-a", "az-a-c0", "127.0.0.1:7070", 90)], set(), {"az-a"}),
    ("epoch equal to the baseline", [LeaderSeen("az-a", "az-a-c0", "127.0.0.1:7070", 100)], set(), {"az-a"}),
    ("new key, not one of our coordinators", [LeaderSeen("az-a", "x", "127.0.0.1:9999", 130)], set(), {"az-a"}),
    ("an AZ we did not start is ignored", [LeaderSeen("az-z", "z", "127.0.0.1:7070", 130)], set(), set()),
    (
        "two AZs, one stale",
        [LeaderSeen("az-a", "az-a-c0", "127.0.0.1:7070", 101), LeaderSeen("az-b", "az-b-c0", "127.0.0.1:7071", 7)],
        {"az-a"}, {"az-b"},
    ),
]


@pytest.mark.parametrize("seen, ours, stale", [c[1:] for c in LEADERS], ids=[c[0] for c in LEADERS])
def test_leaders_of_this_run(seen: list[LeaderSeen], ours: set[str], stale: set[str]) -> None:
    got_ours, got_stale = leaders_of_this_run(seen, ("az-a", "az-b"), 100, OURS)
    assert got_ours == ours and set(got_stale) == stale


STALE = [
    ("no owner file: never ours to remove", None, False, [], False),
    ("owner alive", {"pid": 5}, True, [], False),
    ("owner dead, a process still uses it", {"pid": 5}, False, [77], False),
    ("owner dead, unused", {"pid": 5}, False, [], True),
]


@pytest.mark.parametrize("owner, alive, users, remove", [c[1:] for c in STALE], ids=[c[0] for c in STALE])
def test_stale_verdict(owner: dict | None, alive: bool, users: list[int], remove: bool) -> None:
    assert (stale_verdict(owner, alive, users) is not None) == remove


# --- ports, names, readiness, deaths ------------------------------------------------------------


async def status_of(up: UpProcess):  # type: ignore[no-untyped-def]
    async with AsyncClient(up.address, **up.client_kwargs()) as client:
        return await client.status()


def test_up_says_which_ports_it_took_names_its_cluster_and_reports_a_dead_etcd(tmp_path: Path) -> None:
    """Asked for a port another program holds: one warning naming the asked
    and the taken port. No --cluster: a name of its own (local-<random>),
    printed with PHALANX_ADDRESS and served by ClusterStatus. Its etcd killed
    under it: one line that says so."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        busy = holder.getsockname()[1]
        up = UpProcess(
            ["--no-workload", "--azs", "1", "--coordinators-per-az", "1", "--nodes-per-az", "1", "--base-port", str(busy)],
            env=dict(os.environ, TMPDIR=str(tmp_path)),
        )
        try:
            up.start()
            warning = up.find_line(rf"warning: asked for ports {busy}-{busy}; {busy} taken, using {busy}->(\d+) instead")
            assert warning is not None, "\n".join(up.lines)
            assert up.addresses == [f"127.0.0.1:{warning.group(1)}"]
            name = up.find_line(r"^PHALANX_CLUSTER=(\S+)$")
            assert name is not None and re.fullmatch(r"local-[0-9a-f]{6}", name.group(1))
            assert asyncio.run(status_of(up)).cluster == name.group(1)
            m = up.find_line(r"^phalanx up: etcd at \S+ \(TLS, client certificates; pid (\d+)\)")
            assert m is not None
            os.kill(int(m.group(1)), signal.SIGKILL)
            up.wait_for_line(rf"warning: etcd \(pid {m.group(1)}\) exited with code -9", timeout=30)
        finally:
            code = up.stop(signal.SIGINT)
    assert code == 0, "\n".join(up.lines[-30:])
    assert len([line for line in up.lines if "etcd (pid" in line]) == 1, "one line, once"


def plant_leader(endpoint: str, cluster: str, az: str, address: str, ttl: int) -> int:
    """A leader key as an earlier run leaves it (on a lease still running);
    returns its create revision (the epoch it carries)."""
    out = etcdctl(endpoint, "lease", "grant", str(ttl))
    lease = re.search(r"lease ([0-9a-f]+) granted", out)
    assert lease, out
    value = json.dumps({"id": f"{az}-c0", "address": address})
    etcdctl(endpoint, "put", f"/phalanx/{cluster}/leader/{az}", value, f"--lease={lease.group(1)}")
    got = json.loads(etcdctl(endpoint, "get", f"/phalanx/{cluster}/leader/{az}", "-w", "json"))
    return int(got["kvs"][0]["create_revision"])


def test_up_is_ready_only_with_leaders_of_this_run(
    etcd_server: EtcdServer, etcd_pki: EtcdPki, cluster_name: str, tmp_path: Path
) -> None:
    """An earlier run's leader key still on its lease (a kept --state-dir
    restarted at once, a shared --etcd): up must not take it for a leader
    and print PHALANX_ADDRESS before its own coordinator is elected."""
    stale_epoch = plant_leader(etcd_server.endpoint, cluster_name, "az-a", "127.0.0.1:1", ttl=12)
    up = UpProcess([
        "--no-workload", "--etcd", etcd_server.endpoint, "--etcd-pki", str(etcd_pki.dir), "--cluster", cluster_name,
        "--azs", "1",
        "--coordinators-per-az", "1", "--nodes-per-az", "1", "--base-port", "0", "--state-dir", str(tmp_path / "s"),
    ])
    try:
        up.start()
        (az,) = [a for a in asyncio.run(status_of(up)).azs if a.az == "az-a"]
        assert az.has_leader and az.leader_address in up.addresses, (az, up.addresses)
        assert az.epoch > stale_epoch
        assert up.find_line(r"az-a: leader key of an earlier run \(az-a-c0 at 127\.0\.0\.1:1, epoch \d+\) still held")
    finally:
        code = up.stop(signal.SIGINT)
    assert code == 0, "\n".join(up.lines[-30:])
    # The kept state dir remembers the cluster name for the next run.
    assert (tmp_path / "s" / "cluster").read_text().strip() == cluster_name


def shims_below(pid: int) -> int:
    n = 0
    for p in procs.descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"shim.py" in f.read():
                    n += 1
        except OSError:
            pass
    return n


def test_up_launch_runs_a_sample_member_any_machine_has_within_its_member_budget(tmp_path: Path) -> None:
    """--launch with the examples (torchrun, python train.py, none of them on
    this machine): every member runs the shipped sample command and
    succeeds, and no more than LAUNCH_MEMBER_BUDGET members run at once."""
    up = UpProcess(
        ["--launch", "--azs", "2", "--coordinators-per-az", "1", "--nodes-per-az", "2", "--base-port", "0"],
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    most = 0
    try:
        up.start()
        assert up.proc is not None
        deadline = time.monotonic() + 240
        while not up.find_line(r"succeeded ([3-9]|\d\d)") and time.monotonic() < deadline:
            most = max(most, shims_below(up.proc.pid))
            assert up.proc.poll() is None, "\n".join(up.lines[-30:])
            time.sleep(0.3)
        progress = [line for line in up.lines if re.match(r"^\[\s*\d+s\] gangs:", line)]
        assert progress and re.search(r"succeeded ([3-9]|\d\d)", progress[-1]), "\n".join(up.lines[-30:])
        assert not any("failed" in line for line in progress), "\n".join(progress)
        logs = [p.read_text() for p in tmp_path.rglob("rank-*.log")]
        assert any(re.search(r"^rank=0 world=\d+ gang=\S+ node=\S+", t, re.M) for t in logs), logs[:3]
    finally:
        code = up.stop(signal.SIGINT)
    assert code == 0, "\n".join(up.lines[-30:])
    assert 0 < most <= LAUNCH_MEMBER_BUDGET, most


# --- security: --insecure, the flags, the client config ---------------------------------------------


def test_up_insecure_runs_plaintext_says_so_and_its_config_says_insecure(tmp_path: Path) -> None:
    """--insecure: one warning; a client without certificates gets in; the
    client config it prints says ``insecure: true`` and the CLI, given only
    that, reaches the cluster; the coordinators and agents ran with --insecure."""
    up = UpProcess(
        ["--insecure", "--no-workload", "--azs", "1", "--coordinators-per-az", "1", "--nodes-per-az", "1",
         "--base-port", "0"],
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    try:
        up.start()
        assert len([ln for ln in up.lines if "warning: --insecure" in ln]) == 1, "\n".join(up.lines)
        assert asyncio.run(plaintext_status(up.address)) == "answered"
        assert up.config is not None and up.admin_dir is None
        assert yaml.safe_load(up.config.read_text())["insecure"] is True
        done = subprocess.run([sys.executable, "-m", "phalanx", "status"], env=up.client_env(), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert not (up.state_dir / "pki").exists() and not (up.state_dir / "etcd-pki").exists()
        m = up.find_line(r"^phalanx up: etcd at \S+ \(plaintext, no auth; pid \d+\)")
        assert m is not None, "\n".join(up.lines)
        # Metrics in plaintext too, one line per process.
        metrics = metrics_lines(up, "http")
        assert sorted(metrics) == ["az-a-agents", "az-a-c0"], up.lines
        wait_agents_connected(metrics["az-a-agents"], None, yaml.safe_load(up.config.read_text())["cluster"], 1)
    finally:
        code = up.stop(signal.SIGINT)
    assert code == 0, "\n".join(up.lines[-30:])


from phalanx.up.children import security_args  # noqa: E402
from phalanx.up.config import security_flags_error  # noqa: E402
from phalanx.up.credentials import client_config  # noqa: E402

FLAGS = [
    ("own etcd, secure", False, "", False, None),
    ("own etcd, insecure", False, "", True, None),
    ("given etcd with its PKI", True, "/pki", False, None),
    ("given etcd, insecure", True, "", True, None),
    ("given etcd without PKI or --insecure", True, "", False, "--etcd: needs --etcd-pki"),
    ("PKI without --etcd", False, "/pki", False, "--etcd-pki: only with --etcd"),
    ("PKI and --insecure", True, "/pki", True, "--etcd-pki: not with --insecure"),
]


@pytest.mark.parametrize("etcd, pki, insecure, error", [c[1:] for c in FLAGS], ids=[c[0] for c in FLAGS])
def test_security_flags_error(etcd: bool, pki: str, insecure: bool, error: str | None) -> None:
    got = security_flags_error(etcd, pki, insecure)
    assert (got is None) if error is None else (got is not None and got.startswith(error)), got


def test_bad_security_flags_exit_2_naming_the_flag_and_write_nothing(tmp_path: Path) -> None:
    """Checked before anything starts: no state dir is made."""
    cases = [
        (["--etcd", "127.0.0.1:2379"], "--etcd: needs --etcd-pki"),
        (["--etcd-pki", str(tmp_path)], "--etcd-pki: only with --etcd"),
        (["--etcd", "127.0.0.1:2379", "--etcd-pki", str(tmp_path / "none")], "--etcd-pki: "),
    ]
    for args, want in cases:
        done = subprocess.run([sys.executable, "-m", "phalanx", "up", "--no-workload", *args],
                              env=dict(os.environ, TMPDIR=str(tmp_path)), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.startswith(f"error: {want}"), (args, done.stderr)
    assert not list(tmp_path.glob("phalanx-up-*")), "a refused start makes no state dir"


CONFIGS = [
    ("TLS", "c1", ["127.0.0.1:1"], "pki/c1/admin", {"cluster": "c1", "addresses": ["127.0.0.1:1"], "tls_dir": "pki/c1/admin"}),
    ("plaintext", "c1", ["a:1", "b:2"], None, {"cluster": "c1", "addresses": ["a:1", "b:2"], "insecure": True}),
]


@pytest.mark.parametrize("cluster, addresses, tls_dir, want", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_client_config_is_what_the_client_parses(cluster: str, addresses: list[str], tls_dir: str | None, want: dict) -> None:
    from phalanx.client import parse_client_config

    doc = client_config(cluster, addresses, tls_dir)
    assert doc == want
    parsed = parse_client_config(yaml.safe_dump(doc), Path("/state/config.yaml"))
    assert parsed.cluster == cluster and list(parsed.addresses or ()) == addresses
    assert parsed.insecure is (tls_dir is None)
    assert parsed.tls_dir == (None if tls_dir is None else Path("/state") / tls_dir)


def test_security_args() -> None:
    from phalanx.up.credentials import Credentials

    creds = Credentials(Path("/s/servers"), Path("/s/admin"), Path("/e/coord"), Path("/e/root"))
    assert security_args(None, "coordinator") == security_args(None, "agents") == ["--insecure"]
    assert security_args(creds, "coordinator") == ["--tls-dir", "/s/servers", "--etcd-tls-dir", "/e/coord"]
    assert security_args(creds, "agents") == ["--tls-dir", "/s/servers"]  # no etcd user for agents


@pytest.mark.parametrize("insecure", [False, True])
def test_agents_read_through_their_azs_coordinators(insecure: bool, tmp_path: Path) -> None:
    """Each agents process is given its own AZ's coordinators and no etcd
    (also with --insecure: one path), whichever port a coordinator got."""
    from phalanx.cli import build_parser
    from phalanx.up.children import build_children, set_agent_coordinators
    from phalanx.up.config import UpConfig
    from phalanx.up.credentials import Credentials

    a = build_parser().parse_args(["up", "--azs", "2", "--coordinators-per-az", "2", *(["--insecure"] * insecure)])
    creds = None if insecure else Credentials(Path("/s/servers"), Path("/s/admin"), Path("/e/coord"), Path("/e/root"))
    children = build_children(UpConfig.from_args(a), "127.0.0.1:2379", [7001, 7002, 7003, 7004], tmp_path,
                              tmp_path, "c1", creds)
    for i, c in enumerate(children):
        if c.kind == "coordinator":
            c.address = f"127.0.0.1:{9000 + i}"  # as served: not the port asked for (a retried coordinator)
    set_agent_coordinators(children)
    agents = {c.az: c.argv for c in children if c.kind == "agents"}
    assert sorted(agents) == ["az-a", "az-b"]
    for az, argv in agents.items():
        want = [c.address for c in children if c.kind == "coordinator" and c.az == az]
        assert argv[argv.index("--coordinators") + 1] == ",".join(want)
        assert_agents_reach_no_etcd(argv, "127.0.0.1:2379", [c.address for c in children if c.az != az])
        assert ("--insecure" in argv) is insecure and ("--tls-dir" in argv) is not insecure


def test_make_credentials_issues_what_each_process_loads_and_keeps_the_ca(tmp_path: Path) -> None:
    """Every file a coordinator, an agent and the admin client load passes
    the same checks they make at start-up; a second run on the same state
    dir keeps the CA (a kept --state-dir) and issues the leaves afresh."""
    import datetime

    from cryptography import x509

    from phalanx import tls
    from phalanx.tls import TlsFiles, coordinator_server_name
    from phalanx.up.credentials import make_credentials

    now = datetime.datetime.now(datetime.timezone.utc)
    etcd_dir = tmp_path / "etcd-pki"
    etcd_pki.init(etcd_dir, now=now)
    first = make_credentials(tmp_path, "c1", {"az-a-c0": "az-a"}, {"az-a-n0": "az-a"}, etcd_dir, now=now)
    coordinator = tls.load(TlsFiles.issued(first.server_dir, "coordinator", "az-a-c0"), cluster="c1", use="server", now=now)
    assert coordinator_server_name("c1") in coordinator.cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    agent = tls.load(TlsFiles.issued(first.server_dir, "agent", "az-a-n0"), cluster="c1", use="client", now=now)
    assert agent.identity.node == "az-a-n0"
    # Each certificate is bound to the AZ its process serves in.
    assert (agent.identity.az, coordinator.identity.az) == ("az-a", "az-a")
    admin = tls.load(TlsFiles(first.admin_dir / "ca.crt", first.admin_dir / "client.crt", first.admin_dir / "client.key"),
                     cluster="c1", use="client", now=now)
    assert admin.identity.role == "admin"
    assert etcd_pki.check_client(etcd_pki.files(first.etcd_coordinator), now=now)[3] == etcd_pki.user_for(
        "c1", "coordinator")
    assert not (etcd_dir / etcd_pki.user_for("c1", "agent")).exists(), "agents get no etcd user"
    ca = (first.server_dir / "ca.crt").read_bytes()
    second = make_credentials(tmp_path, "c1", {"az-a-c0": "az-a"}, {"az-a-n0": "az-a"}, etcd_dir, now=now)
    assert (second.server_dir / "ca.crt").read_bytes() == ca, "a kept state dir keeps its CA"
    renewed = tls.load(TlsFiles.issued(second.server_dir, "coordinator", "az-a-c0"), cluster="c1", use="server", now=now)
    assert renewed.cert.serial_number != coordinator.cert.serial_number
