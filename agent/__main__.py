"""`python -m agent` — one node agent (the process a DaemonSet runs per node).

Discovers the node's topology (NVML, sysfs, `nvidia-smi topo -m`, static
location and Kubernetes-style labels; docs/topology.md), registers with its
AZ's leader and launches members as real processes. For machines without the
hardware, ``--nvml-recording`` / ``--sysfs-recording`` replay recorded answers
of a real machine layout (tests/fixtures/topology/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import shutil
import sys
import tempfile
from typing import Any
from pathlib import Path

from agent.coordinator_reads import CoordinatorReads, add_where_flags, credentials_error
from agent.launcher import agent_identity
from agent.session import Agent
from phalanx.process_flags import add_credential_flags, add_log_flags
from phalanx.timings import timings_from_arg
from phalanx.ports import DEFAULT_PORTS, parse_port_range
from phalanx.store import Store
from phalanx import etcd_version, logfmt
from phalanx.tls import TlsError, TlsFiles, etcd_files, load, utc_now
from phalanx.usage import OneLineParser

log = logging.getLogger("agent")
PLAINTEXT_WARNING = ("--insecure: connecting to coordinators in plaintext (no --tls-dir): anyone on the path can pose "
                     "as this node's coordinator or as this node")
ETCD_PLAINTEXT_WARNING = "--insecure: reaching etcd in plaintext (no --etcd-tls-dir)"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m agent", description=__doc__)
    p.add_argument("--cluster", default="local")
    p.add_argument("--az", required=True)
    add_where_flags(p)
    p.add_argument("--node", default=os.uname().nodename)
    p.add_argument("--region", default="")
    p.add_argument("--spine", default="")
    p.add_argument("--leaf", default="")
    p.add_argument("--rack", default="")
    p.add_argument("--labels", default="", help="node labels as JSON object or k=v,k=v (Kubernetes topology labels are mapped)")
    p.add_argument("--labels-file", default="", help="JSON file of node labels")
    p.add_argument("--nvml-recording", default="", help="replay a recorded NVML (JSON) instead of the driver")
    p.add_argument("--sysfs-recording", default="", help="replay a recorded sysfs tree (JSON) instead of /sys")
    p.add_argument("--sysfs-root", default="/sys")
    p.add_argument("--nvidia-smi-topo", default="", help="a file with `nvidia-smi topo -m` output (fallback source)")
    p.add_argument("--simulate-members", action="store_true", help="members are timers, not processes")
    p.add_argument("--advertise-address", default=os.environ.get("PHALANX_ADVERTISE_ADDRESS", ""),
                   help="the address members on other nodes reach this node at (MASTER_ADDR when rank 0 runs "
                        "here; default: this host's address towards its leader)")
    p.add_argument("--rendezvous-ports", default=os.environ.get("PHALANX_RENDEZVOUS_PORTS", "%d-%d" % DEFAULT_PORTS),
                   help="FIRST-LAST: the ports this agent owns for MASTER_PORT of gangs whose rank 0 runs here "
                        "(default %(default)s, below Linux's ephemeral range)")
    p.add_argument("--state-dir", default=os.environ.get("PHALANX_STATE_DIR", ""))
    p.add_argument("--log-retention-s", type=float, default=7 * 24 * 3600.0,
                   help="delete member logs and exit records this long after their last write, "
                        "once none of that incarnation's members runs here (default 7 days)")
    p.add_argument("--run-as", default="", metavar="FILE",
                   help="YAML: gang owner -> local user members run as (default: every owner runs as nobody; "
                        "root only for owners in allow_root; docs/launcher.md)")
    p.add_argument("--timings", default=os.environ.get("PHALANX_TIMINGS", ""))
    p.add_argument("--history", default="")
    p.add_argument("--print-topology", action="store_true", help="discover, print the topology as JSON and exit")
    add_credential_flags(p, etcd_user="agent",
                         tls_help="connect to leaders over TLS: DIR holds ca.crt and agent-NODE.crt/.key "
                                  "(phalanx certs issue --role agent --name NODE --node NODE); the leader must present a "
                                  "coordinator certificate of this cluster")
    p.add_argument("--metrics-listen", default="", metavar="HOST:PORT",
                   help="serve /metrics here (127.0.0.1:0 picks a port; default off); with --tls-dir HTTPS, "
                        "scrapers need a client certificate of the cluster's CA (docs/metrics.md)")
    add_log_flags(p)
    return p


def required_flags_error(a: argparse.Namespace) -> str | None:
    """The one-line error for a missing credential flag without --insecure
    (--print-topology talks to nobody and needs none)."""
    return None if a.print_topology else credentials_error(a)


def etcd_tls_files(a: argparse.Namespace) -> TlsFiles | None:
    """The --etcd-tls-dir files (TlsError names a missing one)."""
    return etcd_files(a.etcd_tls_dir) if a.etcd_tls_dir else None


def tls_files(a: argparse.Namespace) -> TlsFiles | None:
    """The --tls-dir files, checked now (TlsError names the file and the
    check): an agent does not start with credentials no leader accepts."""
    if not a.tls_dir:
        return None
    files = TlsFiles.issued(a.tls_dir, "agent", a.node)
    load(files, cluster=a.cluster, use="client", now=utc_now())
    return files


def run_as_policy(a: argparse.Namespace):
    """The --run-as policy, checked now (ValueError "FILE: field: reason");
    without the flag, the default (every owner runs as nobody) for an agent
    that can switch users, None for one that cannot or runs no processes."""
    from agent.run_as import default_run_as, load_run_as

    if a.run_as:
        return load_run_as(a.run_as)
    if a.simulate_members or os.geteuid() != 0:
        return None
    return default_run_as()


def parse_labels(text: str, path: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    if path:
        labels.update(json.loads(Path(path).read_text()))
    if text.strip().startswith("{"):
        labels.update(json.loads(text))
    elif text:
        for part in text.split(","):
            k, _, v = part.partition("=")
            labels[k.strip()] = v.strip()
    return labels


def discover_topology(a: argparse.Namespace):
    from agent.topology import DiscoveryConfig, discover
    from agent.topology.recording import ReplayNvml, write_sysfs

    nvml = ReplayNvml(json.loads(Path(a.nvml_recording).read_text())) if a.nvml_recording else None
    smi = Path(a.nvidia_smi_topo).read_text() if a.nvidia_smi_topo else None
    # A replayed sysfs tree is only read during discovery (once, at start):
    # it lives in a temporary directory removed right after.
    with tempfile.TemporaryDirectory(prefix="phalanx-sysfs-") as tmp:
        sysfs_root = Path(a.sysfs_root)
        if a.sysfs_recording:
            sysfs_root = write_sysfs(json.loads(Path(a.sysfs_recording).read_text()), Path(tmp))
        config = DiscoveryConfig(
            node=a.node, az=a.az, region=a.region, spine=a.spine, leaf=a.leaf, rack=a.rack,
            labels=parse_labels(a.labels, a.labels_file), sysfs_root=sysfs_root, nvml=nvml, nvidia_smi_topo=smi,
        )
        return discover(config)


def rendezvous_args(a: argparse.Namespace) -> tuple[str, tuple[int, int]]:
    """The validated --advertise-address and --rendezvous-ports; ValueError
    naming the flag and why."""
    address = a.advertise_address.strip()
    if any(c.isspace() for c in address) or len(address) > 253:
        raise ValueError(f"--advertise-address: {a.advertise_address!r} is not a host address (an IP or a DNS name)")
    return address, parse_port_range(a.rendezvous_ports, "--rendezvous-ports")


async def amain(a: argparse.Namespace) -> int:
    timings = timings_from_arg(a.timings)
    address, ports = rendezvous_args(a)
    topo = discover_topology(a)
    if a.print_topology:
        print(json.dumps(topo.to_dict(), indent=1, sort_keys=True))
        return 0
    tls = tls_files(a)
    if tls is None:
        log.warning(PLAINTEXT_WARNING)
    if not a.etcd_tls_dir and not a.coordinators:
        log.warning(ETCD_PLAINTEXT_WARNING)
    # Without --state-dir the agent makes a throw-away one (nothing in it can
    # be adopted by a later agent, which would make its own): removed on exit.
    own_dir = not a.state_dir
    state_dir = Path(a.state_dir or tempfile.mkdtemp(prefix=f"phalanx-agent-{a.node}-"))
    try:
        return await _serve(a, timings, address, ports, topo, tls, state_dir)
    finally:
        if own_dir:
            shutil.rmtree(state_dir, ignore_errors=True)


async def _serve(a: argparse.Namespace, timings: Any, address: str, ports: Any, topo: Any, tls: Any,
                 state_dir: Path) -> int:
    agent_id = agent_identity(a.node, state_dir)
    # Member-side fencing (docs/agents.md): real members run under agent/shim.py,
    # which reads this lease; simulated members need none.
    from agent.shim import LEASE_FILE

    fence_lease = None if a.simulate_members else state_dir / LEASE_FILE
    if a.simulate_members:
        from agent.simulated import SimulatedLauncher as factory  # noqa: N813
    else:
        from agent.process import ProcessLauncher

        def factory(on_exit):  # type: ignore[no-redef]
            return ProcessLauncher(state_dir, agent_id, on_exit, fence_lease=fence_lease,
                                   fence_after_s=timings.fence_after_s, fence_grace_s=timings.stop_grace_s,
                                   log_retention_s=a.log_retention_s, run_as=a.run_as_policy)

    from agent.metrics import AgentMetrics
    from phalanx.metrics import new_registry, serve

    metrics = AgentMetrics(new_registry())
    try:
        # Before etcd: a taken port is a start-up error, not a half-started agent.
        server, metrics_address = serve(a.metrics_listen, metrics.registry, tls=tls, cluster=a.cluster)
    except OSError as exc:
        print(f"error: --metrics-listen: cannot serve on {a.metrics_listen}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        return await _run_agent(a, timings, address, ports, topo, tls, agent_id, factory, fence_lease, metrics,
                                metrics_address)
    finally:
        if server is not None:
            server.close()


async def _run_agent(a: argparse.Namespace, timings: Any, address: str, ports: Any, topo: Any, tls: Any,
                     agent_id: str, factory: Any, fence_lease: Any, metrics: Any, metrics_address: str) -> int:
    if a.coordinators:
        # No etcd at all: the coordinators read for it (and say etcd's version).
        store: Any = CoordinatorReads(a.coordinators.split(","), a.cluster, a.az, tls=tls, timeout=timings.etcd_timeout_s)
        version = asyncio.create_task(asyncio.sleep(0))
    else:
        store = await Store(a.etcd, a.cluster, tls=etcd_tls_files(a), timeout=timings.etcd_timeout_s).connect()
        # One line about etcd's version and its advisories, once etcd answers.
        version = asyncio.create_task(etcd_version.report(store, who=f"agent {a.node}",
                                                          retry_s=timings.heartbeat_interval_s))
    history = None
    if a.history:
        from agent.sim import HistoryFile

        history = HistoryFile(Path(a.history))
    agent = Agent(cluster=a.cluster, az=a.az, topology=topo, store=store, launcher_factory=factory, timings=timings,
                  agent_id=agent_id, fence_lease=fence_lease, advertise_address=address, rendezvous_ports=ports,
                  check_ports=not a.simulate_members, tls=tls, history=(lambda e, d: history.append((e, d))) if history is not None else None,
                  metrics=metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    run = asyncio.create_task(agent.run())
    shown = f" metrics={metrics_address}" if metrics_address else ""
    print(f"PHALANX_AGENT_READY node={a.node} az={a.az} gpus={len(topo.gpus)} nics={len(topo.nics)}{shown}", flush=True)
    if metrics_address:
        log.info("metrics at %s://%s/metrics", "https" if tls is not None else "http", metrics_address)
    await stop.wait()
    # SIGTERM: stop members too (a node drain). A crash or SIGKILL leaves them
    # running, and a restarted agent adopts them.
    await agent.stop(stop_members=True)
    run.cancel()
    version.cancel()
    await asyncio.gather(run, version, return_exceptions=True)
    await store.close()
    if history is not None:
        history.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    missing = required_flags_error(a)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    try:
        rendezvous_args(a)
        tls_files(a)
        if a.metrics_listen:
            from phalanx.metrics import parse_listen

            parse_listen(a.metrics_listen)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TlsError as exc:
        print(f"error: --tls-dir: {exc}", file=sys.stderr)
        return 2
    try:
        etcd_tls_files(a)
    except TlsError as exc:
        print(f"error: --etcd-tls-dir: {exc}", file=sys.stderr)
        return 2
    try:
        a.run_as_policy = run_as_policy(a)
    except ValueError as exc:
        print(f"error: --run-as: {exc}", file=sys.stderr)
        return 2
    logfmt.configure(a.log_level, a.log_format, "agent", static={"id": a.node, "az": a.az, "node": a.node},
                     name=f"agent-{a.node}")
    return asyncio.run(amain(a))


if __name__ == "__main__":
    sys.exit(main())
