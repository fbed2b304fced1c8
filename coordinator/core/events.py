"""A gang's event history: what happened to it and why, in reading order.

Stored in the gang record itself (``GangRecord.events``), so every event
rides on a write the leader makes anyway (docs/events.md says where one does
not), survives a failover with the record and goes with it at retention.
Bounded by count and by bytes (``phalanx.limits``): the oldest events are
dropped first and one ``dropped`` marker at the head says how many. Pure: no
I/O; the leader passes the time and its epoch in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from phalanx import limits
from phalanx.model import EventKind, MemberPhase

# A stimulus id is short ("az-a-17", "watch:1234", "submit:<gang>:<inc>");
# the bound keeps a long gang name from growing every event of the list.
MAX_STIMULUS_CHARS = 200


@dataclass(frozen=True)
class GangEvent:
    kind: str  # an EventKind value (kept a string: a newer kind still reads)
    at: float  # wall clock (unix seconds) of the leader that recorded it
    epoch: int  # that leader's epoch (fencing token)
    message: str
    incarnation: int = 0
    by: str = ""  # who asked for it (submitted, cancelled): "<role>/<name>", "" without TLS
    rank: int | None = None  # member_exited
    exit_code: int | None = None  # member_exited
    dropped: int = 0  # the dropped marker: how many events it stands for
    seq: int = 0  # 1, 2, ... per gang, never reused: readers resume after the last one seen
    # The id of the decision that wrote it (phalanx/logfmt.py stimulus ids):
    # the coordinator's log lines for that decision carry the same id, so
    # `phalanx describe` and a chaos history lead back to them. "" for an
    # event written before the field existed.
    stimulus: str = ""

    def to_dict(self) -> dict[str, Any]:
        # Defaults are left out: the list has a byte bound.
        d: dict[str, Any] = {"kind": self.kind, "at": round(self.at, 3), "epoch": self.epoch,
                             "message": limits.clip(self.message, limits.MAX_EVENT_MESSAGE_CHARS), "seq": self.seq}
        if self.incarnation:
            d["incarnation"] = self.incarnation
        if self.by:
            d["by"] = self.by
        if self.rank is not None:
            d["rank"] = self.rank
        if self.exit_code is not None:
            d["exit_code"] = self.exit_code
        if self.dropped:
            d["dropped"] = self.dropped
        if self.stimulus:
            d["stimulus"] = self.stimulus
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GangEvent":
        return cls(
            kind=str(d["kind"]), at=float(d["at"]), epoch=int(d["epoch"]), message=str(d["message"]),
            incarnation=int(d.get("incarnation", 0)), by=str(d.get("by", "")),
            rank=int(d["rank"]) if d.get("rank") is not None else None,
            exit_code=int(d["exit_code"]) if d.get("exit_code") is not None else None,
            dropped=int(d.get("dropped", 0)), seq=int(d.get("seq", 0)), stimulus=str(d.get("stimulus", "")),
        )

    def stamped(self, stimulus: str) -> "GangEvent":
        """This event, carrying STIMULUS unless it names one already (an
        event made under one decision and written by a later one keeps the
        decision that made it)."""
        if self.stimulus or not stimulus:
            return self
        return dataclasses.replace(self, stimulus=stimulus[:MAX_STIMULUS_CHARS])


def to_json(events: Iterable[GangEvent]) -> list[dict[str, Any]]:
    return [e.to_dict() for e in events]


def from_json(items: Any) -> tuple[GangEvent, ...]:
    """A stored list back; a record without one (written before events
    existed) has none. Anything but a list is unreadable (TypeError), like
    any other malformed field (coordinator/core/records.py UNREADABLE)."""
    if items is None:
        return ()
    if not isinstance(items, list):
        raise TypeError(f"events: must be a list, got {type(items).__name__}")
    return tuple(GangEvent.from_dict(e) for e in items)


def list_bytes(events: Sequence[GangEvent]) -> int:
    """JSON bytes the list takes in the stored record."""
    return limits.json_bytes(to_json(events))


def append(events: Sequence[GangEvent], new: Iterable[GangEvent], *,
           max_count: int = limits.MAX_GANG_EVENTS, max_bytes: int = limits.MAX_GANG_EVENTS_BYTES) -> tuple[GangEvent, ...]:
    """``events`` followed by ``new`` (numbered on from the last ``seq``),
    within ``max_count`` events and ``max_bytes`` JSON bytes, the marker
    included: the oldest are dropped first, and one ``dropped`` marker at the
    head (at the time and epoch of the newest dropped event) counts every
    event dropped so far."""
    kept = list(events)
    marker = kept.pop(0) if kept and kept[0].kind == EventKind.DROPPED.value else None
    seq = max([e.seq for e in kept] + [marker.seq if marker else 0])
    for e in new:
        seq += 1
        kept.append(GangEvent(e.kind, e.at, e.epoch, limits.clip(e.message, limits.MAX_EVENT_MESSAGE_CHARS),
                              e.incarnation, e.by, e.rank, e.exit_code, 0, seq, e.stimulus))
    sizes = [limits.json_bytes(e.to_dict()) + 1 for e in kept]  # + its comma
    dropped = marker.dropped if marker else 0

    def over() -> bool:
        head = 0 if marker is None else limits.json_bytes(marker.to_dict()) + 1
        return len(kept) + (marker is not None) > max_count or 2 + head + sum(sizes) > max_bytes

    while kept and over():
        gone = kept.pop(0)
        sizes.pop(0)
        dropped += 1
        marker = GangEvent(EventKind.DROPPED.value, gone.at, gone.epoch, f"{dropped} earlier events dropped",
                           dropped=dropped, seq=gone.seq)  # no stimulus: it stands for many
    return tuple(([marker] if marker else []) + kept)


def last_epoch(events: Sequence[GangEvent]) -> int:
    """The epoch of the leader that recorded the newest event (0: none)."""
    return events[-1].epoch if events else 0


# --- the events a leader records, one constructor each ---------------------------
# Messages are whole sentences a person reads in `phalanx describe`.


def submitted(at: float, epoch: int, by: str, queue: str, priority: int) -> GangEvent:
    who = by or "an unauthenticated caller (no TLS)"
    return GangEvent(EventKind.SUBMITTED.value, at, epoch, f"submitted by {who} to queue {queue} at priority {priority}",
                     incarnation=1, by=by)


def placement_summary(placement: Iterable[Any], shown: int = 4) -> str:
    """"8 GPUs on 2 nodes in az-a (n1, n2)": AZs and nodes, the nodes cut
    after ``shown`` (a placement may name thousands)."""
    members = list(placement)
    gpus = sum(len(m.gpus) for m in members)
    nodes = sorted({m.node for m in members})
    azs = sorted({m.az for m in members})
    names = ", ".join(nodes[:shown]) + (f" and {len(nodes) - shown} more" if len(nodes) > shown else "")
    return (f"{len(members)} members, {gpus} GPUs on {len(nodes)} node{'s' * (len(nodes) != 1)} "
            f"in {', '.join(azs)} ({names})")


def placed(at: float, epoch: int, incarnation: int, placement: Iterable[Any], why: str) -> GangEvent:
    """Where (AZs and nodes) and why (the placement's explanation, one line)."""
    line = " ".join(why.split())
    return GangEvent(EventKind.PLACED.value, at, epoch, f"placed: {placement_summary(placement)}"
                     + (f"; {line}" if line else ""), incarnation=incarnation)


def reserved(at: float, epoch: int, incarnation: int, how: str) -> GangEvent:
    return GangEvent(EventKind.RESERVED.value, at, epoch, f"devices reserved: {how}", incarnation=incarnation)


def started(at: float, epoch: int, incarnation: int, members: int) -> GangEvent:
    return GangEvent(EventKind.STARTED.value, at, epoch, f"all {members} members running", incarnation=incarnation)


_EXITED = (MemberPhase.FAILED, MemberPhase.REJECTED, MemberPhase.STOPPED)


def member_exits(at: float, epoch: int, incarnation: int, reports: Mapping[int, Any], shown: int = 3) -> list[GangEvent]:
    """One ``member_exited`` per member that failed, was rejected or stopped
    (``reports``: rank -> progress.MemberReport), the first ``shown`` ranks;
    one more event counts the rest. Members that exited 0 are not listed:
    the ``finished`` event says all did."""
    out = []
    bad = [(rank, r) for rank, r in sorted(reports.items()) if r.phase in _EXITED]
    for rank, r in bad[:shown]:
        what = {MemberPhase.FAILED: f"exited with code {r.exit_code}", MemberPhase.REJECTED: "was rejected by its agent",
                MemberPhase.STOPPED: "was stopped"}[r.phase]
        out.append(GangEvent(EventKind.MEMBER_EXITED.value, at, epoch,
                             f"rank {rank} on {r.node or 'an unknown node'} {what}" + (f": {r.reason}" if r.reason else ""),
                             incarnation=incarnation, rank=rank, exit_code=r.exit_code if r.phase == MemberPhase.FAILED else None))
    if len(bad) > shown:
        out.append(GangEvent(EventKind.MEMBER_EXITED.value, at, epoch, f"and {len(bad) - shown} more members exited",
                             incarnation=incarnation))
    return out


def restarting(at: float, epoch: int, incarnation: int, restart: int, max_restarts: int, why: str) -> GangEvent:
    return GangEvent(EventKind.RESTARTING.value, at, epoch,
                     f"restarting: incarnation {incarnation} -> {incarnation + 1} (restart {restart} of {max_restarts}) "
                     f"after: {why}", incarnation=incarnation)


def fenced(at: float, epoch: int, az: str, previous_epoch: int, incarnation: int) -> GangEvent:
    return GangEvent(EventKind.FENCED.value, at, epoch,
                     f"leader epoch {epoch} of {az} took over from epoch {previous_epoch}: writes of epoch "
                     f"{previous_epoch} are refused from now on", incarnation=incarnation)


def adopted(at: float, epoch: int, incarnation: int, why: str) -> GangEvent:
    return GangEvent(EventKind.ADOPTED.value, at, epoch, why, incarnation=incarnation)


def cancelled(at: float, epoch: int, incarnation: int, by: str, reason: str) -> GangEvent:
    who = by or "an unauthenticated caller (no TLS)"
    return GangEvent(EventKind.CANCELLED.value, at, epoch, f"cancelled by {who}: {reason}", incarnation=incarnation, by=by)


def finished(at: float, epoch: int, incarnation: int, outcome: str, why: str) -> GangEvent:
    return GangEvent(EventKind.FINISHED.value, at, epoch, f"finished {outcome}: {why}", incarnation=incarnation)
