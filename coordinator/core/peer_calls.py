"""Whether a peer's Prepare / Commit / Abort is taken, and the participant's
own NO votes (pure decisions; docs/two-phase.md "Peer calls").

The driver (coordinator/twophase/peer_calls.py) reads the request, the watched state
or one etcd read, and asks these functions; a refusal is returned, never
raised (``Refusal`` with a neutral ``Code``, answered over gRPC by
coordinator/refusals.py), so each decision is a table row in
tests/unit/test_peer_calls.py. The texts are the ones peers and tests see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping

from coordinator.core.peer_auth import Code, Refusal
from coordinator.core.records import GangRecord
from coordinator.core.twophase_model import NodeSlice, Outcome, normalize_slice
from phalanx.model import GangState
from phalanx.reservation import NodeDevices


@dataclass(frozen=True)
class PeerCaller:
    """Who a peer call says it comes from (``PeerIdentity``)."""

    az: str
    epoch: int
    coordinator_id: str = ""


def caller_refusal(caller: PeerCaller, leader_revision: int | None) -> Refusal | None:
    """The caller must be the current leader of its AZ: its epoch is the
    create revision of ``leader/<caller az>`` as read (None: no such key)."""
    if not caller.az or leader_revision is None or leader_revision != caller.epoch:
        return Refusal(Code.PERMISSION_DENIED,
                       f"caller {caller.coordinator_id or '?'} (AZ {caller.az or '?'}, epoch {caller.epoch}) "
                       "is not the current leader of its AZ")
    return None


def slice_matches(az: str, nodes: NodeSlice, g: GangRecord) -> bool:
    """The slice a Prepare names for ``az`` is the one ``g``'s plan records there."""
    mine: dict[str, tuple[list[int], list[str]]] = {}
    for m in g.placement:
        if m.az == az:
            gpus, nics = mine.setdefault(m.node, ([], []))
            gpus.extend(m.gpus)
            nics.extend(m.nics)
    return normalize_slice(nodes) == normalize_slice({n: (tuple(g_), tuple(c)) for n, (g_, c) in mine.items()})


def attempt_refusal(az: str, caller: PeerCaller, gang: str, incarnation: int, nodes: NodeSlice,
                    record: GangRecord | None) -> Refusal | None:
    """A Prepare names the attempt the gang's record holds (``record`` as
    read; None: no such gang): owned by the caller's AZ, ``RESERVING`` at
    this incarnation, with this AZ's slice of its plan."""
    if record is None:
        return Refusal(Code.FAILED_PRECONDITION, f"unknown gang {gang!r}")
    g = record
    if g.owner_az != caller.az:
        return Refusal(Code.PERMISSION_DENIED, f"gang {g.id} is owned by {g.owner_az}, not {caller.az}")
    if g.incarnation != incarnation or g.state != GangState.RESERVING:
        return Refusal(Code.FAILED_PRECONDITION,
                       f"stale or unknown incarnation {incarnation} of {g.id}: its record is at "
                       f"incarnation {g.incarnation} ({g.state.name})")
    if not slice_matches(az, nodes, g):
        return Refusal(Code.FAILED_PRECONDITION,
                       f"the slice for {az} does not match the recorded plan of {g.id}#{g.incarnation}")
    return None


def watched_attempt(az: str, caller: PeerCaller, incarnation: int, nodes: NodeSlice, watched_epoch: int | None,
                    record: GangRecord | None) -> bool:
    """Whether the watch already shows what the etcd read would accept, so
    the Prepare needs no read: the caller's epoch is the watched epoch of its
    AZ and the watched record passes every check of ``attempt_refusal``.
    Anything else (a watch behind, a refusal) takes the read, which gives
    every refusal its code and text (docs/two-phase.md "Peer calls")."""
    if record is None or not caller.az or watched_epoch != caller.epoch:
        return False
    return attempt_refusal(az, caller, record.id, incarnation, nodes, record) is None


def decision_known(caller: PeerCaller, watched_epoch: int | None, known: Outcome | None, want: Outcome) -> bool:
    """Whether a Commit/Abort needs no read: the participant already knows
    this outcome from a durable source and the caller's epoch is the watched
    one (what the read would say; acting on a durable decision is safe
    whoever asks)."""
    return bool(caller.az) and watched_epoch == caller.epoch and known is want


def decision_refusal(gang: str, incarnation: int, want: Outcome, have: Outcome | None) -> Refusal | None:
    """A Commit/Abort must match the recorded decision (``have``; None: no
    decision key)."""
    if have is None:
        return Refusal(Code.FAILED_PRECONDITION, f"no decision recorded for {gang}#{incarnation}; refusing {want.value}")
    if have is not want:
        return Refusal(Code.FAILED_PRECONDITION, f"decision of {gang}#{incarnation} is {have.value}, not {want.value}")
    return None


def not_prepared_refusal(az: str, gang: str, incarnation: int, held: int | None) -> Refusal | None:
    """A Commit/Abort for an attempt this AZ holds no hold of (``held``: the
    incarnation held here, None if none) is refused; the driver still
    learns the decision, which is durable."""
    if held == incarnation:
        return None
    return Refusal(Code.FAILED_PRECONDITION, f"{gang}#{incarnation} was never prepared in {az} (NOT_PREPARED)")


def single_az_conflict(held: Mapping[str, Mapping[str, NodeDevices]], nodes: NodeSlice) -> str:
    """The single-AZ gang holding a device of the slice (``held``: the AZ's
    DeviceLedger, node -> gang -> devices), "" if none."""
    for node, (gpus, nics) in nodes.items():
        for gang, dev in held.get(node, {}).items():
            if set(gpus) & set(dev.gpus) or set(nics) & set(dev.nics):
                return gang
    return ""


def prepare_no_vote(az: str, nodes: NodeSlice, held: Mapping[str, Mapping[str, NodeDevices]], prepared: bool,
                    serving: Collection[str]) -> str | None:
    """The participant's NO, decided before the Prepare reaches its core, or
    None: a device of the slice is held by a single-AZ gang (never preempted:
    what the core answers for a ``local`` COMMITTED hold), or, unless this
    attempt is already held here (``prepared``), a node of the slice is not
    ``serving`` (ready with its agent connected here: the owner's view of
    this AZ is stale)."""
    other = single_az_conflict(held, nodes)
    if other:
        return f"devices committed to single-AZ gang {other} in {az}"
    if not prepared:
        down = sorted(n for n in nodes if n not in serving)
        if down:
            return f"node(s) {', '.join(down)} not ready in {az}"
    return None
