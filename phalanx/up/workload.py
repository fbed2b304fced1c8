"""The sample workload: the specs in ``examples/`` resized to the cluster
and kept in flight, with a progress line (docs/local-cluster.md, The sample
workload)."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from phalanx.client import AsyncClient, is_terminal, state_name
from phalanx.errors import AlreadyExists, PhalanxError, Unimplemented
from phalanx.model import GangState
from phalanx.spec import load_spec
from phalanx.up.children import Child
from phalanx.up.config import REPO_ROOT, UpConfig

EXAMPLES_DIR = REPO_ROOT / "examples"

# Gangs whose records still hold or wait for devices.
LIVE_STATES = frozenset(s for s in GangState if not s.terminal)

# Reaching any of these means the gang was admitted (all members placed).
ADMITTED_STATES = frozenset(
    {GangState.RESERVED, GangState.STARTING, GangState.RUNNING, GangState.RESTARTING, GangState.SUCCEEDED}
)

PROGRESS_EVERY_S = 2.0
POLL_EVERY_S = 1.0

# --launch runs every member as two real processes (its fencing shim and the
# member). On a small machine hundreds of them make every CLI call slow, so
# the sample workload keeps at most this many members live (pending ones
# included) and no gang bigger than half of it.
LAUNCH_MEMBER_BUDGET = max(4, 2 * (os.cpu_count() or 1))

# The sample member under --launch: programs every POSIX machine has (no
# train.py, no torchrun); it prints what Phalanx gave it, then sleeps.
SAMPLE_MEMBER_COMMAND = [
    "/bin/sh", "-c",
    'echo "rank=$RANK world=$WORLD_SIZE gang=$PHALANX_GANG node=$PHALANX_NODE '
    'master=$MASTER_ADDR:$MASTER_PORT"; sleep "$SAMPLE_SECONDS"; echo "rank=$RANK done"',
]


@dataclass(frozen=True)
class Template:
    """A spec from examples/, as plain data, and where it may be used."""

    label: str
    data: dict[str, Any]
    cross_az: bool = False
    real_command: bool = False


def load_templates(examples: Path = EXAMPLES_DIR) -> list[Template]:
    """Every valid examples/*.yaml; a spec that fails validation is skipped
    (the unit tests keep them valid)."""
    out = []
    for path in sorted(examples.glob("*.yaml")):
        try:
            spec = load_spec(path.read_text())
        except (OSError, ValueError):
            continue
        data = spec.to_dict()
        out.append(
            Template(
                label=spec.name,
                data=data,
                cross_az=spec.topology.may_span_azs,
                real_command=path.stem == "real-command",
            )
        )
    if not out:
        # Installed without the examples directory: one small built-in gang.
        out.append(Template("tiny", {"name": "tiny", "members": 8, "resources": {"gpus": 1}}))
    return out


def fit_template(
    t: Template, nodes: int, gpus_per_node: int, azs: int, seq: int, *, launch: bool = False
) -> dict[str, Any]:
    """Shrink a template so it fits in about half an AZ (the whole cluster for
    a cross-AZ gang), give it a unique name and a short run. With ``launch``
    (members are real processes) every template but ``real-command`` (written
    for it) runs ``SAMPLE_MEMBER_COMMAND``: the examples' own commands name
    programs and files (torchrun, train.py) a fresh machine lacks. No gang
    then has more than half of ``LAUNCH_MEMBER_BUDGET`` members."""
    data = yaml.safe_load(yaml.safe_dump(t.data))  # deep copy
    gpus = max(1, min(int(data["resources"]["gpus"]), gpus_per_node))
    per_node = max(1, gpus_per_node // gpus)
    capacity = nodes * per_node * (azs if t.cross_az else 1)
    data["resources"]["gpus"] = gpus
    members = max(1, min(int(data["members"]), capacity // 2 if capacity > 1 else 1))
    if launch:
        members = min(members, max(1, LAUNCH_MEMBER_BUDGET // 2))
    data["members"] = members
    data["resources"]["rdma_nics"] = min(int(data["resources"].get("rdma_nics", 0)), gpus)
    data["name"] = f"{t.label}-{seq}"[:53].rstrip("-")
    seconds = 5 + (seq % 4) * 5
    run = data.setdefault("run", {})
    run["duration_s"] = float(seconds)
    if launch and not t.real_command:
        run["command"] = list(SAMPLE_MEMBER_COMMAND)
        run.setdefault("env", {})["SAMPLE_SECONDS"] = str(seconds)
    # Fail fast rather than block the queue when the simulated topology cannot
    # satisfy a template's constraints.
    data.setdefault("policy", {})["admission_timeout_s"] = 120.0
    return data


def workload_line(labels: list[str], gangs_per_az: int, launch: bool, budget: int = LAUNCH_MEMBER_BUDGET) -> str:
    """What the sample workload keeps running. Under --launch the member
    budget, over the whole cluster, usually binds first: it is named, so
    that two running gangs do not read as a fault."""
    line = f"workload: {', '.join(labels)}; up to {gangs_per_az} live gang(s) per AZ"
    if launch:
        line += (f", and with --launch at most {budget} members live in the whole cluster (2 per core of this "
                 f"machine, at least 4; docs/local-cluster.md), so usually fewer gangs")
    return line


class WorkloadHost(Protocol):
    """What the workload needs of the run that serves it (``Up``,
    orchestrator.py): its flags, its coordinators, its clients' credentials
    and its output."""

    cfg: UpConfig
    children: list[Child]

    def client_options(self) -> dict[str, Any]: ...

    def say(self, text: str) -> None: ...

    def warn(self, text: str) -> None: ...

    def emit(self, text: str) -> None: ...


class Workload:
    """Keeps ``gangs_per_az`` live gangs per AZ, submitted to that AZ's
    coordinators (the receiving AZ owns a gang), and prints progress."""

    def __init__(self, up: WorkloadHost):
        self.up = up
        cfg = up.cfg
        self.templates = [
            t for t in load_templates()
            if (len(cfg.azs) > 1 or not t.cross_az)
            and (cfg.launch or not t.real_command)
        ]
        by_az: dict[str, list[str]] = {az: [] for az in cfg.azs}
        for c in up.children:
            if c.kind == "coordinator":
                by_az[c.az].append(c.address)
        # Each AZ's own coordinators first, the others as fallback.
        self.clients = {
            az: AsyncClient(
                addrs + [a for other, xs in by_az.items() if other != az for a in xs], timeout=5.0,
                **up.client_options(),
            )
            for az, addrs in by_az.items()
        }
        self.live: dict[str, tuple[str, GangState]] = {}  # gang id -> (az, state)
        self.live_members: dict[str, int] = {}  # gang id -> members (the --launch budget)
        self.finished: Counter[str] = Counter()
        self.admitted: set[str] = set()
        self.seq = itertools.count(1)
        self.rotation = {az: itertools.cycle(range(len(self.templates))) for az in cfg.azs}
        for i, az in enumerate(cfg.azs):  # AZs start at different templates
            for _ in range(i % max(1, len(self.templates))):
                next(self.rotation[az])
        self.capacity: dict[str, tuple[int, int]] = {}  # az -> (nodes, gpus per node)
        self.errors_shown = 0
        self.disabled: set[str] = set()

    def _next_template(self, az: str) -> Template | None:
        for _ in range(len(self.templates)):
            template = self.templates[next(self.rotation[az])]
            if template.label not in self.disabled:
                return template
        return None

    async def run(self) -> None:
        try:
            await self._learn_capacity()
            self.up.say(workload_line([t.label for t in self.templates], self.up.cfg.gangs_per_az, self.up.cfg.launch))
            started = last_print = last_poll = time.monotonic()
            last_admitted = 0
            while True:
                await self._top_up()
                now = time.monotonic()
                if now - last_poll >= POLL_EVERY_S:
                    await self._poll()
                    last_poll = now
                if now - last_print >= PROGRESS_EVERY_S:
                    rate = (len(self.admitted) - last_admitted) / (now - last_print)
                    last_admitted, last_print = len(self.admitted), now
                    self.up.emit(self.progress_line(now - started, rate))
                await asyncio.sleep(0.25)
        finally:
            for client in self.clients.values():
                await client.close()

    async def _learn_capacity(self) -> None:
        """Nodes and GPUs per node of every AZ, once its agents registered
        (bounded wait: the workload adapts to whatever has registered)."""
        cfg = self.up.cfg
        client = next(iter(self.clients.values()))
        deadline = time.monotonic() + 30.0
        while True:
            try:
                st = await client.status()
                self.capacity = {
                    az.az: (az.nodes_total, az.gpus_total // az.nodes_total if az.nodes_total else 8)
                    for az in st.azs
                }
            except PhalanxError:
                pass
            if all(self.capacity.get(az, (0, 0))[0] >= cfg.nodes_per_az for az in cfg.azs):
                return
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.5)

    async def _top_up(self) -> None:
        cfg = self.up.cfg
        per_az = Counter(az for az, _ in self.live.values())
        for az in cfg.azs:
            if per_az[az] >= cfg.gangs_per_az:
                continue
            template = self._next_template(az)
            if template is None:
                return  # every template was refused by this server version
            nodes, gpus_per_node = self.capacity.get(az, (cfg.nodes_per_az, 8))
            data = fit_template(
                template, max(nodes, 1), max(gpus_per_node, 1), len(cfg.azs), next(self.seq), launch=cfg.launch
            )
            if cfg.launch and sum(self.live_members.values()) + int(data["members"]) > LAUNCH_MEMBER_BUDGET:
                return  # the machine stays responsive: wait until live members finish
            try:
                result = await self.clients[az].submit(data)
            except AlreadyExists:
                continue  # a live gang of that name from an earlier run: next seq
            except Unimplemented as exc:
                # e.g. cross-AZ gangs on a coordinator that cannot place them
                # yet: say so once and leave the template out from now on.
                self.disabled.add(template.label)
                self.up.warn(f"workload: leaving out {template.label}: {exc}")
                continue
            except (PhalanxError, ValueError) as exc:
                self._show_error(f"submit {data['name']} to {az}: {exc}")
                continue
            self.live[result.gang.id] = (az, GangState(result.gang.state or GangState.PENDING))
            self.live_members[result.gang.id] = int(data["members"])
            per_az[az] += 1

    async def _poll(self) -> None:
        client = next(iter(self.clients.values()))
        try:
            gangs = await client.list(states=LIVE_STATES)
        except PhalanxError as exc:
            self._show_error(f"list: {exc}")
            return
        seen = {g.id: g for g in gangs}
        for gid, (az, _) in list(self.live.items()):
            gang = seen.get(gid)
            if gang is None:
                try:
                    gang = await client.get(gid)
                except PhalanxError:
                    del self.live[gid]  # gone (deleted): nothing to count
                    self.live_members.pop(gid, None)
                    continue
            state = GangState(gang.state) if gang.state else GangState.PENDING
            if state in ADMITTED_STATES:
                self.admitted.add(gid)
            if is_terminal(gang):
                del self.live[gid]
                self.live_members.pop(gid, None)
                self.finished[state_name(gang)] += 1
            else:
                self.live[gid] = (az, state)

    def progress_line(self, elapsed: float, rate: float) -> str:
        counts: Counter[str] = Counter(state.name for _, state in self.live.values())
        counts.update(self.finished)
        order = [s.name for s in GangState]
        shown = ", ".join(f"{name.lower()} {counts[name]}" for name in order if counts[name])
        return f"[{int(elapsed):>4}s] gangs: {shown or 'none yet'} | admitted {len(self.admitted)} ({rate:.1f}/s)"

    def _show_error(self, text: str) -> None:
        # The first few in full, then one line now and then: a flapping
        # cluster must not flood the terminal.
        self.errors_shown += 1
        if self.errors_shown <= 5 or self.errors_shown % 20 == 0:
            self.up.warn(f"workload: {text}")
