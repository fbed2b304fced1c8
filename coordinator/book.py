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

Plain data plus the questions asked across drivers. No I/O; every field is
rebuilt from etcd by the next leader (``AzLeader.rebuild``,
``TwoPhaseDriver.recover``), so nothing here needs to survive a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from coordinator.core import progress
from coordinator.core.placement import Placement
from coordinator.core.records import DeviceLedger, GangRecord, MemberSummary, NodeRecord
from coordinator.core.retention import FinishedGang
from coordinator.core.twophase import Outcome, OwnerState, ParticipantState, TwoPhaseConfig
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
    nodes: dict[str, NodeRecord] = field(default_factory=dict)  # this AZ's node records
    liveness: dict[str, NodeLiveness] = field(default_factory=dict)
    members: dict[GangInc, Reports] = field(default_factory=dict)  # what each owned gang's members reported
    revisions: dict[str, int] = field(default_factory=dict)  # per gang, the newest record revision written or read back
    pending_reason: dict[str, str] = field(default_factory=dict)  # the last cycle's reason per pending gang (explain)
    # ---- the cross-AZ protocol (TwoPhaseDriver)
    participant: ParticipantState | None = None  # this AZ's holds (set by Book.of)
    owners: dict[str, OwnerState] = field(default_factory=dict)  # the cross-AZ gangs this leader owns
    # (gang, inc) -> node -> (gpus, nics) of holds whose release is decided
    # but whose record delete has not committed yet: still taken.
    releasing: dict[GangInc, Any] = field(default_factory=dict)
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
        that reply must not undo it (``AzLeader.write_gang``)."""
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
