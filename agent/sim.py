"""`python -m agent.sim` — many simulated node agents in one process.

Each agent has its own Session stream, epoch guard, device ledger and fence
timer, exactly like a real agent; only the topology (synthetic DGX-like
8-GPU nodes) and the members (timers, or real processes with ``--launch``)
differ. Prints ``PHALANX_AGENTS_READY az=AZ nodes=K`` once started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from agent.coordinator_reads import CoordinatorReads, add_where_flags, credentials_error
from agent.launcher import agent_identity, Launcher, MemberKey
from agent.metrics import AgentMetrics
from agent.session import Agent
from agent.simulated import SimulatedLauncher
from phalanx.process_flags import add_credential_flags, add_log_flags
from phalanx.timings import Timings, timings_from_arg
from phalanx.ports import DEFAULT_PORTS, parse_port_range, split_port_range
from phalanx.store import Store
from phalanx import etcd_version, logfmt
from phalanx.metrics import new_registry, parse_listen, serve
from phalanx.tls import TlsError, TlsFiles, etcd_files, load, utc_now
from phalanx.topology import NodeTopology
from phalanx.usage import OneLineParser

log = logging.getLogger("agent.sim")
PLAINTEXT_WARNING = ("--insecure: simulated agents connect to coordinators in plaintext (no --tls-dir): anyone on the "
                     "path can pose as their coordinator or as these nodes")
ETCD_PLAINTEXT_WARNING = "--insecure: simulated agents reach etcd in plaintext (no --etcd-tls-dir)"


def node_tls(tls_dir: Path | None, nodes: list[str], cluster: str) -> dict[str, TlsFiles]:
    """Each simulated node's agent-<node> files in ``tls_dir``, checked now
    (TlsError names the file and the check); {} for plaintext."""
    if tls_dir is None:
        return {}
    out = {}
    for node in nodes:
        files = TlsFiles.issued(tls_dir, "agent", node)
        load(files, cluster=cluster, use="client", now=utc_now())
        out[node] = files
    return out


class HistoryFile(list):
    """A history sink that appends JSON lines (flushed per event, so a
    killed agent process loses nothing it recorded)."""

    def __init__(self, path: Path):
        super().__init__()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)

    def append(self, item: tuple[str, dict]) -> None:  # type: ignore[override]
        event, detail = item
        self._f.write(json.dumps({"event": event, **detail}, default=str) + "\n")

    def close(self) -> None:
        self._f.close()


def fence_lease_path(launch: bool, state_dir: Path | None, agent_id: str) -> Path | None:
    """The agent's lease file for its members' fencing shims (agent/shim.py);
    None for simulated members."""
    if not launch or state_dir is None:
        return None
    from agent.shim import LEASE_FILE

    return state_dir / agent_id / LEASE_FILE


def launcher_factory(launch: bool, state_dir: Path | None, agent_id: str,
                     timings: Timings | None = None) -> Callable[[Callable[[MemberKey, int], Any]], Launcher]:
    if not launch:
        return SimulatedLauncher
    from agent.process import ProcessLauncher  # real processes (issue 4)

    assert state_dir is not None
    t = timings or Timings()
    lease = fence_lease_path(launch, state_dir, agent_id)
    return lambda on_exit: ProcessLauncher(state_dir / agent_id, agent_id, on_exit, fence_lease=lease,
                                           fence_after_s=t.fence_after_s, fence_grace_s=t.stop_grace_s)


LOOPBACK = "127.0.0.1"


class MetricsUnavailable(Exception):
    """The metrics address cannot be served (taken, or does not resolve)."""


def node_port_slices(ports: tuple[int, int], nodes: int, *, strict: bool) -> list[tuple[int, int]]:
    """One disjoint slice of ``ports`` per simulated node. With fewer ports
    than nodes, timer members (which bind nothing) may share slices; real
    members (``strict``) may not: ValueError."""
    if nodes == 0:
        return []
    size = ports[1] - ports[0] + 1
    if size >= nodes or strict:
        return split_port_range(ports[0], ports[1], nodes)
    one = split_port_range(ports[0], ports[1], size)
    return [one[i % size] for i in range(nodes)]


async def run_agents(
    *,
    cluster: str,
    az: str,
    etcd: str,
    topologies: list[NodeTopology],
    timings: Timings,
    launch: bool = False,
    state_dir: Path | None = None,
    ready_line: bool = True,
    stop_event: asyncio.Event | None = None,
    history: list | None = None,
    rendezvous_ports: tuple[int, int] = DEFAULT_PORTS,
    tls_dir: Path | None = None,
    etcd_tls: TlsFiles | None = None,
    metrics: AgentMetrics | None = None,
    metrics_listen: str = "",
    coordinators: Sequence[str] = (),
) -> None:
    """``tls_dir``: a directory with ca.crt and agent-<node>.crt/.key for
    every simulated node (each agent connects with its own node's
    certificate); ``etcd_tls``: the agents' etcd user files. None: plaintext.
    ``coordinators``: the AZ's coordinator addresses; given, the agents read
    through them (agent/coordinator_reads.py) and never reach ``etcd``.
    ``metrics``: the one set of metrics all these agents count in (None: a
    new one); ``metrics_listen``: serve it there (HTTPS with the first
    node's certificate under ``tls_dir``), shown as ``metrics=`` in the
    ready line."""
    # Every simulated node lives on this host: members reach each other on
    # loopback, and each node owns its own slice of the ports, so two gangs
    # whose rank 0 sit on different simulated nodes never share a port.
    slices = node_port_slices(rendezvous_ports, len(topologies), strict=launch)
    tls = node_tls(Path(tls_dir) if tls_dir is not None else None, [t.node for t in topologies], cluster)
    # One registry for the process: its agents add up (no node label).
    metrics = metrics if metrics is not None else AgentMetrics(new_registry())
    server_tls = tls.get(topologies[0].node) if tls and topologies else None
    try:
        server, metrics_address = serve(metrics_listen, metrics.registry, tls=server_tls, cluster=cluster)
    except OSError as exc:
        raise MetricsUnavailable(f"--metrics-listen: cannot serve on {metrics_listen}: {exc.strerror or exc}") from None
    try:
        await _run(cluster=cluster, az=az, etcd=etcd, topologies=topologies, timings=timings, launch=launch,
                   state_dir=state_dir, ready_line=ready_line, stop_event=stop_event, history=history, slices=slices,
                   tls=tls, etcd_tls=etcd_tls, metrics=metrics, metrics_address=metrics_address,
                   coordinators=coordinators)
    finally:
        if server is not None:
            server.close()


async def _run(*, cluster: str, az: str, etcd: str, topologies: list[NodeTopology], timings: Timings, launch: bool,
               state_dir: Path | None, ready_line: bool, stop_event: asyncio.Event | None, history: list | None,
               slices: list[tuple[int, int]], tls: dict[str, TlsFiles], etcd_tls: TlsFiles | None,
               metrics: AgentMetrics, metrics_address: str, coordinators: Sequence[str]) -> None:
    store = None if coordinators else await Store(etcd, cluster, tls=etcd_tls, timeout=timings.etcd_timeout_s).connect()
    # Reading through the coordinators, each node presents its own certificate.
    reads = {t.node: CoordinatorReads(coordinators, cluster, az, tls=tls.get(t.node), timeout=timings.etcd_timeout_s)
             for t in topologies} if coordinators else {}
    # Plaintext agents share one channel per leader; under TLS each agent
    # presents its own node's certificate, so each keeps its own channels.
    channels: dict | None = {} if not tls else None
    ids = {t.node: agent_identity(t.node, state_dir if launch else None) for t in topologies}
    agents = [
        Agent(
            cluster=cluster, az=az, topology=t, store=reads.get(t.node, store), timings=timings, agent_id=ids[t.node],
            launcher_factory=launcher_factory(launch, state_dir, ids[t.node], timings), channels=channels,
            tls=tls.get(t.node),
            fence_lease=fence_lease_path(launch, state_dir, ids[t.node]),
            history=(lambda ev, d: history.append((ev, d))) if history is not None else None,
            advertise_address=LOOPBACK, rendezvous_ports=slices[i], check_ports=launch, metrics=metrics,
        )
        for i, t in enumerate(topologies)
    ]
    tasks = [asyncio.create_task(a.run(), name=f"agent-{a.node}") for a in agents]
    # One line about etcd's version and its advisories, once etcd answers.
    # (Reading through the coordinators, the agents reach no etcd: they say it.)
    version = asyncio.create_task(etcd_version.report(store, who=f"agent.sim {az}", retry_s=timings.heartbeat_interval_s)
                                  if store is not None else asyncio.sleep(0))
    if ready_line:
        shown = f" metrics={metrics_address}" if metrics_address else ""
        print(f"PHALANX_AGENTS_READY az={az} nodes={len(agents)}{shown}", flush=True)
    if metrics_address:
        log.info("metrics at %s://%s/metrics", "https" if tls else "http", metrics_address)
    stop_event = stop_event or asyncio.Event()
    try:
        await stop_event.wait()
    finally:
        await asyncio.gather(*(a.stop() for a in agents), return_exceptions=True)
        for t in (*tasks, version):
            t.cancel()
        await asyncio.gather(*tasks, version, return_exceptions=True)
        for ch in (channels or {}).values():
            await ch.close()
        for r in reads.values():
            await r.close()
        if store is not None:
            await store.close()


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m agent.sim", description=__doc__)
    p.add_argument("--cluster", default="local")
    p.add_argument("--az", required=True)
    add_where_flags(p)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--spines", type=int, default=1)
    p.add_argument("--leaves-per-spine", type=int, default=2)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--launch", action="store_true", help="run members as real processes")
    p.add_argument("--state-dir", default=os.environ.get("PHALANX_STATE_DIR", ""))
    p.add_argument("--timings", default=os.environ.get("PHALANX_TIMINGS", ""))
    p.add_argument("--history", default="", help="append every agent effect as a JSON line to this file (chaos suite)")
    p.add_argument("--rendezvous-ports", default="%d-%d" % DEFAULT_PORTS,
                   help="FIRST-LAST: the ports of this process's nodes for MASTER_PORT, split into one disjoint slice "
                        "per node (processes sharing a host need disjoint ranges; default %(default)s)")
    add_credential_flags(p, etcd_user="agent",
                         tls_help="connect to leaders over TLS: DIR holds ca.crt and agent-NODE.crt/.key for every "
                                  "simulated node (phalanx certs issue --role agent --name NODE --node NODE)")
    add_log_flags(p, level="WARNING")
    p.add_argument("--metrics-listen", default="", metavar="HOST:PORT",
                   help="serve the metrics of all these agents here (127.0.0.1:0 picks a port; default off); with "
                        "--tls-dir HTTPS, scrapers need a client certificate of the cluster's CA (docs/metrics.md)")
    a = p.parse_args(argv)
    missing = credentials_error(a)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    # Many nodes in one process: each agent binds its node (agent/session.py).
    logfmt.configure(a.log_level, a.log_format, "agent-sim", static={"id": f"agents-{a.az}", "az": a.az},
                     name=f"agents-{a.az}")
    if a.launch and not a.state_dir:
        print("error: --launch needs --state-dir (member logs and state files)", file=sys.stderr)
        return 2
    timings = timings_from_arg(a.timings)
    from agent.topology.simulated import simulated_fabric

    topologies = simulated_fabric(a.az, a.nodes, a.spines, a.leaves_per_spine, gpus=a.gpus)
    try:
        node_tls(Path(a.tls_dir) if a.tls_dir else None, [t.node for t in topologies], a.cluster)
    except TlsError as exc:
        print(f"error: --tls-dir: {exc}", file=sys.stderr)
        return 2
    try:
        etcd_tls = etcd_files(a.etcd_tls_dir) if a.etcd_tls_dir else None
    except TlsError as exc:
        print(f"error: --etcd-tls-dir: {exc}", file=sys.stderr)
        return 2
    # Logged at WARNING, above this process's default level, so always seen.
    if not a.tls_dir:
        log.warning(PLAINTEXT_WARNING)
    if etcd_tls is None and not a.coordinators:
        log.warning(ETCD_PLAINTEXT_WARNING)
    try:
        ports = parse_port_range(a.rendezvous_ports, "--rendezvous-ports")
        if a.metrics_listen:
            parse_listen(a.metrics_listen)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        node_port_slices(ports, len(topologies), strict=a.launch)
    except ValueError as exc:
        print(f"error: --rendezvous-ports: {exc}", file=sys.stderr)
        return 2

    async def amain() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        sink = HistoryFile(Path(a.history)) if a.history else None
        try:
            await run_agents(
                cluster=a.cluster, az=a.az, etcd=a.etcd, topologies=topologies, timings=timings,
                launch=a.launch, state_dir=Path(a.state_dir) if a.state_dir else None, stop_event=stop,
                history=sink, rendezvous_ports=ports, tls_dir=Path(a.tls_dir) if a.tls_dir else None,
                etcd_tls=etcd_tls, metrics_listen=a.metrics_listen,
                coordinators=a.coordinators.split(",") if a.coordinators else (),
            )
        finally:
            if sink is not None:
                sink.close()

    try:
        asyncio.run(amain())
    except MetricsUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
