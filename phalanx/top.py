"""``phalanx top``: the cluster at a glance, refreshed in place.

Per AZ: the leader and its epoch, nodes ready, GPUs used / free on ready
nodes / total; the gangs by state; the pending gangs, oldest first, with how
long each has waited against its admission timeout and the reason its owner
leader gave. docs/monitoring.md describes the view.

The view is built by a pure function (``build_view``: the answers of
ClusterStatus, ListNodes, ListGangs and ExplainGang for the gangs shown, and
``now``, in; a ``TopView`` out)
and drawn by two more (``render_text``: plain text; ``render_rich``: rich
tables); ``run_top`` is the thin driver that asks the coordinators and
prints, with ``rich.live.Live`` on a terminal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from phalanx.model import GangState
from phalanx.v1 import gang_pb2 as gpb
from phalanx.v1 import types_pb2 as pb

# How many pending gangs the view lists by default (the oldest; the rest
# are counted): a terminal has only so many lines.
DEFAULT_PENDING_ROWS = 10


@dataclass(frozen=True)
class AzRow:
    az: str
    leader: str  # "" when the AZ has no leader
    address: str
    epoch: int  # 0 when the AZ has no leader
    nodes_ready: int
    nodes_total: int
    gpus_used: int
    gpus_free_ready: int  # free GPUs on ready nodes: what can be placed on now
    gpus_total: int

    @property
    def has_leader(self) -> bool:
        return bool(self.leader)


@dataclass(frozen=True)
class PendingRow:
    id: str
    name: str
    queue: str
    owner_az: str
    gpus: int
    waited_s: float
    timeout_s: float  # the gang's admission_timeout_s
    reason: str

    @property
    def overdue(self) -> bool:
        """Waited past its admission timeout: the next admission cycle fails
        it (an overdue gang that stays listed means no leader is deciding)."""
        return self.waited_s > self.timeout_s


@dataclass(frozen=True)
class TopView:
    cluster: str
    served_by: str
    address: str
    at: float  # unix seconds of the answers
    azs: tuple[AzRow, ...]
    gangs_by_state: tuple[tuple[str, int], ...]  # lifecycle order, zero counts left out
    pending: tuple[PendingRow, ...]  # the oldest ``rows`` pending gangs
    pending_total: int
    error: str = ""  # the last refresh failed: the view is the one before it

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _state_order(name: str) -> tuple[int, str]:
    try:
        return (int(GangState[name.removeprefix("GANG_STATE_")]), name)
    except KeyError:  # "UNREADABLE" or a state newer than this client
        return (len(GangState) + 1, name)


def pending_order(pending: Sequence[pb.Gang]) -> list[pb.Gang]:
    """The PENDING gangs of ``pending``, oldest first (the order the view
    lists them in and the order admission considers a queue's waiters)."""
    return sorted((g for g in pending if g.state == pb.GANG_STATE_PENDING), key=lambda g: (g.submitted_at, g.id))


def explained_reason(answer: gpb.ExplainGangResponse) -> str:
    """Why a pending gang waits, from ExplainGang: the owner leader's own
    reason (queue position and the rule that holds it), else the summary.
    A pending gang's record carries no reason: the leader keeps the last
    cycle's in memory and serves it through ExplainGang only."""
    return answer.leader_reason or answer.summary


def build_view(status: gpb.ClusterStatusResponse, nodes: Sequence[pb.NodeStatus], pending: Sequence[pb.Gang], *,
               now: float, address: str = "", rows: int = DEFAULT_PENDING_ROWS,
               reasons: Mapping[str, str] | None = None) -> TopView:
    """The view of one refresh. ``nodes``: ListNodes (all AZs); ``pending``:
    ListGangs of PENDING gangs (other states in it are ignored);
    ``reasons``: gang id -> ``explained_reason`` for the gangs shown (a gang
    without one shows its record's reason)."""
    reasons = reasons or {}
    free_ready: dict[str, int] = {}
    for n in nodes:
        if n.ready:
            az = n.topology.az
            free_ready[az] = free_ready.get(az, 0) + max(0, n.gpus_total - n.gpus_used)
    azs = tuple(
        AzRow(
            az=a.az,
            leader=a.leader_id if a.has_leader else "",
            address=a.leader_address if a.has_leader else "",
            epoch=a.epoch if a.has_leader else 0,
            nodes_ready=a.nodes_ready,
            nodes_total=a.nodes_total,
            gpus_used=a.gpus_total - a.gpus_free,
            gpus_free_ready=free_ready.get(a.az, 0),
            gpus_total=a.gpus_total,
        )
        for a in sorted(status.azs, key=lambda a: a.az)
    )
    counts = sorted(((k, v) for k, v in status.gangs_by_state.items() if v), key=lambda kv: _state_order(kv[0]))
    waiting = pending_order(pending)
    shown = tuple(
        PendingRow(
            id=g.id,
            name=g.spec.name,
            queue=g.spec.queue,
            owner_az=g.owner_az,
            gpus=g.spec.members * g.spec.resources.gpus,
            waited_s=max(0.0, now - g.submitted_at),
            timeout_s=g.spec.policy.admission_timeout_s,
            reason=" ".join((reasons.get(g.id) or g.reason).split()),
        )
        for g in waiting[:max(0, rows)]
    )
    return TopView(cluster=status.cluster, served_by=status.served_by, address=address, at=now, azs=azs,
                   gangs_by_state=tuple((k.removeprefix("GANG_STATE_"), v) for k, v in counts),
                   pending=shown, pending_total=len(waiting))


def with_error(view: TopView, error: str) -> TopView:
    """The last good view, marked with why the newest refresh failed."""
    return dataclasses.replace(view, error=" ".join(error.split()))


# --- drawing ------------------------------------------------------------------------


def _clock(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _header(view: TopView) -> str:
    where = f" at {view.address}" if view.address else ""
    return f"cluster {view.cluster or '-'} (answered by {view.served_by or 'a coordinator'}{where}) {_clock(view.at)}"


AZ_HEADERS = ("AZ", "LEADER", "EPOCH", "NODES READY/TOTAL", "GPUS USED", "GPUS FREE (READY)", "GPUS TOTAL")
PENDING_HEADERS = ("ID", "NAME", "QUEUE", "AZ", "GPUS", "WAITED", "TIMEOUT", "REASON")


def _az_cells(a: AzRow) -> list[str]:
    return [a.az, a.leader or "(none)", str(a.epoch) if a.has_leader else "-", f"{a.nodes_ready}/{a.nodes_total}",
            str(a.gpus_used), str(a.gpus_free_ready), str(a.gpus_total)]


def _pending_cells(p: PendingRow) -> list[str]:
    from phalanx.text_tables import format_age

    timeout = format_age(p.timeout_s) + (" (overdue)" if p.overdue else "")
    return [p.id, p.name, p.queue or "-", p.owner_az or "-", str(p.gpus), format_age(p.waited_s), timeout, p.reason or "-"]


def _states_line(view: TopView) -> str:
    return "gangs: " + (", ".join(f"{k} {v}" for k, v in view.gangs_by_state) or "none")


def _pending_title(view: TopView) -> str:
    if not view.pending_total:
        return "pending: none"
    more = f", {len(view.pending)} oldest shown" if len(view.pending) < view.pending_total else ""
    return f"pending: {view.pending_total}{more}"


def render_text(view: TopView) -> str:
    """The plain view (stdout not a terminal): the same facts as the rich
    one, in the CLI's table format."""
    from phalanx.text_tables import format_table

    lines = [_header(view)]
    if view.error:
        lines.append(f"refresh failed: {view.error}")
    lines.append(format_table(AZ_HEADERS, [_az_cells(a) for a in view.azs]) if view.azs else "no AZs")
    lines.append(_states_line(view))
    lines.append(_pending_title(view))
    if view.pending:
        lines.append(format_table(PENDING_HEADERS, [_pending_cells(p) for p in view.pending]))
    return "\n".join(lines)


def render_rich(view: TopView) -> Any:
    """The terminal view: a rich renderable (an AZ without a leader and an
    overdue gang in red)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(_header(view), style="bold")]
    if view.error:
        parts.append(Text(f"refresh failed: {view.error}", style="bold red"))
    azs = Table(*AZ_HEADERS, title="AZs", title_justify="left", expand=False)
    for a in view.azs:
        azs.add_row(*_az_cells(a), style=None if a.has_leader else "red")
    parts.append(azs if view.azs else Text("no AZs"))
    parts.append(Text(_states_line(view)))
    if view.pending:
        table = Table(*PENDING_HEADERS, title=_pending_title(view), title_justify="left")
        for p in view.pending:
            table.add_row(*_pending_cells(p), style="red" if p.overdue else None)
        parts.append(table)
    else:
        parts.append(Text(_pending_title(view)))
    return Group(*parts)


# --- the driver ---------------------------------------------------------------------


async def fetch_view(client: Any, *, now: Callable[[], float], rows: int) -> TopView:
    """One refresh: ClusterStatus, ListNodes and the PENDING gangs (any
    coordinator answers each; the client fails over), then ExplainGang for
    the ``rows`` gangs shown (their reasons; at most ``rows`` calls)."""
    from phalanx.errors import PhalanxError

    status, nodes, pending = await asyncio.gather(client.status(), client.nodes(), client.list(states=[GangState.PENDING]))

    async def reason(gang_id: str) -> str:
        try:
            return explained_reason(await client.explain(gang_id))
        except PhalanxError as exc:  # gone or placed meanwhile: the row says so, the view stands
            return f"(explain: {' '.join(str(exc).split())})"

    shown = [g.id for g in pending_order(pending)[:max(0, rows)]]
    found = await asyncio.gather(*(reason(i) for i in shown))
    return build_view(status, nodes, pending, now=now(), address=client.last_address, rows=rows,
                      reasons=dict(zip(shown, found)))


async def run_top(client: Any, *, once: bool, watch: bool, interval: float, rows: int, output: str,
                  out: TextIO | None = None, now: Callable[[], float] | None = None,
                  sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> int:
    """``phalanx top``. On a terminal (text output, not ``--once``) the view
    is redrawn in place every ``interval``; otherwise it is printed once, or
    every ``interval`` with ``watch``. Only the first refresh's failure ends
    the command (as any other command's would); a later one is shown on the
    last good view until a refresh succeeds again."""
    import time

    out = out or sys.stdout
    clock = now or time.time
    view = await fetch_view(client, now=clock, rows=rows)
    live = out.isatty() and output == "text"
    if once or (not live and not watch):
        _emit(view, out, live, output, pretty=True)
        return 0
    if live:
        from rich.console import Console
        from rich.live import Live

        with Live(render_rich(view), console=Console(file=out), auto_refresh=False) as screen:
            while True:
                await sleep(interval)
                view = await _refresh(client, view, clock, rows)
                screen.update(render_rich(view), refresh=True)
    while True:  # --watch, not a terminal (or JSON): a new copy every interval
        _emit(view, out, live, output, pretty=False)
        await sleep(interval)
        view = await _refresh(client, view, clock, rows)


async def _refresh(client: Any, last: TopView, clock: Callable[[], float], rows: int) -> TopView:
    from phalanx.errors import PhalanxError

    try:
        return await fetch_view(client, now=clock, rows=rows)
    except PhalanxError as exc:
        return with_error(last, str(exc))


def _emit(view: TopView, out: TextIO, tty: bool, output: str, *, pretty: bool) -> None:
    if output == "json":
        # Once: indented; under --watch: one object a line.
        out.write(json.dumps(view.to_dict(), indent=2 if pretty else None) + "\n")
    elif tty:
        from rich.console import Console

        Console(file=out).print(render_rich(view))
    else:
        out.write(render_text(view) + ("\n" if pretty else "\n\n"))
    out.flush()
