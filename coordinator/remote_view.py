"""The other AZs' inventory as this AZ leader's cluster-root watch shows it
(docs/design.md §19.10).

Cross-AZ gangs are placed over every AZ, and the admission cycle runs every
few hundred milliseconds while they wait. Reading other AZs from etcd each
cycle would cost requests; rebuilding their NodeViews (and placement's
per-node facts) each cycle would cost time proportional to the fleet. So one
``RemoteInventory`` keeps other AZs' node records, their reservations and
who leads each AZ with which epoch, fed record by record from the watch (and
replaced wholesale by a fresh read at recovery or after a compacted watch),
and hands out:

- ``view()``: other AZs' nodes as placement sees them, cached: rebuilt only
  when a node's topology or readiness, a hold's devices or the set of led
  AZs changed since the last call (``view_rebuilds`` counts them), and then
  only the NodeViews of the nodes concerned are computed again
  (``node_views_computed``);
- ``registered()``: every other AZ's registered topology (never-fits),
  cached until the set of registered topologies changes (``version``);
- ``index()`` / ``placement_index(local)``: a ``FabricIndex`` over those
  topologies, refreshed when they change, so placement does not recompute
  the static facts of remote nodes per cycle;
- ``led`` / ``epoch(az)``: who leads where, and with which epoch (the create
  revision of ``leader/<az>``, this AZ's included), for the view and for the
  peer calls checked from the watch (docs/two-phase.md "Peer calls");
- ``orphaned(now, after)``: the AZs without a leader for longer than
  ``after`` (owner-AZ loss), clocked from the watch and the driver's poll.

It does no I/O: each feeding method returns whether the admission cycle must
wake (capacity may have grown), and the driver sets the event. The view may
be stale; the participants' ledgers refuse a conflicting prepare (one aborted
attempt, never a double grant).

Topology objects are kept stable: a node record re-written with the same
topology (a heartbeat, a readiness flip) keeps the object already held, so
the caches and ``FabricIndex`` (which matches entries by identity) stay
valid.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable

from coordinator.core import capacity
from coordinator.core.placement import FabricIndex, NodeView
from coordinator.core.records import UNREADABLE, NodeRecord
from phalanx.reservation import NodeDevices, Reservation
from phalanx.store import Keys
from phalanx.topology import NodeTopology

log = logging.getLogger(__name__)

At = tuple[str, str]
"""(AZ, name) of a record under ``nodes/`` or ``reservations/``."""


class RemoteInventory:
    """Other AZs' nodes and holds, and every AZ's leader, for AZ ``az``
    (whose own nodes and holds the leader's view has: they are ignored here;
    its leader epoch is kept, for the peer checks)."""

    def __init__(self, az: str, keys: Keys) -> None:
        self.az = az
        self.keys = keys
        self._nodes: dict[At, NodeRecord] = {}  # (az, node)
        self._holds: dict[At, Reservation] = {}  # (az, gang): any reservation there, of any state
        self._holds_on: dict[At, dict[str, NodeDevices]] = {}  # (az, node) -> gang -> what its hold takes there
        # AZ -> create revision of its leader key (this AZ included): who
        # leads where with which epoch, as of the last event fed.
        self._epochs: dict[str, int] = {}
        # False from a compacted watch until the next reset: events in between
        # are lost, so the epochs no longer answer what an etcd read would.
        self._epochs_current = True
        # The owner-loss clock: AZs watched for losing their leader (seen led
        # once, or owning a gang recovered here) and, of those without one,
        # since when (monotonic) this leader has seen them so.
        self._watched: set[str] = set()
        self._leaderless_since: dict[str, float] = {}
        # Bumped whenever the set of registered topologies changes: the
        # leader's never-fits memo and the index follow it.
        self.version = 0
        self.view_rebuilds = 0
        self.node_views_computed = 0
        self.registered_rebuilds = 0
        self.index_refreshes = 0
        self._view: tuple[NodeView, ...] | None = None  # None: some node's view changed
        self._node_views: dict[At, NodeView] = {}
        self._stale: set[At] = set()  # nodes whose NodeView must be computed again
        self._registered: tuple[NodeTopology, ...] = ()
        self._registered_for = 0
        self._index = FabricIndex()
        self._index_for = 0
        self._joined: tuple[FabricIndex, FabricIndex, FabricIndex] | None = None  # (local, remote, both)

    # ---------------------------------------------------------------- feed
    def at(self, key: str, prefix: str) -> At | None:
        """(az, name) of ``<prefix><az>/<name>`` in another AZ; None for this
        AZ's keys or a malformed key."""
        az, _, name = key[len(prefix):].partition("/")
        if not az or not name or az == self.az:
            return None
        return az, name

    def on_node(self, key: str, kv: Any) -> bool:
        """``nodes/<az>/<node>`` was written (``kv``) or deleted (None).
        True when the cycle must wake: a node appeared, or its topology or
        readiness changed (it may fit a waiting gang now)."""
        at = self.at(key, self.keys.nodes())
        if at is None:
            return False
        old = self._nodes.get(at)
        if kv is None:
            if self._nodes.pop(at, None) is not None:
                self._node_views.pop(at, None)
                self._changed_topologies()
            return False  # less capacity: nothing new can fit
        try:
            rec = NodeRecord.from_dict(kv.json(), kv.mod_revision)
        except UNREADABLE as exc:
            # The last readable record (if any) stays: the AZ's leader wrote
            # it and still acts on it.
            log.warning("remote inventory of %s: skipped unreadable node record %s: %r", self.az, key[:200], exc)
            return False
        same_topology = old is not None and old.topology == rec.topology
        if same_topology:
            rec = dataclasses.replace(rec, topology=old.topology)  # keep the object: caches match by identity
        self._nodes[at] = rec
        if not same_topology:
            self._touch(at)
            self._changed_topologies()
            return True
        if not capacity.takes_work(old) or not capacity.takes_work(rec):
            # Cordoned or expired, or back (docs/nodes.md): never-fits
            # counts it again or no more.
            self._touch(at)
            self._changed_topologies()
            return True
        if old.ready != rec.ready:
            self._touch(at)
            return True
        return False  # a heartbeat, an address: what placement sees is the same

    def on_reservation(self, key: str, kv: Any) -> bool:
        """``reservations/<az>/<gang>`` was written (``kv``) or deleted
        (None). True when the cycle must wake: a hold went or changed its
        devices (some may be free now)."""
        at = self.at(key, self.keys.reservations())
        if at is None:
            return False
        if kv is None:
            old = self._holds.pop(at, None)
            if old is None:
                return False
            self._take(at, old, None)
            return True
        try:
            r = Reservation.from_dict(kv.json(), kv.mod_revision)
        except UNREADABLE as exc:
            # Its devices stay as they were in this view (taken, if it was
            # readable before); the AZ's own leader holds them anyway.
            log.warning("remote inventory of %s: skipped unreadable reservation %s: %r", self.az, key[:200], exc)
            return False
        old = self._holds.get(at)
        self._holds[at] = r
        if old is None:
            self._take(at, None, r)
            return False  # a new hold takes devices: nothing new can fit
        if dict(old.nodes) != dict(r.nodes):
            self._take(at, old, r)
            return True
        return False  # a state change (PREPARED -> COMMITTED -> RELEASING) holds the same devices

    def on_leader(self, az: str, kv: Any, now: float) -> bool:
        """``leader/<az>`` was written (``kv``) or deleted (None) at ``now``.
        Its epoch is the key's create revision: a re-put by the same leader
        keeps it, a new leadership brings a new one. True when an AZ gained
        a leader: its nodes may be placed on again (an AZ without one cannot
        vote)."""
        self._watched.add(az)
        was_led = az in self._epochs
        if kv is None:
            self._epochs.pop(az, None)
            self._leaderless_since[az] = now
        else:
            self._epochs[az] = kv.create_revision
            self._leaderless_since.pop(az, None)
        if was_led == (kv is not None):
            return False  # the set of led AZs is the same: so is the view
        self._touch_az(az)
        return kv is not None

    def on_leaders_polled(self, led: Iterable[str], now: float) -> None:
        """A read of ``leader/`` at ``now`` found ``led`` led: it moves the
        owner-loss clock only (the epochs follow the watch, whose events are
        in revision order; the poll's read is not)."""
        led = set(led)
        for az in led:
            self._watched.add(az)
            self._leaderless_since.pop(az, None)
        for az in self._watched - led:
            self._leaderless_since.setdefault(az, now)

    def watch_for_loss(self, az: str) -> None:
        """Clock ``az`` from the next poll that finds it leaderless (it owns
        a gang this leader recovered)."""
        self._watched.add(az)

    def on_compacted(self) -> None:
        """The watch was compacted: the events until the next ``reset`` are
        lost, so ``epoch`` answers None (peer calls are checked against etcd)
        until then. The view keeps the AZs last seen led."""
        self._epochs_current = False

    def reset(self, node_kvs: Iterable[Any], reservation_kvs: Iterable[Any], leader_kvs: Iterable[Any]) -> bool:
        """Replace everything by one read (recovery, or a compacted watch
        whose events in between are lost): every AZ's node records,
        reservations and leader keys (this AZ's nodes and reservations are
        skipped; every AZ's epoch is kept). The owner-loss clock is left as
        it was. Always True: anything may have changed."""
        self._nodes.clear()
        self._holds.clear()
        self._holds_on.clear()
        self._node_views.clear()
        self._stale.clear()
        for kv in node_kvs:
            self.on_node(kv.key, kv)
        for kv in reservation_kvs:
            self.on_reservation(kv.key, kv)
        prefix = self.keys.leaders()
        self._epochs = {kv.key[len(prefix):]: kv.create_revision for kv in leader_kvs}
        self._epochs_current = True
        self._stale.update(self._nodes)
        self._changed_topologies()
        return True

    def _changed_topologies(self) -> None:
        self.version += 1
        self._view = None

    def _touch(self, at: At) -> None:
        """Node ``at``'s NodeView must be computed again."""
        self._stale.add(at)
        self._view = None

    def _touch_az(self, az: str) -> None:
        """Every node of ``az``: its readiness follows its AZ's leader."""
        for at in self._nodes:
            if at[0] == az:
                self._touch(at)

    def _take(self, hold: At, old: Reservation | None, new: Reservation | None) -> None:
        """Hold ``hold`` (az, gang) went from ``old`` to ``new`` (None:
        absent): move what it takes on each node, touching those nodes."""
        az, gang = hold
        for node in old.nodes if old is not None else ():
            on = self._holds_on.get((az, node))
            if on is not None:
                on.pop(gang, None)
                if not on:
                    del self._holds_on[(az, node)]
            self._touch((az, node))
        for node, devices in (new.nodes.items() if new is not None else ()):
            self._holds_on.setdefault((az, node), {})[gang] = devices
            self._touch((az, node))

    # --------------------------------------------------------------- read
    @property
    def led(self) -> frozenset[str]:
        """AZs whose leader key exists (this AZ's included when it has one)."""
        return frozenset(self._epochs)

    def epoch(self, az: str) -> int | None:
        """The create revision of ``leader/<az>`` as last fed (any AZ, this
        one included); None when it has no leader here, or after a compacted
        watch until the next reset: the caller reads etcd then."""
        return self._epochs.get(az) if self._epochs_current else None

    def orphaned(self, now: float, after: float) -> set[str]:
        """Other AZs seen without a leader for longer than ``after``."""
        return {az for az, since in self._leaderless_since.items() if az != self.az and now - since > after}

    def node(self, az: str, node: str) -> NodeRecord | None:
        """Another AZ's node record as last seen (None if unknown)."""
        return self._nodes.get((az, node))

    def view(self) -> tuple[NodeView, ...]:
        """Other AZs' nodes for placement: every device minus every
        reservation there, of any state; ready only while the node's record
        says so and its AZ has a leader. Cached until what it is built from
        changes."""
        if self._view is None:
            self.view_rebuilds += 1
            for at in self._stale:
                rec = self._nodes.get(at)
                if rec is None:
                    continue  # a hold on a node with no record (yet): nothing to place on
                self.node_views_computed += 1
                taken = capacity.held((at[0], {at[1]: d}) for d in self._holds_on.get(at, {}).values())
                self._node_views[at] = capacity.free_view(
                    [(rec.topology, rec.ready and not rec.cordoned and at[0] in self._epochs)], taken)[0]
            self._stale.clear()
            self._view = tuple(self._node_views[at] for at in self._nodes)
        return self._view

    def registered(self) -> tuple[NodeTopology, ...]:
        """Every other AZ's registered node that can take work (ready or not;
        neither cordoned nor expired), for never-fits."""
        if self._registered_for != self.version:
            self.registered_rebuilds += 1
            self._registered = tuple(rec.topology for rec in self._nodes.values() if capacity.takes_work(rec))
            self._registered_for = self.version
        return self._registered

    def index(self) -> FabricIndex:
        """Placement's static facts of other AZs' nodes, refreshed (reusing
        unchanged entries) when their topologies change."""
        if self._index_for != self.version:
            self.index_refreshes += 1
            self._index = self._index.refreshed(self.registered())
            self._index_for = self.version
        return self._index

    def placement_index(self, local: FabricIndex) -> FabricIndex:
        """``local`` (this AZ's index) joined with ``index()``: the index for
        a cycle that places over every AZ. The same object until either
        side changes."""
        remote = self.index()
        if self._joined is None or self._joined[0] is not local or self._joined[1] is not remote:
            self._joined = (local, remote, local.joined(remote))
        return self._joined[2]
