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
from typing import Any, Callable

from agent.launcher import agent_identity, Launcher, MemberKey
from agent.session import Agent
from agent.simulated import SimulatedLauncher
from coordinator.config import Timings, timings_from_arg
from coordinator.core.rendezvous import DEFAULT_PORTS, parse_port_range, split_port_range
from coordinator.store import Store
from phalanx.topology import NodeTopology
from phalanx.usage import OneLineParser


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
) -> None:
    # Every simulated node lives on this host: members reach each other on
    # loopback, and each node owns its own slice of the ports, so two gangs
    # whose rank 0 sit on different simulated nodes never share a port.
    slices = node_port_slices(rendezvous_ports, len(topologies), strict=launch)
    store = await Store(etcd, cluster, timeout=timings.etcd_timeout_s).connect()
    channels: dict = {}
    ids = {t.node: agent_identity(t.node, state_dir if launch else None) for t in topologies}
    agents = [
        Agent(
            cluster=cluster, az=az, topology=t, store=store, timings=timings, agent_id=ids[t.node],
            launcher_factory=launcher_factory(launch, state_dir, ids[t.node], timings), channels=channels,
            fence_lease=fence_lease_path(launch, state_dir, ids[t.node]),
            history=(lambda ev, d: history.append((ev, d))) if history is not None else None,
            advertise_address=LOOPBACK, rendezvous_ports=slices[i], check_ports=launch,
        )
        for i, t in enumerate(topologies)
    ]
    tasks = [asyncio.create_task(a.run(), name=f"agent-{a.node}") for a in agents]
    if ready_line:
        print(f"PHALANX_AGENTS_READY az={az} nodes={len(agents)}", flush=True)
    stop_event = stop_event or asyncio.Event()
    try:
        await stop_event.wait()
    finally:
        await asyncio.gather(*(a.stop() for a in agents), return_exceptions=True)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in channels.values():
            await ch.close()
        await store.close()


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m agent.sim", description=__doc__)
    p.add_argument("--cluster", default="local")
    p.add_argument("--az", required=True)
    p.add_argument("--etcd", required=True)
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
    p.add_argument("--log-level", default=os.environ.get("PHALANX_LOG_LEVEL", "WARNING"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format=f"%(asctime)s agents-{a.az} %(levelname)s %(name)s: %(message)s")
    if a.launch and not a.state_dir:
        print("error: --launch needs --state-dir (member logs and state files)", file=sys.stderr)
        return 2
    timings = timings_from_arg(a.timings)
    from agent.topology.simulated import simulated_fabric

    topologies = simulated_fabric(a.az, a.nodes, a.spines, a.leaves_per_spine, gpus=a.gpus)
    try:
        ports = parse_port_range(a.rendezvous_ports, "--rendezvous-ports")
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
                history=sink, rendezvous_ports=ports,
            )
        finally:
            if sink is not None:
                sink.close()

    asyncio.run(amain())
    return 0


if __name__ == "__main__":
    sys.exit(main())
