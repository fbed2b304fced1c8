"""What every part of one leadership shares (docs/design.md §19.6).

One ``Leadership`` per term as the AZ's leader: the store and its keys, the
epoch and the fence every write carries, the timings, the clocks, the tasks
of the term (cancelled when it ends), the wake-up of the admission cycle and
the failure that ends the term. ``AzLeader`` makes it when it takes office;
the gang writer, the two-phase driver and the collector are given it, so none
of them needs the leader to ask "are we still leader" or "run this as a task
of the term".

``RunTime`` is what the two-phase driver asks of the leader's run-time side
(evaluate or finish a gang, send to an agent, pick a rendezvous port, the
node views): callables, so the driver never holds the leader itself.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from coordinator.config import CoordinatorConfig
from coordinator.core import gang_effects
from coordinator.core.placement import NodeView
from coordinator.core.records import GangRecord, MemberAssignment, NodeRecord
from coordinator.election import LeaseLost, LeaseSession
from coordinator.metrics import CoordinatorMetrics
from phalanx.agent_messages import Assign, Revoke
from phalanx.errors import NotLeader
from phalanx.leader_record import LeaderInfo
from phalanx.logfmt import current
from phalanx.store import Fence, Store
from phalanx.topology import NodeTopology

log = logging.getLogger(__name__)


class Leadership:
    def __init__(self, store: Store, config: CoordinatorConfig, info: LeaderInfo, session: LeaseSession, *,
                 wall: Callable[[], float], mono: Callable[[], float], metrics: CoordinatorMetrics | None = None):
        self.store = store
        self.keys = store.keys
        self.config = config
        self.timings = config.timings
        self.az = config.az
        self.info = info
        self.epoch = info.epoch
        self.fence = Fence(self.az, info.epoch)
        self.session = session
        self.wall = wall
        self.mono = mono
        # The coordinator's metrics (coordinator/metrics.py); a leadership
        # made without them (unit tests) counts into a registry of its own.
        self.metrics = metrics if metrics is not None else CoordinatorMetrics(az=config.az)
        self.wake = asyncio.Event()  # the admission cycle runs now rather than at cycle_wait_s
        self.stopped = asyncio.Event()
        self.failure: BaseException | None = None  # what ended the term (the run loop raises it)
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Any, name: str) -> None:
        """Run ``coro`` as a task of this leadership: cancelled when it stops,
        and a NotLeader or LeaseLost it raises ends the leadership."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if t.cancelled():
                return
            exc = t.exception()
            if isinstance(exc, (NotLeader, LeaseLost)):
                self.failure = exc
                self.wake.set()
            elif exc is not None:
                log.error("task %s failed: %r", name, exc)

        task.add_done_callback(done)

    def stop(self) -> None:
        """The term is over: nothing acts for it any more."""
        self.stopped.set()
        for t in list(self._tasks):
            t.cancel()

    async def fenced_txn(self, compares: list, ops: list, failure: list = ()) -> Any:
        """A fenced write made on a caller's behalf (a submission, a gang
        write): a refused fence ends this leadership, as in a task of its
        own (design §5.2), rather than only failing that one request."""
        try:
            return await self.store.fenced_txn(self.fence, compares, ops, failure)
        except NotLeader as exc:
            self.failure = self.failure or exc
            self.wake.set()
            raise

    def check_valid(self) -> None:
        """Before acting on anyone's behalf: stop if our lease may be gone."""
        if self.stopped.is_set():
            raise NotLeader(f"no longer leader of {self.az}")
        self.session.check()


def current_stimulus() -> str:
    """The stimulus bound in the log context: each effect decided under it carries it."""
    return str(current().get("stimulus", "") or "")


@dataclass(frozen=True)
class RunTime:
    """What the two-phase driver asks of the leader's run-time side
    (``AzLeader.run_time``): ``evaluate`` and ``perform`` are the gang-effect
    interpreter's (coordinator/gang_performer.py), the rest the leader's
    method of the same name."""

    evaluate: Callable[[str], Awaitable[None]]  # decide on a gang from its members' reports
    perform: Callable[[gang_effects.Effect], Awaitable[gang_effects.Event]]  # the gang-effect interpreter (Finish, MarkStarting, ...)
    send: Callable[[str, Assign | Revoke], None]  # queue a message on a node's agent session
    rendezvous_for: Callable[[GangRecord, int, tuple[MemberAssignment, ...], NodeRecord | None], tuple[str, int]]
    rendezvous_settled: Callable[[str], None]
    placeable_nodes: Callable[[], list[NodeView]]
    registered_topologies: Callable[[], list[NodeTopology]]
    node_connected: Callable[[str], bool]  # whether the node's agent has a live session here
