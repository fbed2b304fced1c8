"""The book: one leadership's state of its gangs, holds and nodes.

One object owns it (the leader makes it when it takes office and drops it
when it steps down). The three drivers that perform effects, ``AzLeader``
(single-AZ gangs and every gang's run time), ``TwoPhaseDriver`` (the
cross-AZ protocol) and ``GangCollector`` (retention), keep no state of
their own about a gang: each is given the book and reads and writes it
there, so a question such as "which devices are held here" or "which
gangs may not be collected yet" is asked of one place (docs/design.md
§19.8). What the drivers still keep is their I/O: sessions, futures of
RPCs waiting for a vote, caches of peer addresses, timers.

Plain data plus the questions asked across drivers, and the transitions
that change it. The drivers read its maps but change them only through
the transitions below (one place each that keeps the maps consistent
with one another; tests/unit/test_book_writes.py fails on a driver that
writes a map itself), and ``problems()`` says what must always hold
between the maps (tests/unit/test_book.py). Which driver event is which
transition: docs/book.md. No I/O; every field is
rebuilt from etcd by the next leader (``AzLeader.rebuild``,
``TwoPhaseDriver.recover``), so nothing here needs to survive a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from coordinator.core import progress
from coordinator.core.placement import Placement
from coordinator.core.records import DeviceLedger, GangRecord, MemberSummary, NodeRecord
from coordinator.core.retention import FinishedGang
from coordinator.core.twophase import (
    Event, Outcome, OwnerState, ParticipantState, TwoPhaseConfig,
)
from coordinator.remote_view import RemoteInventory
from phalanx.reservation import Reservation
from phalanx.store import Keys
from phalanx.timings import Timings

GangInc = tuple[str, int]
Reports = dict[int, progress.MemberReport]


def two_phase_config(t: Timings) -> TwoPhaseConfig:
    """The two-phase cores' timings, from the validated ``Timings``."""
    return TwoPhaseConfig(
        vote_timeout_s=t.vote_timeout_s, prepare_timeout_s=t.prepare_timeout_s,
        retry_backoff_s=t.twophase_retry_backoff_s, retry_backoff_max_s=t.twophase_retry_backoff_max_s,
        store_retry_s=t.twophase_store_retry_s,
    )


@dataclass
class NodeLiveness:
    last_contact: float  # monotonic; takeover time for nodes not yet heard from
    ready: bool = False
    heard: bool = False  # its agent registered with this leadership (last_contact is a contact)


@dataclass
class Book:
    az: str
    # ---- this AZ's gangs (AzLeader)
    gangs: dict[str, GangRecord] = field(default_factory=dict)  # owned, not terminal (+ terminal ones still RELEASING)
    reservations: dict[str, Reservation] = field(default_factory=dict)  # this AZ's single-AZ reservations
    ledger: DeviceLedger = field(default_factory=DeviceLedger)  # the devices those reservations hold
    stand_ins: set[str] = field(default_factory=set)  # gangs whose ledger hold stands in for an unreadable reservation
    nodes: dict[str, NodeRecord] = field(default_factory=dict)  # this AZ's node records
    liveness: dict[str, NodeLiveness] = field(default_factory=dict)
    members: dict[GangInc, Reports] = field(default_factory=dict)  # what each owned gang's members reported
    revisions: dict[str, int] = field(default_factory=dict)  # per gang, the newest record revision written or read back
    pending_reason: dict[str, str] = field(default_factory=dict)  # the last cycle's reason per pending gang (explain)
    # ---- the cross-AZ protocol (TwoPhaseDriver)
    participant: ParticipantState | None = None  # this AZ's holds (set by Book.of)
    owners: dict[str, OwnerState] = field(default_factory=dict)  # the cross-AZ gangs this leader owns
    placements: dict[GangInc, Placement] = field(default_factory=dict)  # an owner's placed attempt
    gang_cache: dict[str, GangRecord] = field(default_factory=dict)  # gangs with a hold here (any owner)
    local_reports: dict[GangInc, Reports] = field(default_factory=dict)  # this AZ's members of cross-AZ gangs
    hold_revision: dict[GangInc, int] = field(default_factory=dict)  # mod_revision of the hold record we wrote
    published: dict[GangInc, MemberSummary] = field(default_factory=dict)  # last member summary written
    revoked_at: dict[GangInc, float] = field(default_factory=dict)  # when an ended hold's members were revoked
    finished_fed: set[GangInc] = field(default_factory=set)  # holds the participant was told are over
    dec_by_key: dict[GangInc, Outcome] = field(default_factory=dict)  # decisions read at recovery
    # The last record of every RESERVING gang as the watch delivered it,
    # raw (parsed only for a Prepare's check; docs/two-phase.md "Peer calls").
    watched_gangs: dict[str, Any] = field(default_factory=dict)
    remote: RemoteInventory | None = None  # other AZs, and who leads each AZ (set by Book.of)
    # ---- retention (GangCollector)
    finished: dict[str, FinishedGang] = field(default_factory=dict)  # owned, terminal, not yet collected
    seen_mono: dict[str, float] = field(default_factory=dict)  # gang -> when this leader first saw it finished

    @classmethod
    def of(cls, az: str, keys: Keys, t: Timings) -> "Book":
        return cls(az=az, participant=ParticipantState(az, two_phase_config(t)), remote=RemoteInventory(az, keys))

    # ------------------------------------------------ questions across drivers
    @property
    def releasing(self) -> Any:
        """(gang, inc) -> node -> (gpus, nics) of cross-AZ holds whose
        release is decided but whose record delete has not committed yet:
        still taken (the participant core keeps them, ``ParticipantState.releasing``)."""
        return self.participant.releasing

    def held_slices(self) -> Iterator[Any]:
        """Every node -> (gpus, nics) slice held in this AZ: single-AZ
        reservations (and stand-ins for unreadable ones), cross-AZ holds
        (PREPARED or COMMITTED) and cross-AZ releases not done yet. Placement
        sees none of these devices free."""
        yield from self.ledger.slices()
        yield from (h.nodes for h in self.participant.holds.values())
        yield from self.releasing.values()

    def gangs_holding(self, node: str) -> list[str]:
        """The gangs holding devices on this AZ's ``node``: a single-AZ
        reservation, a cross-AZ hold, or a cross-AZ release not done yet."""
        gangs = {gang for gang in self.ledger.held.get(node, {})}
        gangs |= {gang for gang, h in self.participant.holds.items() if node in h.nodes}
        gangs |= {inc[0] for inc, nodes in self.releasing.items() if node in nodes}
        return sorted(gangs)

    def held_here(self) -> set[str]:
        """Gangs whose devices or attempt are still held here: a single-AZ
        reservation, a cross-AZ hold, or an owner not settled. The collector
        never deletes their records."""
        unsettled = {g for g, o in self.owners.items() if not o.phase.settled}
        return set(self.reservations) | set(self.participant.holds) | unsettled

    def newest(self, rec: GangRecord) -> bool:
        """Whether ``rec`` (written by this leader, or read back from etcd)
        is no older than any record of its gang the leader wrote or read
        back before; if so it is the newest from now on. The leader's view
        never goes back: a cancel retried on the record its write lost to
        can land before the reply of the write it lost to comes back, and
        that reply must not undo it (``GangWriter.write``)."""
        if rec.mod_revision < self.revisions.get(rec.id, 0):
            return False
        self.revisions[rec.id] = rec.mod_revision
        return True

    def known_gang(self, gang: str) -> GangRecord | None:
        """The record of ``gang`` this leader has: owned, else held here."""
        return self.gangs.get(gang) or self.gang_cache.get(gang)

    def drop_attempts(self, gang: str) -> None:
        """Forget the placed attempts of ``gang`` (its owner ended)."""
        for key in [key for key in self.placements if key[0] == gang]:
            del self.placements[key]

    def hold_released(self, gang: str, incarnation: int) -> None:
        """This AZ's hold of ``gang``#``incarnation`` was deleted: drop what
        the book kept for that incarnation's hold."""
        key = (gang, incarnation)
        for d in (self.hold_revision, self.published, self.local_reports, self.revoked_at):
            d.pop(key, None)

    def forget_cross_az(self, gang: str) -> None:
        """``gangs/<gang>`` was collected: drop the cross-AZ memory of it."""
        self.owners.pop(gang, None)
        self.gang_cache.pop(gang, None)
        self.drop_attempts(gang)
        for d in (self.hold_revision, self.published, self.local_reports, self.revoked_at, self.dec_by_key):
            for key in [key for key in d if key[0] == gang]:
                del d[key]
        self.finished_fed = {key for key in self.finished_fed if key[0] != gang}

    # ====================================================== transitions
    # Each is one event of a leadership's life, named for what happened; it
    # changes every map that event concerns, and nothing else.

    # ------------------------------------- single-AZ gangs (AzLeader)
    def restored(self, reservations: Iterable[Reservation], stand_ins: Iterable[Reservation] = ()) -> None:
        """Rebuild: this AZ's single-AZ reservations read from etcd, and
        stand-ins holding the devices of the ones that cannot be read."""
        for r in reservations:
            self.reservations[r.gang] = r
        self.ledger = DeviceLedger.from_reservations(self.reservations)
        for hold in stand_ins:
            self.ledger.hold(hold)
            self.stand_ins.add(hold.gang)

    def live_here(self, g: GangRecord) -> bool:
        """Whether ``g`` belongs in ``gangs``: owned here, and not terminal
        or still holding its single-AZ reservation (RELEASING)."""
        return g.owner_az == self.az and (not g.state.terminal or g.id in self.reservations)

    def owned(self, g: GangRecord) -> None:
        """``g`` is the newest record of a gang this leader owns (submitted,
        written, read back, taken on): keep it."""
        self.gangs[g.id] = g

    def found(self, g: GangRecord) -> None:
        """``g`` is the newest record of its gang, found in etcd where a
        write of ours lost its compare: drop the gang if another AZ adopted
        it meanwhile, else keep the record if it still belongs here."""
        if g.owner_az != self.az:
            self.gangs.pop(g.id, None)
        elif self.live_here(g):
            self.gangs[g.id] = g

    def lost_compare(self, g: GangRecord) -> bool:
        """``g`` was read back where a write of ours lost its compare: if it
        is the newest record of its gang seen (``newest``), the book takes it
        as ``found`` does and this says True (the writer then indexes and
        counts it); an older one, a late reply, changes nothing."""
        if not self.newest(g):
            return False
        self.found(g)
        return True

    def not_owned(self, gang: str) -> None:
        """This leader stops driving ``gang`` (adopted elsewhere, or a
        cross-AZ gang ended: its participants release their own holds)."""
        self.gangs.pop(gang, None)

    def adopted_elsewhere(self, gang: str) -> None:
        """Another AZ adopted ``gang`` (owner-AZ loss): neither its record
        nor its two-phase owner is this leader's any more."""
        self.gangs.pop(gang, None)
        self.owners.pop(gang, None)

    def held_in_memory(self, r: Reservation) -> None:
        """The cycle placed ``r``'s gang: its devices are taken from now on,
        before the reservation's write (undone by ``unheld`` on failure)."""
        self.reservations[r.gang] = r
        self.ledger.hold(r)

    def unheld(self, gang: str, r: Reservation) -> None:
        """The write of reservation ``r`` failed or did not apply: free its
        devices unless a later reservation of the gang replaced it."""
        if self.reservations.get(gang) is r:
            self.unreserved(gang)

    def unreserved(self, gang: str) -> None:
        """``gang``'s single-AZ reservation is gone: its devices are free."""
        self.reservations.pop(gang, None)
        self.ledger.release(gang)
        self.stand_ins.discard(gang)  # (release frees a stand-in's devices too)

    def torn_down(self, g: GangRecord, releasing: Reservation | None, delete_reservation: bool,
                  restarting: bool) -> None:
        """``g``'s incarnation was torn down (written terminal or RESTARTING):
        its reservation kept RELEASING (its devices stay held: members may
        still run) or deleted; the gang and its member reports dropped unless
        it is RELEASING or restarting."""
        if releasing is not None:
            self.reservations[g.id] = releasing
        elif delete_reservation:
            self.unreserved(g.id)
        if releasing is None and not restarting:
            self.gangs.pop(g.id, None)
            self.members.pop((g.id, g.incarnation), None)

    def requeued(self, g: GangRecord) -> None:
        """``g``'s old incarnation is gone and the gang PENDING again: its
        reservation and the old incarnation's member reports go."""
        self.unreserved(g.id)
        self.members.pop((g.id, g.incarnation), None)

    def released(self, g: GangRecord) -> None:
        """A RELEASING reservation's delete committed (every member gone):
        the devices, the gang and its member reports go."""
        self.unreserved(g.id)
        self.gangs.pop(g.id, None)
        self.members.pop((g.id, g.incarnation), None)

    def members_reported(self, gang: str, incarnation: int, reports: Reports) -> None:
        """Reports of members of an owned gang (from agents, from another
        AZ's summary, or taken as stopped when their node was lost)."""
        self.members.setdefault((gang, incarnation), {}).update(reports)

    def waiting(self, gang: str, reason: str) -> bool:
        """``gang`` stays pending for ``reason`` (explain); whether the
        reason changed."""
        if self.pending_reason.get(gang) == reason:
            return False
        self.pending_reason[gang] = reason
        return True

    def placed(self, gang: str) -> None:
        """``gang`` is no longer waiting for placement."""
        self.pending_reason.pop(gang, None)

    def forgotten(self, gang: str) -> None:
        """``gangs/<gang>`` was collected: drop its revision, its record if
        it is over and holds nothing, its member reports and pending reason."""
        self.revisions.pop(gang, None)
        g = self.gangs.get(gang)
        if g is not None and g.state.terminal and gang not in self.reservations:
            del self.gangs[gang]
        for key in [k for k in self.members if k[0] == gang]:
            del self.members[key]
        self.pending_reason.pop(gang, None)

    # ------------------------------------------------------------- nodes
    def node_restored(self, rec: NodeRecord, now: float) -> None:
        """Rebuild: a node record read from etcd; not placeable until its
        agent reaches this leader, lost only after a full replace_after_s
        from ``now``."""
        self.nodes[rec.name] = rec
        self.liveness[rec.name] = NodeLiveness(last_contact=now, ready=False)

    def node_written(self, node: str, rec: NodeRecord) -> None:
        self.nodes[node] = rec

    def node_registered(self, node: str, now: float) -> None:
        """``node``'s agent registered with this leadership at ``now``."""
        self.liveness[node] = NodeLiveness(last_contact=now, ready=True, heard=True)

    def node_deleted(self, node: str) -> None:
        self.nodes.pop(node, None)
        self.liveness.pop(node, None)

    # --------------------------------------- the cross-AZ protocol (TwoPhaseDriver)
    def participant_decides(self, ev: Event, now: float) -> list:
        """Feed ``ev`` to this AZ's participant. A hold whose release the
        core decides stays taken (``releasing``, kept by the core) for
        single-AZ placement too until ReleaseHold's delete commits
        (HoldReleased), so etcd never holds two reservations on one GPU
        (chaos finding 7)."""
        return self.participant.handle(ev, now)

    def owner_started(self, o: OwnerState) -> None:
        self.owners[o.gang] = o

    def owner_ended(self, gang: str) -> None:
        """``gang``'s owner stops (its attempt can never be recorded): it
        and its placed attempts go."""
        self.owners.pop(gang, None)
        self.drop_attempts(gang)

    def owner_forgotten(self, gang: str) -> None:
        """An owner whose gang is no longer owned here and has nothing in
        flight: it, its pending reason and its attempts go."""
        del self.owners[gang]
        self.pending_reason.pop(gang, None)
        self.drop_attempts(gang)

    def attempt_placed(self, gang: str, incarnation: int, placement: Placement) -> None:
        self.placements[(gang, incarnation)] = placement

    def gang_cached(self, g: GangRecord) -> None:
        """A record of a gang with a hold here (any owner), newest known."""
        self.gang_cache[g.id] = g

    def hold_written(self, gang: str, incarnation: int, revision: int) -> None:
        """Our PREPARED record of the hold committed at ``revision``."""
        self.hold_revision[(gang, incarnation)] = revision

    def hold_committing(self, gang: str, incarnation: int) -> int | None:
        """The revision of our own PREPARED write of the hold, if we have
        one; taken: the COMMIT write replaces it."""
        return self.hold_revision.pop((gang, incarnation), None)

    def summary_published(self, gang: str, incarnation: int, summary: MemberSummary) -> None:
        self.published[(gang, incarnation)] = summary

    def summary_recovered(self, gang: str, incarnation: int, summary: MemberSummary) -> None:
        """Recovery: this AZ's member summary of a cross-AZ hold, as written."""
        self.local_reports[(gang, incarnation)] = summary.reports()
        self.published[(gang, incarnation)] = summary

    def local_members_reported(self, gang: str, incarnation: int, reports: Reports) -> None:
        """Reports of this AZ's members of a cross-AZ gang (an entry is
        made even for none: its summary is published)."""
        self.local_reports.setdefault((gang, incarnation), {}).update(reports)

    def local_member_reported(self, gang: str, incarnation: int, rank: int, report: progress.MemberReport) -> bool:
        """One member's report (``local_members_reported``); whether it
        changed what was kept."""
        reps = self.local_reports.setdefault((gang, incarnation), {})
        if reps.get(rank) == report:
            return False
        reps[rank] = report
        return True

    def hold_revoked(self, gang: str, incarnation: int, now: float) -> None:
        self.revoked_at[(gang, incarnation)] = now

    def finish_fed(self, gang: str, incarnation: int) -> None:
        """The participant was told the hold's gang is over."""
        self.finished_fed.add((gang, incarnation))

    def decisions_recovered(self, decisions: Iterable[Any]) -> None:
        self.dec_by_key = {(d.gang, d.incarnation): d.outcome for d in decisions}

    def watched_reset(self, watched: dict[str, Any]) -> None:
        """The RESERVING gangs' records, read whole (recovery); none after
        a compaction until the watch delivers them again."""
        self.watched_gangs = dict(watched)

    def gang_watched(self, gang: str, kv: Any | None) -> None:
        """The watch delivered ``gang``'s record: ``kv`` while RESERVING,
        else None (deleted, or past RESERVING)."""
        if kv is None:
            self.watched_gangs.pop(gang, None)
        else:
            self.watched_gangs[gang] = kv

    # ---------------------------------------------- retention (GangCollector)
    def finished_seen(self, f: FinishedGang, now: float) -> None:
        """An owned gang is terminal: collectable later; ``now`` (monotonic)
        is kept if it is the first time this leader saw it finished."""
        self.finished[f.id] = f
        self.seen_mono.setdefault(f.id, now)

    def not_finished(self, gang: str) -> None:
        self.finished.pop(gang, None)
        self.seen_mono.pop(gang, None)

    # ========================================================= invariants
    def problems(self) -> list[str]:
        """What must always hold between the maps, broken: empty when the
        book is consistent. Checked by tests after each transition and by
        the model worlds."""
        out: list[str] = []

        def keyed(name: str, m: dict, key_of: Any) -> None:
            out.extend(f"{name}[{k!r}] holds the entry of {key_of(v)!r}" for k, v in m.items() if key_of(v) != k)

        keyed("gangs", self.gangs, lambda g: g.id)
        keyed("reservations", self.reservations, lambda r: r.gang)
        keyed("owners", self.owners, lambda o: o.gang)
        keyed("finished", self.finished, lambda f: f.id)
        out.extend(f"gangs[{k!r}] is owned by {g.owner_az}, not {self.az}" for k, g in self.gangs.items()
                   if g.owner_az != self.az)
        for gang, r in self.reservations.items():
            missing = sorted(n for n in r.nodes if gang not in self.ledger.held.get(n, {}))
            if missing:
                out.append(f"reservation of {gang} not held in the ledger on {', '.join(missing)}")
        out.extend(self.ledger.conflicts())
        backed = set(self.reservations) | self.stand_ins
        out.extend(f"ledger holds devices of {gang} on {node} with no reservation behind them"
                   for node, gangs in sorted(self.ledger.held.items()) for gang in sorted(gangs) if gang not in backed)
        if set(self.finished) != set(self.seen_mono):
            out.append(f"finished and seen_mono differ: {sorted(set(self.finished) ^ set(self.seen_mono))}")
        if self.participant is not None:
            live = {(h.gang, h.incarnation) for h in self.participant.holds.values()}
            out.extend(f"{key} is both held and being released" for key in self.releasing if key in live)
        return out
