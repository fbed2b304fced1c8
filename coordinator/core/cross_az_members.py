"""A cross-AZ gang's members in one participant AZ (pure; docs/design.md §19.8).

The participant core (twophase_participant.py) decides a hold's votes,
commit and release. What its members do once the hold is COMMITTED is
decided here, as functions of the gang's record, this AZ's member reports
and ``now`` (passed in): when the held incarnation is over, whether to
revoke its members, wait for them, give up on them at the fence deadline,
publish how they ended, and only then tell the core (``GangFinished``); which
members a lost node takes with it; which members an agent that registers
again must be sent. The two-phase driver performs what they return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from coordinator.core.lifecycle import incarnation_over, lost_member_reports
from coordinator.core.progress import MemberReport
from coordinator.core.records import GangRecord, MemberSummary
from phalanx.model import MemberPhase

GIVEN_UP = "no report before the fence deadline"


@dataclass(frozen=True)
class HoldOver:
    """What to do about this AZ's members of a held incarnation that is over.

    ``revoke``: send Revoke to the hold's nodes now (the first time);
    ``stopped``: members to record as STOPPED (past the fence deadline, their
    agents have stopped them); then, once none can be alive, either
    ``publish`` (the owner must see how they ended before the hold and its
    summary key go: publish now, finish on a later look) or ``finish`` (tell
    the participant core ``GangFinished``). Neither: wait for the members."""

    revoke: bool = False
    stopped: Mapping[int, MemberReport] = field(default_factory=dict)
    publish: bool = False
    finish: bool = False


def hold_over(g: GangRecord, *, az: str, incarnation: int, prepared: bool, told: bool, revoked_at: float | None,
              reports: Mapping[int, MemberReport], published: MemberSummary | None, now: float,
              replace_after_s: float) -> HoldOver | None:
    """This AZ holds incarnation ``incarnation`` of ``g`` (``prepared``: not
    committed yet). None while that incarnation goes on, or once the core
    was ``told`` it is over. A PREPARED hold dispatched nothing here, so the
    core is told at once (it decides the hold by its decision). A COMMITTED
    one's members are revoked, then waited for until ``replace_after_s``
    after the revoke: the agents fence by then, so a member that has not
    reported is stopped."""
    if not incarnation_over(g, incarnation) or told:
        return None
    if prepared:
        return HoldOver(finish=True)
    revoke = revoked_at is None
    since = now if revoked_at is None else revoked_at
    if g.incarnation == incarnation:
        local = [m.rank for m in g.placement if m.az == az]
    else:  # the record shows a later incarnation: its placement is not ours
        local = list(reports)
    live = [r for r in local if _may_run(reports, r)]
    if live and now - since < replace_after_s:
        return HoldOver(revoke=revoke)
    stopped: dict[int, MemberReport] = {}
    if live and g.incarnation == incarnation:
        node_of = {m.rank: m.node for m in g.placement}
        stopped = {r: MemberReport(MemberPhase.STOPPED, -1, GIVEN_UP, node_of.get(r, "")) for r in live}
    after = {**reports, **stopped}
    if after and published != MemberSummary.of(incarnation, az, after):
        return HoldOver(revoke=revoke, stopped=stopped, publish=True)
    return HoldOver(revoke=revoke, stopped=stopped, finish=True)


def lost_members(g: GangRecord, node: str, az: str, reports: Mapping[int, MemberReport],
                 reason: str) -> dict[int, MemberReport]:
    """The members of ``g`` on a lost node of this AZ that have not ended:
    reported STOPPED (the owner then fails or restarts the gang). The
    single-AZ rule (``lifecycle.lost_member_reports``), less the members
    whose end this AZ already published."""
    return {r: rep for _, lost in lost_member_reports([g], node, az, reason) for r, rep in lost.items()
            if _may_run(reports, r)}


def to_send_again(g: GangRecord, node: str, reported: Iterable[int],
                  reports: Mapping[int, MemberReport]) -> frozenset[int] | None:
    """An agent registered on ``node`` reporting ``reported`` members of a
    committed hold's incarnation: None if every member placed on it runs or
    has ended, else the ranks to skip when its members are sent again (the
    dispatch may have gone out while it was away)."""
    have = set(reported) | {r for r, rep in reports.items() if not rep.phase.live}
    mine = {m.rank for m in g.placement if m.node == node}
    return frozenset(have) if mine - have else None


def _may_run(reports: Mapping[int, MemberReport], rank: int) -> bool:
    """Not reported, or reported in a live phase: the member may still run."""
    rep = reports.get(rank)
    return rep is None or rep.phase.live
