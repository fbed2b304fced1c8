"""Model test of a gang's start against its cancel (hypothesis stateful,
docs/style.md §14; issue 26).

A small world: one AZ leader deciding with the real cores
(``lifecycle.teardown``, ``live_member_nodes``, ``after_teardown``,
``member_progress``, ``stray_member``; ``gang_effects.after_reserved``,
``assignments``, ``after_torn_down``, ``stray_member_effects``), two node
agents deciding with the real ``Arrivals``, and, standing in for etcd, the
gang record and its reservation. One gang of two members (on one node or
two). Every step of its start is an action the world takes in any order:
the reservation's write, the dispatch and STARTING that follow it, each
message's delivery (leader to agent, agent to leader, each stream in
order), each assignment's token read (it reads the reservation as it is
then), its turn to start, a launch that completes later (a launcher may
await: a revocation meanwhile finds the member STARTING), a member's exit
while its gang runs (a failure restarts the gang when its policy allows
one: teardown, requeue, the next incarnation's start), and the cancel, at
any point of all that. A member of an incarnation that is over runs until
it is stopped. At teardown the gang is cancelled if it has not ended,
everything in flight is delivered and every step taken until nothing is
left to do; then "terminal => members stopped and devices released": no
member of the gang is live at any agent and its reservation is gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from agent.core.enforcement import Arrivals
from coordinator.core import gang_effects as fx
from coordinator.core import lifecycle
from coordinator.core.progress import MemberReport
from coordinator.core.records import GangRecord, MemberAssignment
from phalanx.agent_messages import Assign, MemberStatus, Revoke
from phalanx.model import GangState, MemberPhase
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.spec import GangSpec, Policy, Resources
from phalanx.timings import Timings

AZ = "az-a"
EPOCH = 3
NODES = ("n0", "n1")


@dataclass
class Waiting:
    """An assignment at its agent: its token read (None: not yet) then its
    turn to start."""

    assign: Assign
    verdict: str | None = None  # "ok", "torn_down" (reported), "refused" (a stale word: said to no one)


@dataclass
class AgentModel:
    arrivals: Arrivals = field(default_factory=Arrivals)
    waiting: list[Waiting] = field(default_factory=list)
    members: dict[tuple[int, int], MemberPhase] = field(default_factory=dict)  # (incarnation, rank) -> phase
    launching: list[tuple[int, int]] = field(default_factory=list)  # STARTING, their launch not returned yet


class StartWorld(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 100.0
        self.down: dict[str, list] = {n: [] for n in NODES}  # leader -> agent, in order
        self.up: dict[str, list[MemberStatus]] = {n: [] for n in NODES}  # agent -> leader, in order
        self.agents = {n: AgentModel() for n in NODES}
        self.reports: dict[int, MemberReport] = {}
        self.tasks: list[str] = []  # the reserve task's steps still to come
        self.res: Reservation | None = None

    @initialize(split=st.booleans(), restarts=st.sampled_from((0, 1)))
    def submit(self, split: bool, restarts: int) -> None:
        spec = GangSpec(name="g", members=2, resources=Resources(gpus=1), policy=Policy(max_restarts=restarts))
        self.placement = (MemberAssignment(0, AZ, "n0", (0,), ()), MemberAssignment(1, AZ, "n1" if split else "n0", (1,), ()))
        self.g = GangRecord(id="g", spec=spec, state=GangState.PENDING, owner_az=AZ, submitted_at=self.now,
                            updated_at=self.now)

    # ------------------------------------------------------------ leader
    def reserve(self) -> None:
        """The reservation txn: RESERVED and COMMITTED in one write."""
        nodes: dict[str, NodeDevices] = {}
        for m in self.placement:
            cur = nodes.get(m.node, NodeDevices((), ()))
            nodes[m.node] = NodeDevices(tuple(sorted(cur.gpus + m.gpus)), ())
        self.res = Reservation(AZ, "g", self.g.incarnation, HoldState.COMMITTED, nodes, EPOCH)
        self.g = self.g.evolve(state=GangState.RESERVED, placement=self.placement, updated_at=self.now)
        self.tasks.append("after_reserved")

    def reserve_task(self) -> None:
        """The reserve task's next step: dispatch (what after_reserved says
        of the written record), then STARTING (a no-op once the record moved on)."""
        step = self.tasks.pop(0)
        if step == "after_reserved":
            for e in fx.after_reserved(fx.GangWritten(self.g.evolve(state=GangState.RESERVED)), "s"):
                if isinstance(e, fx.SendAssignments):
                    for node, msg in fx.assignments(e.gang, AZ, None):
                        self.down[node].append(msg)
                elif isinstance(e, fx.MarkStarting):
                    self.tasks.append("mark_starting")
        elif self.g.state == GangState.RESERVED:
            self.g = self.g.evolve(state=GangState.STARTING, updated_at=self.now)

    def cancel(self) -> None:
        verdict = lifecycle.cancel(self.g, AZ, "race", "test", self.now, EPOCH)
        assert isinstance(verdict, lifecycle.Cancel)
        self.finish(GangState.CANCELLED, verdict.reason)

    def finish(self, state: GangState, reason: str) -> None:
        """GangApi.finish: the teardown write, then its revocations."""
        g = self.g
        t = lifecycle.teardown(g, state, reason, (), self.res, lifecycle.live_member_nodes(g, self.reports),
                               self.now, EPOCH)
        self.g = t.record
        if t.releasing is not None:
            self.res = t.releasing
        elif t.delete_reservation:
            self.res = None
        for e in fx.after_torn_down(fx.TearDown(g, t, "s"), fx.GangWritten(t.record)):
            self.down[e.node].append(Revoke(e.gang, e.incarnation, e.reason))
        self.evaluate()

    def evaluate(self) -> None:
        """GangPerformer.evaluate: a torn-down incarnation released once no
        member can run; else a member-progress step."""
        if lifecycle.torn_down(self.g.state):
            then = lifecycle.after_teardown(self.g, self.reports, has_reservation=self.res is not None, two_phase=False)
            if then is lifecycle.AfterTeardown.RELEASE:
                self.res = None
            elif then is lifecycle.AfterTeardown.REQUEUE:
                # The next incarnation waits for placement; the reservation goes.
                self.g = lifecycle.requeue(self.g, self.now, Timings(), has_reservation=self.res is not None).record
                self.res, self.reports = None, {}
                event("requeued: the next incarnation starts")
            return
        step = lifecycle.member_progress(self.g, self.reports, self.now, EPOCH)
        if step is None:
            return
        if step.teardown:
            event(f"torn down by its members: {step.to.name}")
            self.finish(step.to, step.reason)
        else:
            event(f"members moved it to {step.to.name}")
            self.g = self.g.evolve(state=step.to, reason=step.reason)

    def leader_hears(self, data: st.DataObject) -> None:
        """AzLeader.on_member: a stray member is revoked again; a report of
        the gang's incarnation is kept and evaluated."""
        node = data.draw(st.sampled_from([n for n in NODES if self.up[n]]))
        m = self.up[node].pop(0)
        for e in fx.stray_member_effects(node, m, self.g, "s"):
            event("a stray member revoked again")
            self.down[e.node].append(Revoke(e.gang, e.incarnation, e.reason))
        if m.incarnation == self.g.incarnation:
            self.reports[m.rank] = MemberReport(m.phase, m.exit_code, m.reason, node)
            self.evaluate()

    # ------------------------------------------------------------ agents
    def report(self, node: str, key: tuple[int, int], phase: MemberPhase, reason: str = "") -> None:
        self.agents[node].members[key] = phase
        self.up[node].append(MemberStatus(gang="g", incarnation=key[0], rank=key[1], phase=phase, reason=reason,
                                          node=node))

    def agent_reads(self, data: st.DataObject) -> None:
        """The session loop reads the next message: an assignment is noted
        and waits; a revocation marks what waits and stops what is live."""
        node = data.draw(st.sampled_from([n for n in NODES if self.down[n]]))
        msg = self.down[node].pop(0)
        a = self.agents[node]
        if isinstance(msg, Assign):
            a.arrivals.arrive(msg.gang, msg.incarnation, msg.rank)
            a.waiting.append(Waiting(msg))
            return
        a.arrivals.revoke(msg.gang, msg.incarnation)
        for key, phase in list(a.members.items()):
            if key[0] == msg.incarnation and phase.live and key not in a.launching:
                self.report(node, key, MemberPhase.STOPPED, f"revoked: {msg.reason}")
            # A member whose launch has not returned has no process to
            # signal yet (the launcher does not know it): nothing happens.

    def token_read(self, data: st.DataObject) -> None:
        """An assignment's token read: the reservation as etcd has it now."""
        w = data.draw(st.sampled_from([w for a in self.agents.values() for w in a.waiting if w.verdict is None]))
        r, inc = self.res, w.assign.incarnation
        w.verdict = ("ok" if r is not None and r.holds("g", inc)
                     else "torn_down" if r is not None and r.releasing(inc) else "refused")

    def start_turn(self, data: st.DataObject) -> None:
        """Its turn at the agent's lock (Agent._assign)."""
        node, w = data.draw(st.sampled_from([(n, w) for n, a in self.agents.items() for w in a.waiting
                                             if w.verdict is not None]))
        a, m = self.agents[node], w.assign
        key = (m.incarnation, m.rank)
        a.waiting.remove(w)
        try:
            if key in a.members:
                return  # a duplicate: reported as it is (not modelled: nothing changes)
            if a.arrivals.revoked(m.gang, m.incarnation, m.rank):
                event("an assignment revoked while it waited")
                self.report(node, key, MemberPhase.REJECTED, "revoked before it started")
            elif w.verdict == "torn_down":
                self.report(node, key, MemberPhase.REJECTED, "torn down by its leader")
            elif w.verdict == "ok":
                a.members[key] = MemberPhase.STARTING
                a.launching.append(key)
        finally:
            a.arrivals.done(m.gang, m.incarnation, m.rank)

    def launched(self, data: st.DataObject) -> None:
        node, key = data.draw(st.sampled_from([(n, k) for n, a in self.agents.items() for k in a.launching]))
        self.agents[node].launching.remove(key)
        self.report(node, key, MemberPhase.RUNNING)

    def member_exits(self, data: st.DataObject) -> None:
        node, key = data.draw(st.sampled_from([(n, k) for n, a in self.agents.items() for k, p in a.members.items()
                                               if k[0] == self.g.incarnation and p == MemberPhase.RUNNING]))
        code = data.draw(st.sampled_from((0, 1)))
        event("a member exits")
        self.report(node, key, MemberPhase.SUCCEEDED if code == 0 else MemberPhase.FAILED)

    ENABLED = {
        "reserve": lambda w: w.g.state == GangState.PENDING,
        "reserve_task": lambda w: bool(w.tasks),
        "cancel": lambda w: not w.g.state.terminal,
        "leader_hears": lambda w: any(w.up.values()),
        "agent_reads": lambda w: any(w.down.values()),
        "token_read": lambda w: any(x.verdict is None for a in w.agents.values() for x in a.waiting),
        "start_turn": lambda w: any(x.verdict is not None for a in w.agents.values() for x in a.waiting),
        "launched": lambda w: any(a.launching for a in w.agents.values()),
        # Members end on their own only while their gang runs (a failure
        # restarts it, successes end it): one of an incarnation that is over
        # runs until it is stopped, as a long job does.
        "member_exits": lambda w: not lifecycle.torn_down(w.g.state) and any(
            k[0] == w.g.incarnation and p == MemberPhase.RUNNING for a in w.agents.values() for k, p in a.members.items()),
    }

    # The cancel is one action among the others, so that it falls anywhere
    # in the start (and some gangs run, fail and restart before it comes).
    ACTIONS = sorted(ENABLED)

    @rule(action=st.sampled_from(ACTIONS), data=st.data())
    def step(self, action: str, data: st.DataObject) -> None:
        """One rule whose ``action`` picks what happens (as in
        tests/unit/test_twophase_model.py: swarm testing switches whole rules
        off); one that cannot happen now gives way to a step of the start
        that can (drawn from those; never the cancel, which stays one
        action in many), and when none can, time passes."""
        self.now += 1.0
        if not self.ENABLED[action](self):
            can = [a for a in self.ACTIONS if a != "cancel" and self.ENABLED[a](self)]
            if not can:
                return
            action = data.draw(st.sampled_from(can))
        if action in ("reserve", "reserve_task", "cancel"):
            getattr(self, action)()
        else:
            getattr(self, action)(data)

    # ---------------------------------------------------------- teardown
    def pending(self) -> bool:
        return bool(self.tasks or any(self.down.values()) or any(self.up.values())
                    or any(a.waiting or a.launching for a in self.agents.values()))

    def teardown(self) -> None:
        if not self.g.state.terminal:
            self.cancel()
        for _ in range(200):
            if not self.pending():
                break
            self.drain_one()
        assert not self.pending(), "the world did not settle"
        assert self.g.state.terminal
        live = {(n, k): p for n, a in self.agents.items() for k, p in a.members.items() if p.live}
        assert live == {}, f"{self.g.state.name} gang with live members {live}"
        assert self.res is None, f"{self.g.state.name} gang still holds {self.res}"

    def drain_one(self) -> None:
        if self.tasks:
            self.reserve_task()
            return
        for node in NODES:
            a = self.agents[node]
            if self.down[node]:
                msg = self.down[node].pop(0)
                self.down[node].insert(0, msg)
                self.agent_reads(_Pick(node))
                return
            if a.waiting:
                w = a.waiting[0]
                if w.verdict is None:
                    self.token_read(_Pick(w))
                else:
                    self.start_turn(_Pick((node, w)))
                return
            if a.launching:
                self.launched(_Pick((node, a.launching[0])))
                return
            if self.up[node]:
                self.leader_hears(_Pick(node))
                return


class _Pick:
    """Stands in for ``st.data()`` when teardown takes a step itself: the
    draw returns the one choice given."""

    def __init__(self, value: object) -> None:
        self.value = value

    def draw(self, _strategy: object) -> object:
        return self.value


StartWorld.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestStartWorld = StartWorld.TestCase
