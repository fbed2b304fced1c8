"""Model test of a cross-AZ gang's start against its cancel (hypothesis
stateful, docs/style.md §14; issue 26: "the two-phase and single-AZ paths
alike").

tests/unit/test_start_cancel_model.py races a cancel with a single-AZ
gang's start; tests/unit/test_twophase_model.py races cancels with every
phase of the two-phase protocol but dispatches no member. This world starts
where the latter stops: the owner's COMMIT decision and the gang's RESERVED
record are durable (one txn), and each AZ's hold is still PREPARED in etcd
(the cancel during prepare and commit is that world's). Two AZs: the owner
``az-a`` with one member on ``a0``, the participant ``az-b`` with one
member on ``b0``, or two (on ``b0``, or on ``b0`` and ``b1``). Each AZ's
leader decides with the real cores: its ``ParticipantState`` (recovered
from the PREPARED hold and the COMMIT key: the hold's COMMITTED write, the
dispatch that follows, the hold's release on ``GangFinished``), the real
``cross_az_members.hold_over`` on the gang record as its watch shows it
(revoke this AZ's members, wait for their reports or the fence deadline,
publish the member summary, then tell the core), ``gang_effects``'
assignments and stray-member revocation; the owner's leader adds the
lifecycle (``lifecycle.cancel``, ``teardown``, ``after_teardown``,
``member_progress``) over the members' summaries. Agents decide with the
real ``Arrivals`` and ``FenceTimer``. etcd is a few fields: the gang record,
each AZ's hold and member summary.

Every step is an action taken in any order: the owner's STARTING write,
each core effect (the COMMITTED write, the dispatch, the release), each
summary write, each AZ's watch delivering the next change of the gang
record or of a summary (in order, but as late as it likes), each leader's
tick, messages to and from each agent (each stream in order), each
assignment's token read (its AZ's hold as it is then) and turn to start, a
launch that returns later, a member's exit while its gang runs (the gang
allows no restart: a failure ends it), an agent cut off from its leader for
good (it fences ``fence_after_s`` after it last heard it: a leader heard is
one whose messages all got through), time passing (past fence deadlines),
and the cancel, at any point of all that.

At teardown the gang is cancelled if it has not ended, every step is taken
and time moved past the fence bound (``Timings.replace_after_s``) until
nothing is left to do; then "terminal => members stopped and devices
released" in both AZs: no member of the gang live at any agent, both holds
released (in etcd and in each core), the owner done with the gang (every
member ended in its view), and each AZ's last member summary saying how each
of its members ended.

Not modelled: restarts (the two-phase world covers the next incarnation's
attempt), leader failover, a revocation's effect on a member whose launch
has not returned (as in the single-AZ world, it finds nothing to stop;
the member's later RUNNING report is revoked again as a stray).

What it shows beyond that property (a hypothesis ``event``, not a failure):
a hold can be released while a member of its AZ is still STARTING at an
agent that heard its leader all along. ``hold_over`` gives up on a member
``replace_after_s`` after its revoke on the ground that its agent has fenced
by then; an agent that read the revoke while that member's launch was in
flight neither fenced nor stopped it, so a launch slower than
``replace_after_s`` starts on released devices. The agent now stops such a
member itself as its launch returns, never reporting it RUNNING
(agent/session.py ``_assign``; tests/integration/test_revoke_during_launch.py);
this world still models a revocation as finding nothing to stop in flight,
and the window between the release and the launch's return remains (the
agent's own ledger refuses a new member on those devices meanwhile, §9.4).
(The single-AZ path keeps the reservation RELEASING until the member reports.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from agent.core.enforcement import Arrivals, FenceTimer
from coordinator.core import cross_az_members, lifecycle
from coordinator.core import gang_effects as fx
from coordinator.core.progress import MemberReport
from coordinator.core.records import GangRecord, MemberAssignment, MemberSummary
from coordinator.core.twophase import (
    CommitWritten,
    DecisionRecord,
    DispatchGang,
    GangFinished,
    HoldReleased,
    MarkCommitted,
    Outcome,
    ParticipantRecovered,
    ParticipantState,
    ReleaseHold,
)
from phalanx.agent_messages import Assign, MemberStatus, Revoke
from phalanx.model import GangState, MemberPhase
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.spec import GangSpec, Policy, Resources, Topology
from phalanx.timings import Timings
from tests.unit.test_start_cancel_model import Waiting

OWNER, PART = "az-a", "az-b"
AZS = (OWNER, PART)
NODE_AZ = {"a0": OWNER, "b0": PART, "b1": PART}
NODES = tuple(NODE_AZ)
EPOCH = 3
T = Timings()


@dataclass
class AgentModel:
    fence: FenceTimer
    arrivals: Arrivals = field(default_factory=Arrivals)
    waiting: list[Waiting] = field(default_factory=list)
    members: dict[int, MemberPhase] = field(default_factory=dict)  # rank -> phase (one incarnation)
    launching: list[int] = field(default_factory=list)  # STARTING, their launch not returned yet
    cut: bool = False  # cut off from its leader for good
    revoked_read: set[int] = field(default_factory=set)  # incarnations whose revocation it has read (the world's note)


@dataclass
class Leader:
    """One AZ leader's two-phase side (TwoPhaseDriver's book for this gang)."""

    core: ParticipantState
    cache: GangRecord  # the gang record as its watch (or its last read) shows it
    effects: list = field(default_factory=list)  # the core's effects not performed yet
    local: dict[int, MemberReport] = field(default_factory=dict)  # local_reports
    published: MemberSummary | None = None
    revoked_at: float | None = None
    told: bool = False  # GangFinished fed to the core
    publishing: bool = False  # a summary write spawned, not landed yet
    watch: list[tuple] = field(default_factory=list)  # etcd changes not delivered yet, in order


class CrossAzWorld(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 100.0
        self.down: dict[str, list[tuple[float, Assign | Revoke]]] = {n: [] for n in NODES}
        self.up: dict[str, list[MemberStatus]] = {n: [] for n in NODES}
        self.agents = {n: AgentModel(FenceTimer(T.fence_after_s, self.now)) for n in NODES}
        self.summary: dict[str, MemberSummary | None] = {az: None for az in AZS}  # etcd members/<gang>/<az>
        self.owner_reports: dict[int, MemberReport] = {}  # the owner's book.members, from the summaries
        self.owner_tasks: list[str] = []
        self.owner_done = False  # after_teardown said FORGET: the owner dropped the gang

    @initialize(two_in_b=st.booleans(), split_b=st.booleans())
    def committed(self, two_in_b: bool, split_b: bool) -> None:
        placement = [MemberAssignment(0, OWNER, "a0", (0,), ()), MemberAssignment(1, PART, "b0", (0,), ())]
        if two_in_b:
            placement.append(MemberAssignment(2, PART, "b1" if split_b else "b0", (0,) if split_b else (1,), ()))
        spec = GangSpec(name="g", members=len(placement), resources=Resources(gpus=1),
                        topology=Topology(allow_cross_az=True), policy=Policy(max_restarts=0))
        # The owner's COMMIT and the RESERVED record in one txn (coordinator/twophase/store_effects.py).
        self.g = GangRecord(id="g", spec=spec, state=GangState.RESERVED, owner_az=OWNER, submitted_at=self.now,
                            updated_at=self.now, placement=tuple(placement))
        self.owner_tasks.append("mark_starting")
        self.res: dict[str, Reservation | None] = {}
        self.leaders: dict[str, Leader] = {}
        for az in AZS:
            nodes: dict[str, NodeDevices] = {}
            for m in placement:
                if m.az == az:
                    cur = nodes.get(m.node, NodeDevices((), ()))
                    nodes[m.node] = NodeDevices(tuple(sorted(cur.gpus + m.gpus)), ())
            self.res[az] = Reservation(az, "g", 1, HoldState.PREPARED, nodes, EPOCH, two_phase=True, owner_az=OWNER,
                                       submitted_at=self.now)
            core = ParticipantState(az)
            effects = core.handle(ParticipantRecovered(
                stimulus_id=f"recover:{az}", reservations=[self.res[az]],
                decisions=[DecisionRecord(gang="g", incarnation=1, outcome=Outcome.COMMIT, by=OWNER)]), self.now)
            self.leaders[az] = Leader(core, self.g, effects)

    # ------------------------------------------------------------ etcd
    def write_gang(self, g: GangRecord) -> None:
        self.g = g
        for ld in self.leaders.values():
            ld.watch.append(("gang", g))

    def write_summary(self, az: str, body: MemberSummary) -> None:
        self.summary[az] = body
        for ld in self.leaders.values():
            ld.watch.append(("summary", body))

    def send(self, from_az: str, node: str, msg: Assign | Revoke) -> None:
        """A leader's message on a node's session: none to another AZ's
        nodes, nor to an agent cut off."""
        if NODE_AZ[node] == from_az and not self.agents[node].cut:
            self.down[node].append((self.now, msg))

    # ------------------------------------------------------------ the owner's lifecycle
    def owner_task(self) -> None:
        """MarkStarting after the RESERVED write (a no-op once the record moved on)."""
        self.owner_tasks.pop(0)
        if self.g.state == GangState.RESERVED:
            self.write_gang(self.g.evolve(state=GangState.STARTING, updated_at=self.now))

    def cancel(self) -> None:
        verdict = lifecycle.cancel(self.g, OWNER, "race", "test", self.now, EPOCH)
        assert isinstance(verdict, lifecycle.Cancel)
        self.finish(GangState.CANCELLED, verdict.reason)

    def finish(self, state: GangState, reason: str) -> None:
        """GangApi.finish: the teardown write (a cross-AZ gang has no
        single-AZ reservation), then its revocations (the owner's session
        reaches only its own AZ's nodes)."""
        g = self.g
        t = lifecycle.teardown(g, state, reason, (), None, lifecycle.live_member_nodes(g, self.owner_reports),
                               self.now, EPOCH)
        self.write_gang(t.record)
        for e in fx.after_torn_down(fx.TearDown(g, t, "s"), fx.GangWritten(t.record)):
            self.send(OWNER, e.node, Revoke(e.gang, e.incarnation, e.reason))
        self.evaluate()

    def evaluate(self) -> None:
        """GangPerformer.evaluate over the owner's view of its members."""
        if self.owner_done:
            return
        if lifecycle.torn_down(self.g.state):
            then = lifecycle.after_teardown(self.g, self.owner_reports, has_reservation=False, two_phase=True)
            if then is not None:
                assert then is lifecycle.AfterTeardown.FORGET, then
                self.owner_done = True
            return
        step = lifecycle.member_progress(self.g, self.owner_reports, self.now, EPOCH)
        if step is None:
            return
        if step.teardown:
            event(f"ended by its members: {step.to.name}")
            self.finish(step.to, step.reason)
        else:
            self.write_gang(self.g.evolve(state=step.to, reason=step.reason, updated_at=self.now))

    # ------------------------------------------------------------ each AZ's two-phase side
    def known(self, az: str) -> GangRecord:
        """book.known_gang: owned, else the cached record."""
        return self.g if az == OWNER and not self.owner_done else self.leaders[az].cache

    def feed(self, az: str, ev: object) -> None:
        self.leaders[az].effects += self.leaders[az].core.handle(ev, self.now)

    def perform(self, az: str, e: object) -> None:
        """The driver performs one of the core's effects."""
        ld = self.leaders[az]
        r = self.res[az]
        if isinstance(e, MarkCommitted):
            if r is not None and r.incarnation == e.incarnation:
                self.res[az] = Reservation(az, "g", r.incarnation, HoldState.COMMITTED, r.nodes, EPOCH, two_phase=True,
                                           owner_az=OWNER, submitted_at=r.submitted_at)
                self.feed(az, CommitWritten(stimulus_id="s", gang="g", incarnation=e.incarnation))
        elif isinstance(e, DispatchGang):
            # Members.dispatch (coordinator/twophase/): a gang it knows as over is read again.
            g = self.known(az)
            if g.state.terminal:
                ld.cache = g = self.g
                if g.state.terminal:
                    self.maybe_finish(az, g)
                    return
            for node, msg in fx.assignments(g, az, None):
                self.send(az, node, msg)
        elif isinstance(e, ReleaseHold):
            if r is not None and r.incarnation == e.incarnation:
                live = [(n, k) for n, a in self.agents.items() if NODE_AZ[n] == az and not a.cut
                        for k, p in a.members.items() if p.live]
                if live:
                    event("a hold released while a member there is still live")
                self.res[az] = None
            self.feed(az, HoldReleased(stimulus_id="s", gang="g", incarnation=e.incarnation))
        # (the recovered core issues no other effect for a decided hold)

    def maybe_finish(self, az: str, g: GangRecord) -> None:
        """Members.maybe_finish: do what hold_over decides."""
        ld = self.leaders[az]
        hold = ld.core.holds.get("g")
        if hold is None:
            return
        step = cross_az_members.hold_over(
            g, az=az, incarnation=hold.incarnation, prepared=hold.state is HoldState.PREPARED, told=ld.told,
            revoked_at=ld.revoked_at, reports=ld.local, published=ld.published, now=self.now,
            replace_after_s=T.replace_after_s)
        if step is None:
            return
        if step.revoke:
            event(f"{az} revokes its members")
            ld.revoked_at = self.now
            for node in hold.nodes:
                self.send(az, node, Revoke("g", hold.incarnation, g.reason or "gang over"))
        if step.stopped:
            event(f"{az} gives up on a member at the fence deadline")
            ld.local.update(step.stopped)
        if step.publish:
            ld.publishing = True
        elif step.finish:
            ld.told = True
            self.feed(az, GangFinished(stimulus_id="s", gang="g", incarnation=hold.incarnation))

    def publish(self, az: str) -> None:
        """Members._publish_members: only while the hold exists, in
        memory and in etcd (no summary outlives it)."""
        ld = self.leaders[az]
        ld.publishing = False
        hold = ld.core.holds.get("g")
        body = MemberSummary.of(1, az, ld.local)
        if hold is None or ld.published == body or self.res[az] is None:
            return
        self.write_summary(az, body)
        ld.published = body

    def watch(self, az: str) -> None:
        """The AZ's watch delivers the next change, in etcd's order."""
        ld = self.leaders[az]
        kind, value = ld.watch.pop(0)
        if kind == "gang":
            ld.cache = value
            self.maybe_finish(az, value)
        elif az == OWNER and not self.owner_done and value.incarnation == self.g.incarnation:
            self.owner_reports.update(value.members)  # on_member_summary
            self.evaluate()

    def tick(self, az: str) -> None:
        """The leader's tick: the hold looked at again, a summary whose
        write did not land spawned again; the owner re-evaluates."""
        ld = self.leaders[az]
        self.maybe_finish(az, ld.cache)
        if ld.local and ld.published != MemberSummary.of(1, az, ld.local) and "g" in ld.core.holds:
            ld.publishing = True
        if az == OWNER:
            self.evaluate()

    def leader_hears(self, node: str) -> None:
        """AzLeader.on_member: a stray is revoked again; a member of a gang
        held here goes to the two-phase side (on_member), else the owner
        keeps it."""
        m = self.up[node].pop(0)
        az = NODE_AZ[node]
        ld = self.leaders[az]
        for e in fx.stray_member_effects(node, m, self.known(az), "s"):
            event("a stray member revoked again")
            self.send(az, e.node, Revoke(e.gang, e.incarnation, e.reason))
        if "g" in ld.core.holds:
            rep = MemberReport(m.phase, m.exit_code, m.reason, node)
            if ld.local.get(m.rank) != rep:
                ld.local[m.rank] = rep
                ld.publishing = True
                self.maybe_finish(az, ld.cache)
        elif az == OWNER and not self.owner_done and m.incarnation == self.g.incarnation:
            self.owner_reports[m.rank] = MemberReport(m.phase, m.exit_code, m.reason, node)
            self.evaluate()

    # ------------------------------------------------------------ agents
    def report(self, node: str, rank: int, phase: MemberPhase, reason: str = "") -> None:
        a = self.agents[node]
        a.members[rank] = phase
        if not a.cut:
            self.up[node].append(MemberStatus(gang="g", incarnation=1, rank=rank, phase=phase, reason=reason,
                                              node=node))

    def agent_reads(self, node: str) -> None:
        """The session reads the next message (the leader's heartbeats sent
        before it got through too); as in the single-AZ world."""
        sent, msg = self.down[node].pop(0)
        a = self.agents[node]
        a.fence.heard(sent)
        if isinstance(msg, Assign):
            a.arrivals.arrive(msg.gang, msg.incarnation, msg.rank)
            a.waiting.append(Waiting(msg))
            return
        a.arrivals.revoke(msg.gang, msg.incarnation)
        a.revoked_read.add(msg.incarnation)
        for rank, phase in list(a.members.items()):
            if phase.live and rank not in a.launching:
                self.report(node, rank, MemberPhase.STOPPED, f"revoked: {msg.reason}")

    def token_read(self, node: str, w: Waiting) -> None:
        """The read of its AZ's hold as etcd has it now (none when cut off)."""
        r = None if self.agents[node].cut else self.res[NODE_AZ[node]]
        inc = w.assign.incarnation
        w.verdict = ("ok" if r is not None and r.holds("g", inc)
                     else "torn_down" if r is not None and r.releasing(inc) else "refused")

    def start_turn(self, node: str, w: Waiting) -> None:
        a, m = self.agents[node], w.assign
        a.waiting.remove(w)
        try:
            if m.rank in a.members:
                return  # a duplicate
            if a.arrivals.revoked(m.gang, m.incarnation, m.rank):
                event("an assignment revoked while it waited")
                self.report(node, m.rank, MemberPhase.REJECTED, "revoked before it started")
            elif w.verdict == "torn_down":
                self.report(node, m.rank, MemberPhase.REJECTED, "torn down by its leader")
            elif w.verdict == "ok":
                # A revocation read first is final here (no assignment of an
                # incarnation follows its revocation on a stream in this world).
                assert m.incarnation not in a.revoked_read, f"{node} starts rank {m.rank} after reading its revocation"
                a.members[m.rank] = MemberPhase.STARTING
                a.launching.append(m.rank)
        finally:
            a.arrivals.done(m.gang, m.incarnation, m.rank)

    def launched(self, node: str, rank: int) -> None:
        self.agents[node].launching.remove(rank)
        self.report(node, rank, MemberPhase.RUNNING)

    def member_exits(self, node: str, rank: int, code: int) -> None:
        event("a member exits")
        self.report(node, rank, MemberPhase.SUCCEEDED if code == 0 else MemberPhase.FAILED)

    def cut(self, node: str) -> None:
        """The agent loses its leader for good: what is in flight either way is lost."""
        event(f"agent {node} cut off")
        self.agents[node].cut = True
        self.down[node].clear()
        self.up[node].clear()

    def fences(self) -> None:
        """Each agent hears its leader while everything sent got through;
        past fence_after_s without, it stops every member it has."""
        for node, a in self.agents.items():
            if not a.cut and not self.down[node]:
                a.fence.heard(self.now)
            if a.fence.overdue(self.now):
                for rank, phase in list(a.members.items()):
                    if phase.live:
                        event("an agent fences a member")
                        if rank in a.launching:
                            a.launching.remove(rank)
                        self.report(node, rank, MemberPhase.STOPPED, "fenced: no valid leader heard")

    # ------------------------------------------------------------ the rule
    def choices(self, action: str) -> list:
        """What ``action`` may act on now (empty: it cannot happen)."""
        if action == "owner_task":
            return [None] if self.owner_tasks else []
        if action == "cancel":
            return [] if self.g.state.terminal else [None]
        if action == "core_effect":
            return [(az, i) for az, ld in self.leaders.items() for i in range(len(ld.effects))]
        if action == "publish":
            return [az for az, ld in self.leaders.items() if ld.publishing]
        if action == "watch":
            return [az for az, ld in self.leaders.items() if ld.watch]
        if action == "tick":
            return list(AZS)
        if action == "leader_hears":
            return [n for n in NODES if self.up[n]]
        if action == "agent_reads":
            return [n for n in NODES if self.down[n]]
        if action == "token_read":
            return [(n, w) for n, a in self.agents.items() for w in a.waiting if w.verdict is None]
        if action == "start_turn":
            return [(n, w) for n, a in self.agents.items() for w in a.waiting if w.verdict is not None]
        if action == "launched":
            return [(n, r) for n, a in self.agents.items() for r in a.launching]
        if action == "member_exits":
            # Members end on their own only while their gang runs; one of an
            # incarnation that is over runs until it is stopped.
            if lifecycle.torn_down(self.g.state):
                return []
            return [(n, r) for n, a in self.agents.items() for r, p in a.members.items() if p == MemberPhase.RUNNING]
        if action == "cut":
            placed = {m.node for m in self.g.placement}
            return [] if any(a.cut for a in self.agents.values()) else sorted(placed)
        if action == "advance":
            return [0.5, 3.0, T.fence_after_s, T.replace_after_s + 1.0]
        raise AssertionError(action)

    ACTIONS = ("owner_task", "cancel", "core_effect", "publish", "watch", "tick", "leader_hears", "agent_reads",
               "token_read", "start_turn", "launched", "member_exits", "cut", "advance")

    def take(self, action: str, choice: object, data: st.DataObject | None = None) -> None:
        note(f"t={self.now:g} {action} {choice}")  # the steps taken, printed with a failing example
        if action == "owner_task":
            self.owner_task()
        elif action == "cancel":
            self.cancel()
        elif action == "core_effect":
            az, i = choice
            self.perform(az, self.leaders[az].effects.pop(i))
        elif action in ("publish", "watch", "tick", "leader_hears", "agent_reads", "cut"):
            getattr(self, action)(choice)
        elif action in ("token_read", "start_turn", "launched"):
            getattr(self, action)(*choice)
        elif action == "member_exits":
            code = data.draw(st.sampled_from((0, 1))) if data is not None else 0
            self.member_exits(*choice, code)
        elif action == "advance":
            self.now += choice
        self.fences()

    @rule(action=st.sampled_from(ACTIONS), data=st.data())
    def step(self, action: str, data: st.DataObject) -> None:
        """One rule whose ``action`` picks what happens (as in the other
        worlds: swarm testing switches whole rules off); one that cannot
        happen now gives way to a step that can (never the cancel, the cut
        or the passing of time, which stay one action in many)."""
        can = self.choices(action)
        if not can:
            rest = [a for a in self.ACTIONS if a not in ("cancel", "cut", "advance", "tick") and self.choices(a)]
            if not rest:
                return
            action = data.draw(st.sampled_from(rest))
            can = self.choices(action)
        self.take(action, data.draw(st.sampled_from(can)), data)

    # ---------------------------------------------------------- teardown
    BUSY = ("owner_task", "core_effect", "publish", "watch", "leader_hears", "agent_reads", "token_read",
            "start_turn", "launched")

    def busy(self) -> bool:
        return any(self.choices(a) for a in self.BUSY)

    def teardown(self) -> None:
        if not self.g.state.terminal:
            self.cancel()
        for _ in range(40):
            for _ in range(500):
                todo = [a for a in self.BUSY if self.choices(a)]
                if not todo:
                    break
                self.take(todo[0], self.choices(todo[0])[0])
            for az in AZS:
                self.tick(az)
            if self.busy():
                continue
            if self.settled():
                break
            self.take("advance", T.replace_after_s + 1.0)
        assert not self.busy(), "the world did not settle"
        assert self.g.state.terminal
        live = {(n, r): p for n, a in self.agents.items() for r, p in a.members.items() if p.live}
        assert live == {}, f"{self.g.state.name} gang with live members {live}"
        held = {az: r for az, r in self.res.items() if r is not None}
        assert held == {}, f"{self.g.state.name} gang still holds {held}"
        in_core = {az: ld.core.holds.get("g") for az, ld in self.leaders.items() if "g" in ld.core.holds}
        assert in_core == {}, f"{self.g.state.name} gang still held in memory: {in_core}"
        assert self.owner_done, f"the owner still waits for members: {self.owner_reports}"
        for az in AZS:
            mine = {m.rank for m in self.g.placement if m.az == az}
            s = self.summary[az]
            ended = {} if s is None else {r: rep for r, rep in s.reports().items() if not rep.phase.live}
            assert set(ended) == mine, f"{az}'s member summary {s} does not say how each of {sorted(mine)} ended"

    def settled(self) -> bool:
        return (self.owner_done and all(r is None for r in self.res.values())
                and not any("g" in ld.core.holds for ld in self.leaders.values())
                and not any(p.live for a in self.agents.values() for p in a.members.values()))


CrossAzWorld.TestCase.settings = settings(max_examples=800, stateful_step_count=60, deadline=None)
TestCrossAzWorld = CrossAzWorld.TestCase
