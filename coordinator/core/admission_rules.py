"""The admission rules, one named function each (pure; docs/admission.md "Rules").

A rule takes one waiting gang (a ``Candidate``: the gang with its placement
request and its place in the queue), the cycle's ``AdmissionView`` and
``now``, and returns a decision or None ("not mine: ask the next rule").
``decide`` applies ``RULES`` in order; the first decision wins. The last rule
(``no_room``) decides every gang that does not fit, and ``place_now``
before it every gang that does, so every gang gets exactly one decision.
``coordinator.core.admission.plan_admissions`` runs ``decide`` over the queue
and ``AdmissionView.record``s each decision before the next gang, so devices
reserved and nodes kept earlier in the cycle are seen by the gangs after.

A new policy (queues, quotas, preemption) is a new rule in ``RULES`` at its
place in the order, not a branch in a loop (docs/admission.md says where
each would go).

Rules read the view and do not change it; the view's memos (the never-fits
verdict per request shape, the unplaceable answer per shape within one
cycle) only save recomputing an answer that cannot change.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, MutableMapping, Sequence

from coordinator.core.placement import (
    FabricIndex, NodeView, Placement, PlacementRequest, Shortfall, Unplaceable, drained, never_fits, place,
)
from coordinator.core.records import GangRecord
from phalanx.topology import NodeTopology

NodeKey = tuple[str, str]  # (az, node): node names are unique only within an AZ


@dataclass(frozen=True)
class Reserve:
    gang: GangRecord
    placement: Placement
    reason: str


@dataclass(frozen=True)
class KeepPending:
    gang: GangRecord
    reason: str
    shortfalls: tuple[Shortfall, ...] = ()
    # Where the gang stands and who holds it: for `explain`.
    position: int = 0  # 1-based place in this AZ's queue
    queue: int = 0  # gangs in the queue
    held_by: str = ""  # the older gang whose kept nodes this gang would need
    keeps: tuple[str, ...] = ()  # nodes kept for this gang (it is the head past its backfill window)
    rule: str = ""  # the rule that keeps it waiting, when it is more than "no room now" (also in reason)
    # The (az, node) keys behind ``keeps``: what the rest of the cycle may not use.
    kept_nodes: frozenset[NodeKey] = field(default=frozenset(), compare=False, repr=False)


@dataclass(frozen=True)
class FailAdmission:
    gang: GangRecord
    reason: str
    never_fits: bool = False


Decision = Reserve | KeepPending | FailAdmission

PlaceFn = Callable[..., Placement | Unplaceable]


@dataclass(frozen=True)
class Candidate:
    """One waiting gang as the rules see it."""

    gang: GangRecord
    request: PlacementRequest  # in its scope: this AZ, or every AZ
    shape: tuple  # what placement depends on besides the name (memo key)
    wide: bool  # placed over every AZ (coordinator.core.admission.spans_azs)
    position: int  # 1-based place in the queue
    queue: int  # gangs in the queue

    def where(self) -> dict[str, int]:
        return dict(position=self.position, queue=self.queue)


def shown_node(key: NodeKey, az: str) -> str:
    """A kept node as explain names it: this AZ's by name, another's with its AZ."""
    return key[1] if key[0] == az else f"{key[0]}/{key[1]}"


@dataclass
class AdmissionView:
    """What one cycle's rules see: the free devices left by the gangs
    decided before, the nodes kept for the backfill head, the inputs of the
    never-fits rule, and the cycle's memos. Changed only by ``record``."""

    az: str
    free: dict[NodeKey, NodeView]
    backfill_window_s: float
    registered: Sequence[NodeTopology] | None  # None: never-fits is not judged
    verdicts: MutableMapping[tuple, str]  # never-fits verdict by request shape (the caller may keep it)
    place_fn: PlaceFn = place
    index: FabricIndex | None = None
    head: GangRecord | None = None  # the gang nodes are kept for
    kept: frozenset[NodeKey] = frozenset()
    # Within one cycle free capacity only shrinks (and kept nodes only make
    # the view smaller), so a request shape that did not fit will not fit
    # later in the same cycle: remember the answer (a queue of equal gangs
    # then costs one placement, not one each).
    unplaceable: dict[tuple, Unplaceable] = field(default_factory=dict)

    def placed(self, request: PlacementRequest, views: list[NodeView]) -> Placement | Unplaceable:
        return self.place_fn(request, views, self.index) if self.index is not None else self.place_fn(request, views)

    def scope(self, c: Candidate, unkept: bool = False) -> list[NodeView]:
        """The free nodes ``c`` may be placed on (this AZ's, or every AZ's),
        less the kept nodes unless ``unkept``."""
        az, kept, wide = self.az, self.kept, c.wide  # locals: this runs per node, per gang, per cycle
        return [v for k, v in self.free.items() if (wide or k[0] == az) and (unkept or k not in kept)]

    def try_place(self, c: Candidate) -> Placement | Unplaceable:
        """``c`` placed on its scope now (an unplaceable answer is memoised by shape)."""
        result = self.unplaceable.get(c.shape)
        if result is None:
            result = self.placed(c.request, self.scope(c))
            if isinstance(result, Unplaceable):
                self.unplaceable[c.shape] = result
        return result

    def never_fits(self, c: Candidate) -> str:
        """The never-fits verdict of ``c`` ("" when it may fit some day)."""
        assert self.registered is not None
        verdict = self.verdicts.get(c.shape)
        if verdict is None:
            verdict = self.verdicts[c.shape] = never_fits(c.request, self.registered, self.index)
        return verdict

    def record(self, decision: Decision) -> None:
        """What a decision leaves for the gangs after it: a reservation's
        devices are no longer free; a backfill head's nodes are kept."""
        if isinstance(decision, Reserve):
            for m in decision.placement.members:
                key = (m.az, m.node)
                v = self.free[key]
                self.free[key] = replace(v, free_gpus=v.free_gpus - set(m.gpus), free_nics=v.free_nics - set(m.nics))
        elif isinstance(decision, KeepPending) and decision.kept_nodes:
            self.head, self.kept = decision.gang, decision.kept_nodes


Rule = Callable[[Candidate, AdmissionView, float], "Decision | None"]


def admission_timeout(c: Candidate, view: AdmissionView, now: float) -> Decision | None:
    """1. Waited past ``policy.admission_timeout_s``: FAILED."""
    timeout = c.gang.spec.policy.admission_timeout_s
    if now - c.gang.submitted_at > timeout:
        return FailAdmission(c.gang, f"not admitted within admission_timeout_s={timeout:g}s")
    return None


def never_fitting(c: Candidate, view: AdmissionView, now: float) -> Decision | None:
    """2. Cannot be placed even on every registered node, empty: FAILED at
    once with the limit it breaks (judged only when the caller passes the
    registered nodes)."""
    if view.registered is None:
        return None
    verdict = view.never_fits(c)
    return FailAdmission(c.gang, verdict, never_fits=True) if verdict else None


def restart_backoff(c: Candidate, view: AdmissionView, now: float) -> Decision | None:
    """3. A restarted gang waits out its backoff (holding nobody back)."""
    if c.gang.not_before > now:
        why = f"restart backoff: not re-placed for {c.gang.not_before - now:.1f}s"
        return KeepPending(c.gang, why, rule=why, **c.where())
    return None


def place_now(c: Candidate, view: AdmissionView, now: float) -> Decision | None:
    """4. Placed on the free devices of its scope, except kept nodes: reserved."""
    result = view.try_place(c)
    return Reserve(c.gang, result, result.reason) if isinstance(result, Placement) else None


def held_back_by_backfill(c: Candidate, view: AdmissionView, now: float) -> Decision | None:
    """5a. It would fit but for the nodes kept for an older gang: it waits."""
    if view.head is None:
        return None
    result = view.try_place(c)
    if isinstance(result, Placement) or not isinstance(view.placed(c.request, view.scope(c, unkept=True)), Placement):
        return None
    shown = ", ".join(sorted(shown_node(k, view.az) for k in view.kept))
    why = (f"held back by the backfill rule: the only room for it is on nodes kept for older gang {view.head.id} "
           f"({shown}), which has waited past backfill_window_s={view.backfill_window_s:g}s")
    return KeepPending(c.gang, why, result.shortfalls, held_by=view.head.id, rule=why, **c.where())


def backfill_head(c: Candidate, view: AdmissionView, now: float) -> Decision | None:
    """5b. The first gang past ``backfill_window_s`` that does not fit keeps
    the nodes it would take on this AZ's placeable nodes emptied; one that
    would not fit even then keeps nothing (holding others back would not
    make it fit)."""
    waited = now - c.gang.submitted_at
    if view.head is not None or waited <= view.backfill_window_s:
        return None
    result = view.try_place(c)
    if isinstance(result, Placement):
        return None
    # Only this AZ's nodes can drain for it: this leader holds back its own
    # gangs alone, and other AZs' leaders keep filling theirs. So a cross-AZ
    # head sees other AZs as they are now, and keeps nodes only where that
    # makes it fit as they drain here.
    views = view.scope(c, unkept=True)
    empty = view.placed(c.request, drained([v for v in views if v.az == view.az]) + [v for v in views if v.az != view.az])
    if isinstance(empty, Placement):
        kept = frozenset((m.az, m.node) for m in empty.members)
        shown = sorted(shown_node(k, view.az) for k in kept)
        why = (f"waited {waited:.0f}s, past backfill_window_s={view.backfill_window_s:g}s: nodes "
               f"{', '.join(shown)} are kept for it until it fits (gangs behind it may use the others)")
        return KeepPending(c.gang, f"{result.reason}; {why}", result.shortfalls, keeps=tuple(shown), rule=why,
                           kept_nodes=kept, **c.where())
    where = ("this AZ's ready nodes were empty and other AZs' stayed as they are" if c.wide
             else "this AZ's ready nodes were empty")
    why = f"it would not fit even if {where}, so it keeps no nodes and holds back no gang behind it"
    return KeepPending(c.gang, f"{result.reason}; {why}", result.shortfalls, rule=why, **c.where())


def no_room(c: Candidate, view: AdmissionView, now: float) -> Decision | None:
    """Last: no room now; it waits (with its shortfall, for explain). After
    ``place_now`` every gang that reaches it gets this decision."""
    result = view.try_place(c)
    return None if isinstance(result, Placement) else KeepPending(c.gang, result.reason, result.shortfalls, **c.where())


# The order is the policy: docs/admission.md "Rules".
RULES: tuple[Rule, ...] = (
    admission_timeout, never_fitting, restart_backoff, place_now, held_back_by_backfill, backfill_head, no_room,
)


def decide(c: Candidate, view: AdmissionView, now: float, rules: Sequence[Rule] = RULES) -> Decision:
    """The first decision a rule of ``rules`` returns for ``c``."""
    for rule in rules:
        decision = rule(c, view, now)
        if decision is not None:
            return decision
    raise ValueError(f"no admission rule decided gang {c.gang.id} (the last rule must always decide)")
