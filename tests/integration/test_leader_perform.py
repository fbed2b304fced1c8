"""Driver-level tests of the leader's gang-effect interpreter, the two-phase
driver's handler and its feed loop (docs/design.md §19.8, §19.9; docs/two-phase.md "The driver").

A real ``AzLeader`` is built in the test process, as coordinator/server.py
builds it: a ``Store`` as the cluster's coordinator user (TLS, etcd auth), a
``LeaseSession``, an ``Election`` won for the AZ, then ``AzLeader(...)`` whose
``run()`` rebuilds and recovers from etcd (``until_rebuilt``) before the tests
use it. No peers (``peer_channel=None``), no agents, no mocks of our
components. Each test has its own cluster prefix (the ``cluster_name``
fixture), which is wiped and checked empty afterwards.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import grpc
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.twophase import (
    Core,
    CreateDecision,
    DecisionCreated,
    DecisionObserved,
    DecisionRecord,
    HoldFound,
    HoldWritten,
    MarkGangPending,
    Outcome,
    PrepareReceived,
    Routed,
    ScheduleTimeout,
    SendDecisionAck,
    SendFinish,
    SendVote,
    WriteHold,
)
from coordinator.core.records import GangRecord, MemberAssignment
from coordinator.core.twophase_events import PrepareTimedOut
from coordinator.election import Election, LeaseSession
from coordinator.leader import AzLeader
from coordinator.twophase.peer_calls import PeerRefused
from phalanx.errors import Conflict
from phalanx.model import GangState
from phalanx.reservation import HoldState, NodeDevices, Reservation
from phalanx.spec import GangSpec, Resources, Topology
from phalanx.store import Put, Store
from phalanx.timings import Timings
from phalanx.v1 import peer_pb2 as ppb

pytestmark = pytest.mark.integration

AZ = "az-a"
OTHER_AZ = "az-b"
# Default timings: a 5 s lease (a shared, busy test machine must not lose it)
# and a 10 s prepare timeout, so the participant's in-doubt timer never fires
# within a test and takes the release path the test means to exercise.
T = Timings()
WAIT_S = 15.0


async def wait_for(what: str, cond: Callable[[], Awaitable[bool] | bool], timeout: float = WAIT_S) -> None:
    """Poll ``cond`` until it holds; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def store(etcd_endpoint: str, cluster_name: str, etcd_coordinator_tls: Any):
    """The store as a coordinator opens it: TLS, the cluster's coordinator user."""
    async with Store([etcd_endpoint], cluster_name, timeout=T.etcd_timeout_s, tls=etcd_coordinator_tls) as s:
        yield s


@pytest.fixture
async def leader(store: Store, etcd_endpoint: str, cluster_name: str):
    """A leader of AZ as the server makes one: lease, election won, AzLeader
    running (rebuilt and recovered from etcd) until the test ends; then its
    tasks stopped, the leader key resigned and the lease revoked."""
    config = CoordinatorConfig(cluster=cluster_name, az=AZ, coordinator_id="c-test", etcd=(etcd_endpoint,),
                               timings=T).validate()
    session = await LeaseSession(store, T).start()
    election = Election(store, AZ, config.coordinator_id, "127.0.0.1:1", T)
    info = None
    lead = None
    try:
        info = await asyncio.wait_for(election.campaign(session), 10)
        ldr = AzLeader(store, config, info, session, peer_channel=None)
        lead = asyncio.create_task(ldr.run(), name="test-leader-run")
        await asyncio.wait_for(ldr.until_rebuilt(), 15)
        assert ldr.book.participant is not None and not ldr.book.participant.holds
        yield ldr
        # Nothing the test did may have stopped the leadership.
        assert not lead.done(), f"the leader stopped during the test: {lead.exception() if not lead.cancelled() else 'cancelled'}"
        assert ldr.failure is None
    finally:
        if lead is not None:
            lead.cancel()
            await asyncio.gather(lead, return_exceptions=True)
            # run()'s finally stopped it: every task it spawned is cancelled.
            await asyncio.sleep(0)
        if info is not None:
            await election.resign(info)
        await session.close(revoke=True)
    # No task of this leadership is left running on the loop: the cancelled
    # ones end (an observed fact, waited for), and none keeps running.
    mine = {"twophase-watch", "gang-collector"}

    def left() -> list[str]:
        return [t.get_name() for t in asyncio.all_tasks() if not t.done() and t is not asyncio.current_task()
                and (t.get_name() in mine or t.get_name().startswith(("WriteHold-", "ReleaseHold-", "timer-", "test-leader")))]

    await wait_for("the leader's tasks to end", lambda: not left())


async def read_hold(store: Store, gang: str) -> tuple[Reservation | None, int]:
    """``reservations/<AZ>/<gang>`` parsed, and its mod_revision (0: absent)."""
    kv = await store.get(store.keys.reservation(AZ, gang))
    if kv is None:
        return None, 0
    return Reservation.from_dict(kv.json(), kv.mod_revision), kv.mod_revision


NODES = {"node-1": NodeDevices((0, 1), ("mlx5_0",)), "node-2": NodeDevices((3,), ())}


def write_hold(gang: str, inc: int = 1, stimulus: str = "test-write-hold") -> WriteHold:
    return WriteHold(stimulus_id=stimulus, az=AZ, gang=gang, incarnation=inc, owner_az=OTHER_AZ, priority=5,
                     submitted_at=1000.0, nodes=NODES)


# ---------------------------------------------------------------- 1
async def test_perform_write_hold_writes_prepared_record_once(leader: AzLeader, store: Store) -> None:
    """Fails if: the driver's handler of WriteHold returns no events, or an
    event other than HoldWritten, or one not routed to the
    participant core only); the record is not PREPARED with these devices,
    this incarnation, the leader's epoch and the owner's order fields; or a
    second identical WriteHold overwrites the record (mod_revision moves) or
    answers anything but HoldFound(found=1) with the stored revision."""
    gang = "g-hold"
    done = await leader.twophase.perform(write_hold(gang))
    assert len(done) == 1, done
    (r,) = done
    assert r.to == frozenset({Core.PARTICIPANT})
    assert r.event == HoldWritten(stimulus_id="test-write-hold", gang=gang, incarnation=1)

    rec, rev = await read_hold(store, gang)
    assert rec is not None, "no reservations/<az>/<gang> after HoldWritten"
    assert rec.state is HoldState.PREPARED
    assert (rec.az, rec.gang, rec.incarnation) == (AZ, gang, 1)
    assert dict(rec.nodes) == NODES
    assert rec.two_phase and rec.owner_az == OTHER_AZ and rec.priority == 5 and rec.submitted_at == 1000.0
    assert rec.epoch == leader.epoch
    # The driver remembers the revision it wrote (MarkCommitted commits it without a read).
    assert leader.book.hold_revision[(gang, 1)] == rev
    # handle only returns the events: nothing was fed to the participant.
    assert gang not in leader.book.participant.holds

    again = await leader.twophase.perform(write_hold(gang, stimulus="test-write-hold-2"))
    assert len(again) == 1, again
    (r2,) = again
    assert r2.to == frozenset({Core.PARTICIPANT})
    assert r2.event == HoldFound(stimulus_id="test-write-hold-2", gang=gang, incarnation=1, found=1, revision=rev)
    rec2, rev2 = await read_hold(store, gang)
    assert rev2 == rev, "a second WriteHold of the same incarnation rewrote the record"
    assert rec2 == rec


# ---------------------------------------------------------------- 2
async def test_feed_loop_prepare_then_abort_writes_and_releases_the_hold(leader: AzLeader, store: Store) -> None:
    """The feed loop end to end, no peers. Fails if: the participant does not
    claim the devices at once (synchronously in feed); the WriteHold it
    decides is not spawned through the driver's handler, or its HoldWritten is
    not fed back (the record never appears, or the hold stays
    ``written=False`` without a prepare deadline); the ABORT does not drop
    the hold at once while keeping its devices in ``book.releasing``; or
    the ReleaseHold is not performed / its HoldReleased not fed back (the
    record stays, or ``book.releasing`` / the core's pending releases never
    empty)."""
    gang = "g-feed"
    book = leader.book
    part = book.participant
    prepare = PrepareReceived(stimulus_id="test-prepare", gang=gang, incarnation=1, owner_az=OTHER_AZ, priority=5,
                              submitted_at=1000.0, nodes=NODES)
    leader.twophase.feed(Routed.participant(prepare))
    # Claimed before the feed returned: the devices are taken in memory, the
    # write is in flight, no YES yet.
    hold = part.holds.get(gang)
    assert hold is not None and hold.incarnation == 1
    assert hold.state is HoldState.PREPARED and not hold.written
    assert any(dict(s) == NODES for s in book.held_slices())

    async def prepared() -> bool:
        rec, _ = await read_hold(store, gang)
        h = part.holds.get(gang)
        return rec is not None and h is not None and h.written
    await wait_for("the PREPARED record and HoldWritten fed back", prepared)
    rec, rev = await read_hold(store, gang)
    assert rec.state is HoldState.PREPARED and dict(rec.nodes) == NODES and rec.incarnation == 1
    hold = part.holds[gang]
    # Past writing: durable, still PREPARED (no decision), in-doubt timer set.
    assert hold.written and hold.state is HoldState.PREPARED and hold.deadline is not None
    assert book.hold_revision[(gang, 1)] == rev
    assert not book.releasing

    leader.twophase.feed(Routed.both(DecisionObserved(stimulus_id="test-abort", gang=gang, incarnation=1,
                                                      outcome=Outcome.ABORT)))
    # Decided at once: the hold is gone from the core, its devices stay taken
    # until the delete commits.
    assert gang not in part.holds
    assert part.known_decisions.get((gang, 1)) is Outcome.ABORT
    assert book.releasing.get((gang, 1)) is not None
    assert any(dict(s) == NODES for s in book.held_slices())

    async def released() -> bool:
        rec, _ = await read_hold(store, gang)
        return rec is None and not book.releasing and not part.pending_releases
    await wait_for("the record deleted and HoldReleased fed back", released)
    assert gang not in part.holds
    assert (gang, 1) not in book.hold_revision
    assert not any(dict(s) == NODES for s in book.held_slices())
    # The member summary key goes with the hold (it was never written here).
    assert await store.get(store.keys.member_summary(gang, AZ)) is None


# ---------------------------------------------------------------- 3
@pytest.mark.parametrize("first,second", [(Outcome.ABORT, Outcome.COMMIT), (Outcome.COMMIT, Outcome.ABORT)])
async def test_perform_create_decision_is_create_if_absent(leader: AzLeader, store: Store, first: Outcome,
                                                           second: Outcome) -> None:
    """Fails if: CreateDecision is not the create-if-absent of
    ``decisions/<gang>/<inc>`` (the second create wins, or overwrites the
    key); DecisionCreated does not say who won and what the key holds; or
    its routing is not both cores (the participant and the owner learn one
    outcome)."""
    gang = "g-dec"

    async def create(n: int, outcome: Outcome, reason: str) -> Any:
        """Perform the n-th create; the one event it returns, routed to both cores."""
        done = await leader.twophase.perform(CreateDecision(stimulus_id=f"test-dec-{n}", gang=gang, incarnation=1,
                                                           outcome=outcome, reason=reason))
        assert [r.to for r in done] == [frozenset({Core.PARTICIPANT, Core.OWNER})]
        return done[0].event

    assert await create(1, first, "test first") == DecisionCreated(stimulus_id="test-dec-1", gang=gang, incarnation=1,
                                                                   won=True, outcome=first)
    kv1 = await store.get(store.keys.decision(gang, 1))
    assert kv1 is not None
    assert await create(2, second, "test second") == DecisionCreated(stimulus_id="test-dec-2", gang=gang,
                                                                     incarnation=1, won=False, outcome=first)
    kv2 = await store.get(store.keys.decision(gang, 1))
    assert kv2 is not None and kv2.mod_revision == kv1.mod_revision
    d = DecisionRecord.from_dict(kv2.json(), gang=gang, incarnation=1)
    assert d.outcome is first and d.by == AZ and d.reason == "test first"


# ---------------------------------------------------------------- 4
def _no_io_effects(gang: str) -> list[Any]:
    return [
        SendVote(stimulus_id="s", to_az=OTHER_AZ, from_az=AZ, gang=gang, incarnation=1, yes=True, reason="prepared"),
        SendDecisionAck(stimulus_id="s", to_az=OTHER_AZ, gang=gang, incarnation=1, applied=True, state="COMMITTED"),
        SendFinish(stimulus_id="s", to_az=OTHER_AZ, gang=gang, incarnation=1),
        ScheduleTimeout(stimulus_id="s", at=0.0, event=PrepareTimedOut(stimulus_id="s", gang=gang, incarnation=1),
                        to=Core.PARTICIPANT),
        MarkGangPending(stimulus_id="s", gang=gang, incarnation=1, reason="test: never noted"),
    ]


@pytest.mark.parametrize("index", range(len(_no_io_effects("x"))),
                         ids=[type(e).__name__ for e in _no_io_effects("x")])
async def test_perform_refuses_protocol_effects_without_io(leader: AzLeader, store: Store, index: int) -> None:
    """Fails if: the driver's handler accepts a protocol effect that has no I/O
    (those take effect in the feed, before it returns, never as a task), or
    raises something other than TypeError, or one that does not name the
    effect; or if performing it had an effect anyway (a pending reason
    noted, a timer's event fed to the participant)."""
    gang = "g-noio"
    effect = _no_io_effects(gang)[index]
    with pytest.raises(TypeError, match=type(effect).__name__):
        await leader.twophase.perform(effect)
    await asyncio.sleep(0.1)  # (a timer at 0 would have fired by now)
    assert gang not in leader.book.pending_reason
    assert not leader.book.participant.holds
    assert (gang, 1) not in leader.book.participant.known_decisions


# ---------------------------------------------------------------- 5
@pytest.fixture
async def other_leader(store: Store):
    """OTHER_AZ's leader key, won by a second lease session as its
    coordinator would (no AzLeader behind it): the epoch a peer call from
    OTHER_AZ carries. Resigned and its lease revoked afterwards."""
    session = await LeaseSession(store, T).start()
    election = Election(store, OTHER_AZ, "c-other", "127.0.0.1:2", T)
    info = None
    try:
        info = await asyncio.wait_for(election.campaign(session), 10)
        yield info
    finally:
        if info is not None:
            await election.resign(info)
        await session.close(revoke=True)


def attempt_record(gang: str) -> GangRecord:
    """OTHER_AZ's attempt at ``gang``: RESERVING at incarnation 1, rank 0 on
    NODES' node-1 in AZ (this leader's slice), rank 1 in OTHER_AZ."""
    spec = GangSpec(name=gang, members=2, resources=Resources(gpus=2), topology=Topology(allow_cross_az=True))
    placement = (MemberAssignment(0, AZ, "node-1", (0, 1), ("mlx5_0",)),
                 MemberAssignment(1, OTHER_AZ, "b-node-1", (0, 1), ()))
    return GangRecord(id=gang, spec=spec, state=GangState.RESERVING, owner_az=OTHER_AZ, submitted_at=1000.0,
                      updated_at=1000.0, incarnation=1, placement=placement)


def prepare_rpc(gang: str, epoch: int) -> ppb.PrepareRequest:
    return ppb.PrepareRequest(caller=ppb.PeerIdentity(az=OTHER_AZ, epoch=epoch, coordinator_id="c-other"),
                              gang=gang, incarnation=1, priority=0, submitted_at=1000.0,
                              nodes=[ppb.NodeDevices(node="node-1", gpus=[0, 1], nics=["mlx5_0"])])


def decision_rpc(gang: str, epoch: int) -> ppb.DecisionRequest:
    return ppb.DecisionRequest(caller=ppb.PeerIdentity(az=OTHER_AZ, epoch=epoch, coordinator_id="c-other"),
                               gang=gang, incarnation=1)


async def test_peer_calls_are_checked_from_the_watch_once_it_shows_the_record(leader: AzLeader, store: Store,
                                                                              other_leader: Any) -> None:
    """The check test_peer_call_requests.py's counts lean on, made
    deterministic: each RPC is sent only after this leader's watch shows what
    it checks. Fails if: a Prepare whose attempt record (and the caller's
    leader key) the watch already shows, or a Commit whose decision the watch
    already delivered, is checked with an etcd read (``_watched_attempt`` or
    the decision shortcut gone); or if one the watch does not show is not
    read from etcd and refused naming what is missing, with the read counted
    as a check read."""
    drv = leader.twophase
    book = leader.book
    epoch = other_leader.epoch
    gang = "g-watched"
    await store.txn([], [Put(store.keys.gang(gang), attempt_record(gang).to_dict())])
    await wait_for("the caller's epoch and the RESERVING record in the watch",
                   lambda: book.remote.epoch(OTHER_AZ) == epoch and gang in book.watched_gangs)

    # Checked from the watch: no request. (No agent is connected here, so the
    # vote is NO and nothing is written: the count is the check's alone.)
    yes, reason = await drv.peers.handle_prepare_rpc(prepare_rpc(gang, epoch))
    assert not yes and "not ready" in reason, reason
    assert drv.etcd_requests.get(gang, 0) == 0, f"a watched Prepare made {drv.etcd_requests[gang]} etcd request(s)"
    assert drv.check_reads.get(gang, 0) == 0

    # A Prepare for a gang the watch never showed: one check read, refused.
    unseen = "g-unseen"
    with pytest.raises(PeerRefused, match=f"unknown gang '{unseen}'"):
        await drv.peers.handle_prepare_rpc(prepare_rpc(unseen, epoch))
    assert drv.etcd_requests.get(unseen) == 1 and drv.check_reads.get(unseen) == 1

    # The decision, written as the owner would; once the watch delivered it,
    # the Commit is checked without a read. Never prepared here, so refused.
    await store.txn([], [Put(store.keys.decision(gang, 1),
                             DecisionRecord(gang=gang, incarnation=1, outcome=Outcome.COMMIT, by=OTHER_AZ, reason="test").to_dict())])
    await wait_for("the COMMIT in the watch", lambda: book.participant.known_decisions.get((gang, 1)) is Outcome.COMMIT)
    with pytest.raises(PeerRefused, match="never prepared"):
        await drv.peers.handle_decision_rpc(decision_rpc(gang, epoch), commit=True)
    assert drv.etcd_requests.get(gang, 0) == 0, f"a watched Commit made {drv.etcd_requests[gang]} etcd request(s)"

    # A Commit with no decision anywhere: read, refused, counted as a check.
    with pytest.raises(PeerRefused, match="no decision recorded"):
        await drv.peers.handle_decision_rpc(decision_rpc(unseen, epoch), commit=True)
    assert drv.etcd_requests.get(unseen) == 2 and drv.check_reads.get(unseen) == 2


async def test_peer_calls_of_a_deposed_leader_are_refused_by_the_driver(leader: AzLeader, store: Store,
                                                                       other_leader: Any) -> None:
    """The driver's own check of a peer caller's epoch, with no TLS in front
    of it (the RPCs reach the driver directly, as they do from a plaintext
    peer server, where nothing else checks who calls): a caller naming an
    epoch that is not the create revision of ``leader/<its AZ>`` (a deposed
    leader) is refused PERMISSION_DENIED even though the watch shows the
    gang's attempt and the COMMIT, and nothing is held. Fails if
    ``caller_refusal`` or the watched-epoch compare before it is removed from
    ``handle_prepare_rpc`` (the Prepare then reaches the participant and is
    voted on) or from ``handle_decision_rpc`` (the Commit is answered from
    the decision: "never prepared")."""
    drv = leader.twophase
    book = leader.book
    epoch = other_leader.epoch
    deposed = epoch - 1
    gang = "g-deposed"
    await store.txn([], [Put(store.keys.gang(gang), attempt_record(gang).to_dict())])
    await wait_for("the caller's epoch and the RESERVING record in the watch",
                   lambda: book.remote.epoch(OTHER_AZ) == epoch and gang in book.watched_gangs)
    with pytest.raises(PeerRefused, match="is not the current leader of its AZ") as refused:
        await drv.peers.handle_prepare_rpc(prepare_rpc(gang, deposed))
    assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED

    await store.txn([], [Put(store.keys.decision(gang, 1),
                             DecisionRecord(gang=gang, incarnation=1, outcome=Outcome.COMMIT, by=OTHER_AZ,
                                            reason="test").to_dict())])
    await wait_for("the COMMIT in the watch", lambda: book.participant.known_decisions.get((gang, 1)) is Outcome.COMMIT)
    with pytest.raises(PeerRefused, match="is not the current leader of its AZ") as refused:
        await drv.peers.handle_decision_rpc(decision_rpc(gang, deposed), commit=True)
    assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert gang not in book.participant.holds and await read_hold(store, gang) == (None, 0)


async def test_prepare_for_a_gang_another_az_owns_is_refused(leader: AzLeader, store: Store,
                                                            other_leader: Any) -> None:
    """A Prepare from OTHER_AZ's current leader for a gang whose record names
    another owner AZ is refused PERMISSION_DENIED and holds nothing. Fails if
    ``handle_prepare_rpc``'s owner check is removed (the Prepare then reaches
    the participant and is voted on)."""
    gang = "g-not-theirs"
    await store.txn([], [Put(store.keys.gang(gang), attempt_record(gang).evolve(owner_az="az-c").to_dict())])
    with pytest.raises(PeerRefused, match=f"gang {gang} is owned by az-c, not {OTHER_AZ}") as refused:
        await leader.twophase.peers.handle_prepare_rpc(prepare_rpc(gang, other_leader.epoch))
    assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert gang not in leader.book.participant.holds and await read_hold(store, gang) == (None, 0)


async def test_write_gang_loses_to_a_newer_record(leader: AzLeader, store: Store) -> None:
    """The compare that guards every gang write: a write based on a record
    etcd has since replaced (a stale copy) raises Conflict and leaves the
    newer record as it was, and a create of a record that exists raises
    Conflict too. Fails if ``write_gang``'s guard (unchanged since the
    base's mod_revision, or absent) is removed: the stale copy overwrites."""
    gang = "g-stale"
    spec = GangSpec(name=gang, members=1, resources=Resources(gpus=1))
    base = GangRecord(id=gang, spec=spec, state=GangState.FAILED, owner_az=AZ, submitted_at=1000.0,
                      updated_at=1000.0, reason="first")
    first = await leader.writer.write(base, None)
    newer = await leader.writer.write(first.evolve(updated_at=1001.0, reason="newer"), first)
    assert newer.mod_revision > first.mod_revision

    with pytest.raises(Conflict, match=f"gang {gang} changed concurrently"):
        await leader.writer.write(first.evolve(updated_at=1002.0, reason="stale"), first)
    with pytest.raises(Conflict, match=f"gang {gang} changed concurrently"):
        await leader.writer.write(base.evolve(reason="created again"), None)
    kv = await store.get(store.keys.gang(gang))
    assert kv is not None and kv.mod_revision == newer.mod_revision
    assert GangRecord.from_dict(kv.json(), kv.mod_revision).reason == "newer"
