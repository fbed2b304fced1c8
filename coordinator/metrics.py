"""A coordinator's metrics (docs/metrics.md "Coordinator").

One ``CoordinatorMetrics`` per coordinator process, on its own registry
(phalanx.metrics.new_registry), handed to the components that decide
things: the store (etcd requests, fenced writes refused), the lease session
(keepalive lag), the AZ leader (submissions, admissions, finishes, restarts,
admission cycles, and the gauges of its view), the two-phase driver
(outcomes). Counters count where the decision was made, on the leader that
made it: a counter is per process, so after a failover the successor's
counters start from what it decides itself and the deposed one's stop
moving; sum over the replicas of an AZ for the AZ's totals (Prometheus'
``increase``/``rate`` handle a restarted process's reset).

Labels are bounded: a queue name (an operator's configuration), an outcome
or state from a fixed set, an etcd request kind, a fixed reason class. No
gang ids and no node names.

The gauges of the leader's view (pending gangs by reason class,
reservations and holds by state, agents, nodes, GPUs) are set by the leader
at the end of each admission cycle from its own event loop (never read
across threads), and zeroed when this process stops leading.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from coordinator.core.capacity import NODE_STATES
from phalanx.metrics import new_registry
from phalanx.reservation import HoldState

# Buckets (seconds). Admission and etcd: milliseconds to a few seconds;
# time to a full gang includes process start on the agents: up to minutes.
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
GANG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)

# Why a PENDING gang waits: one of these classes (``pending_class``).
PENDING_CLASSES = ("backoff", "held_back", "keeps_nodes", "too_large", "no_room", "two_phase")
OUTCOMES = ("SUCCEEDED", "FAILED", "CANCELLED")
ETCD_KINDS = ("get", "txn", "lease", "watch")
COMPACTION_RESULTS = ("compacted", "already", "refused")
TWOPHASE_OUTCOMES = ("commit", "abort", "in_doubt_abort")
# The states each gauge always shows (0 when none): a single-AZ reservation
# is COMMITTED or RELEASING; a cross-AZ hold PREPARED or COMMITTED.
RESERVATION_STATES = (HoldState.COMMITTED, HoldState.RELEASING)
HOLD_STATES = (HoldState.PREPARED, HoldState.COMMITTED)


def pending_class(decision: Any, now: float) -> str:
    """The reason class of an admission KeepPending decision (pure): in
    restart backoff; held back by the backfill rule (room only on nodes kept
    for an older gang); the head of the queue keeping nodes for itself;
    too large for this AZ's ready nodes even empty; or simply no room now."""
    if decision.gang.not_before > now:
        return "backoff"
    if decision.held_by:
        return "held_back"
    if decision.keeps:
        return "keeps_nodes"
    if decision.rule:
        return "too_large"
    return "no_room"


def twophase_outcome(outcome: str, reason: str) -> str:
    """The label of a won two-phase decision (pure): ``commit``, ``abort``
    or ``in_doubt_abort`` (a participant's abort after its prepared hold saw
    no decision within prepare_timeout_s)."""
    if outcome == "COMMIT":
        return "commit"
    return "in_doubt_abort" if reason.startswith("in doubt") else "abort"


Step = tuple[int, str, int]  # (incarnation, state name, restarts) of a gang record
LIVE_RESERVED = ("RESERVED", "STARTING", "RUNNING")
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def step_of(rec: Any) -> Step:
    return (rec.incarnation, rec.state.name, rec.restarts)


def lifecycle_steps(before: Step | None, after: Step) -> list[str]:
    """What a gang record going from ``before`` to ``after`` (as this leader
    saw them: the record it had, the one it wrote or found in etcd) counts
    (pure): "admitted" (its incarnation got its devices), "running",
    "restarted" (once per restart decided), "finished". Judged from the two
    records, not from which write succeeded, so a write whose reply was lost
    (it applied, the leader learnt so from a later read) counts once too."""
    if before == after:
        return []
    b_inc, b_state, b_restarts = before if before is not None else (after[0], "PENDING", after[2])
    a_inc, a_state, a_restarts = after
    out: list[str] = []
    fresh = a_inc > b_inc  # a new incarnation: it starts from PENDING again
    if a_state in LIVE_RESERVED and (fresh or b_state in ("PENDING", "RESERVING")):
        out.append("admitted")
    if a_state == "RUNNING" and (fresh or b_state != "RUNNING"):
        out.append("running")
    decided = (a_restarts + (a_state == "RESTARTING")) - (b_restarts + (b_state == "RESTARTING"))
    out += ["restarted"] * max(0, decided)
    if a_state in TERMINAL and b_state not in TERMINAL:
        out.append("finished")
    return out


WATCH_CAPS = ("per_identity", "total")
WATCH_DROPS = ("slow", "unavailable")


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, *, az: str = "") -> None:
        r = self.registry = registry if registry is not None else new_registry()
        self.az = az
        self.gangs_submitted = Counter("phalanx_gangs_submitted_total", "Gangs created by a submission at this leader",
                                       ["queue"], registry=r)
        self.gangs_admitted = Counter("phalanx_gangs_admitted_total", "Gang incarnations reserved (admitted) by this "
                                      "leader: one per incarnation, so a restart is admitted again", ["queue"], registry=r)
        self.gangs_finished = Counter("phalanx_gangs_finished_total", "Gangs this leader moved to a terminal state",
                                      ["queue", "outcome"], registry=r)
        self.gangs_collected = Counter("phalanx_gangs_collected_total", "Finished gangs this leader deleted from etcd "
                                       "after gang_retention_s (with their keys)", registry=r)
        self.gang_restarts = Counter("phalanx_gang_restarts_total", "Whole-gang restarts decided by this leader "
                                     "(a failed incarnation torn down to run again)", ["queue"], registry=r)
        self.time_to_reserved = Histogram("phalanx_gang_time_to_reserved_seconds", "Submission to RESERVED of a "
                                          "gang's first incarnation", ["queue"], buckets=GANG_BUCKETS, registry=r)
        self.time_to_full_gang = Histogram("phalanx_gang_time_to_full_gang_seconds", "Submission to every member "
                                           "RUNNING (the gang RUNNING) of a gang's first incarnation", ["queue"],
                                           buckets=GANG_BUCKETS, registry=r)
        self.admission_cycle = Histogram("phalanx_admission_cycle_seconds", "One admission cycle of the leader "
                                         "(liveness, start barrier, planning, reservations started)",
                                         buckets=FAST_BUCKETS, registry=r)
        self.placement_decision = Histogram("phalanx_placement_decision_seconds", "Planning the admission of the "
                                            "pending gangs of one cycle (plan_admissions)", buckets=FAST_BUCKETS,
                                            registry=r)
        self.gangs_pending = Gauge("phalanx_gangs_pending", "PENDING gangs owned by this leader, by reason class",
                                   ["reason"], registry=r)
        self.reservations = Gauge("phalanx_reservations", "This AZ's reservations held by this leader, by status",
                                  ["state"], registry=r)
        self.twophase_holds = Gauge("phalanx_twophase_holds", "Cross-AZ holds in this AZ, by state", ["state"], registry=r)
        self.twophase_outcomes = Counter("phalanx_twophase_outcomes_total", "Two-phase decisions this leader created "
                                         "(won the decision key)", ["outcome"], registry=r)
        self.etcd_seconds = Histogram("phalanx_etcd_request_seconds", "etcd requests, by kind (watch: not timed)",
                                      ["kind"], buckets=FAST_BUCKETS, registry=r)
        self.etcd_failures = Counter("phalanx_etcd_request_failures_total", "etcd requests that failed (unavailable, "
                                     "timed out, denied), by kind", ["kind"], registry=r)
        self.fenced_refused = Counter("phalanx_fenced_writes_refused_total", "Leader writes etcd refused because the "
                                      "leader key no longer has this leader's epoch", registry=r)
        self.leader_epoch = Gauge("phalanx_leader_epoch", "The epoch this process leads its AZ with (0: not leading)",
                                  ["az"], registry=r)
        self.is_leader = Gauge("phalanx_is_leader", "1 while this process leads its AZ", ["az"], registry=r)
        self.leadership_changes = Counter("phalanx_leadership_changes_total", "Times this process became its AZ's "
                                          "leader", ["az"], registry=r)
        self.keepalive_lag = Histogram("phalanx_lease_keepalive_lag_seconds", "A lease keepalive's send to its "
                                       "acknowledgement", buckets=FAST_BUCKETS, registry=r)
        self.keepalive_failures = Counter("phalanx_lease_keepalive_failures_total", "Lease keepalives not "
                                          "acknowledged", registry=r)
        self.agents_connected = Gauge("phalanx_agents_connected", "Agents with a session at this leader", ["az"], registry=r)
        self.nodes_ready = Gauge("phalanx_nodes_ready", "Nodes this leader can place on", ["az"], registry=r)
        self.gpus = Gauge("phalanx_gpus", "GPUs of the ready nodes, free or used", ["az", "state"], registry=r)
        self.nodes = Gauge("phalanx_nodes", "This AZ's node records by state: ready, not_ready, cordoned, expired "
                           "(docs/nodes.md)", ["az", "state"], registry=r)
        # etcd's space (coordinator/etcd_space.py), read by every coordinator,
        # leader or not: the alarm stops admission in every AZ at once.
        self.etcd_db_size = Gauge("phalanx_etcd_db_size_bytes", "Size of the database file of the etcd member this "
                                  "coordinator reads (Maintenance Status dbSize)", registry=r)
        self.etcd_db_in_use = Gauge("phalanx_etcd_db_size_in_use_bytes", "The part of that file in use (dbSizeInUse; "
                                    "the rest is freed by a defragmentation)", registry=r)
        self.etcd_quota = Gauge("phalanx_etcd_db_quota_bytes", "etcd's --quota-backend-bytes as configured on this "
                                "coordinator (--etcd-quota-bytes; etcd does not report it)", registry=r)
        self.etcd_space_alarm = Gauge("phalanx_etcd_space_alarm", "1 while etcd's NOSPACE alarm is active (etcd "
                                      "refuses every write)", registry=r)
        self.etcd_compactions = Counter("phalanx_etcd_compactions_total", "Compactions of etcd's history by this "
                                        "coordinator as its AZ's leader (--etcd-compact-retention; docs/etcd-keys.md "
                                        "\"Compaction\"): compacted, already (etcd was past the target), refused "
                                        "(this etcd user may not compact)", ["result"], registry=r)
        for result in COMPACTION_RESULTS:
            self.etcd_compactions.labels(result)
        # Rate limits per identity (coordinator/throttle.py, docs/limits.md
        # "Rate limits"): every coordinator applies them to what it receives.
        self.throttled = Counter("phalanx_requests_throttled_total", "Requests refused RESOURCE_EXHAUSTED by a rate "
                                 "limit per identity: submit (--submit-rate), register (--register-rate), token_read "
                                 "(--token-read-rate)", ["kind"], registry=r)
        for kind in ("submit", "register", "token_read"):
            self.throttled.labels(kind)
        # Watch streams (coordinator/broadcast.py, docs/events.md "Bounds and
        # resume"): every coordinator, leader or not, serves them.
        self.watch_open = Gauge("phalanx_watch_streams", "WatchEvents and WatchGang streams open at this coordinator "
                                "(capped by --watch-streams-total)", registry=r)
        self.watch_top = Gauge("phalanx_watch_streams_top_identity", "The most streams one identity holds open here "
                               "(capped by --watch-streams-per-identity)", registry=r)
        self.watch_refusals = Counter("phalanx_watch_streams_refused_total", "Streams refused RESOURCE_EXHAUSTED at "
                                      "open, by the cap they would pass", ["cap"], registry=r)
        self.watch_drops = Counter("phalanx_watch_streams_dropped_total", "Open streams ended by the coordinator: "
                                   "slow (its reader fell a buffer bound behind), unavailable (etcd)", ["reason"],
                                   registry=r)
        # Every fixed label value exists from the start (a rate over a series
        # that appears late misses its first increments).
        for c in WATCH_CAPS:
            self.watch_refusals.labels(c)
        for c in WATCH_DROPS:
            self.watch_drops.labels(c)
        for c in PENDING_CLASSES:
            self.gangs_pending.labels(c)
        for k in ETCD_KINDS:
            self.etcd_seconds.labels(k)
            self.etcd_failures.labels(k)
        for o in TWOPHASE_OUTCOMES:
            self.twophase_outcomes.labels(o)
        self.leadership_changes.labels(az)
        self.not_leading()

    # -- store / session hooks
    def etcd_request(self, kind: str, seconds: float, ok: bool) -> None:
        if ok:
            self.etcd_seconds.labels(kind).observe(seconds)
        else:
            self.etcd_failures.labels(kind).inc()

    def fenced_write_refused(self) -> None:
        self.fenced_refused.inc()

    def keepalive(self, seconds: float | None) -> None:
        """An acknowledged keepalive's round trip; None: not acknowledged."""
        if seconds is None:
            self.keepalive_failures.inc()
        else:
            self.keepalive_lag.observe(seconds)

    def etcd_space(self, db_size: int, in_use: int, quota: int, alarm: bool) -> None:
        self.etcd_db_size.set(db_size)
        self.etcd_db_in_use.set(in_use)
        self.etcd_quota.set(quota)
        self.etcd_space_alarm.set(1 if alarm else 0)

    def etcd_compaction(self, result: str) -> None:
        self.etcd_compactions.labels(result).inc()

    # -- watch streams
    def watch_streams(self, open_total: int, top: int) -> None:
        self.watch_open.set(open_total)
        self.watch_top.set(top)

    def watch_refused(self, cap: str) -> None:
        self.watch_refusals.labels(cap).inc()

    def watch_dropped(self, reason: str) -> None:
        self.watch_drops.labels(reason).inc()

    # -- leadership
    def leading(self, epoch: int) -> None:
        self.leadership_changes.labels(self.az).inc()
        self.leader_epoch.labels(self.az).set(epoch)
        self.is_leader.labels(self.az).set(1)

    def not_leading(self) -> None:
        self.leader_epoch.labels(self.az).set(0)
        self.is_leader.labels(self.az).set(0)
        for c in PENDING_CLASSES:
            self.gangs_pending.labels(c).set(0)
        for s in RESERVATION_STATES:
            self.reservations.labels(s.value).set(0)
        for s in HOLD_STATES:
            self.twophase_holds.labels(s.value).set(0)
        self.agents_connected.labels(self.az).set(0)
        self.nodes_ready.labels(self.az).set(0)
        for s in ("free", "used"):
            self.gpus.labels(self.az, s).set(0)
        for s in NODE_STATES:
            self.nodes.labels(self.az, s).set(0)

    # -- gang lifecycle (the leader calls these after its write succeeded)
    def submitted(self, queue: str) -> None:
        self.gangs_submitted.labels(queue).inc()

    def admitted(self, queue: str, *, first: bool, since_submit: float) -> None:
        self.gangs_admitted.labels(queue).inc()
        if first:
            self.time_to_reserved.labels(queue).observe(max(0.0, since_submit))

    def running(self, queue: str, *, first: bool, since_submit: float) -> None:
        if first:
            self.time_to_full_gang.labels(queue).observe(max(0.0, since_submit))

    def finished(self, queue: str, outcome: str) -> None:
        self.gangs_finished.labels(queue, outcome).inc()

    def restarted(self, queue: str) -> None:
        self.gang_restarts.labels(queue).inc()

    def gang_changed(self, before: Step | None, after: Any, now: float) -> None:
        """Count what a gang record going from ``before`` (``step_of`` the
        record the leader knew; None: none) to ``after`` (a GangRecord)
        means (``lifecycle_steps``)."""
        q = after.spec.queue
        first = after.restarts == 0
        for step in lifecycle_steps(before, step_of(after)):
            if step == "admitted":
                self.admitted(q, first=first, since_submit=now - after.submitted_at)
            elif step == "running":
                self.running(q, first=first, since_submit=now - after.submitted_at)
            elif step == "restarted":
                self.restarted(q)
            else:
                self.finished(q, after.state.name)

    def twophase_decided(self, outcome: str, reason: str) -> None:
        self.twophase_outcomes.labels(twophase_outcome(outcome, reason)).inc()

    # -- the leader's view, once per cycle
    def view(self, *, pending: Iterable[str], reservations: Iterable[str], holds: Iterable[str],
             agents: int, nodes_ready: int, gpus_free: int, gpus_used: int, nodes: Iterable[str] = ()) -> None:
        """``pending``: a reason class per PENDING gang; ``reservations`` and
        ``holds``: a state per record; ``nodes``: a state per node record
        (``capacity.NODE_STATES``)."""
        counts = dict.fromkeys(PENDING_CLASSES, 0)
        for c in pending:
            counts[c] = counts.get(c, 0) + 1
        for c, n in counts.items():
            self.gangs_pending.labels(c).set(n)
        rs = {s.value: 0 for s in RESERVATION_STATES}
        for s in reservations:
            rs[s] = rs.get(s, 0) + 1
        for s, n in rs.items():
            self.reservations.labels(s).set(n)
        hs = {s.value: 0 for s in HOLD_STATES}
        for s in holds:
            hs[s] = hs.get(s, 0) + 1
        for s, n in hs.items():
            self.twophase_holds.labels(s).set(n)
        self.agents_connected.labels(self.az).set(agents)
        self.nodes_ready.labels(self.az).set(nodes_ready)
        self.gpus.labels(self.az, "free").set(gpus_free)
        self.gpus.labels(self.az, "used").set(gpus_used)
        ns = dict.fromkeys(NODE_STATES, 0)
        for s in nodes:
            ns[s] = ns.get(s, 0) + 1
        for s, n in ns.items():
            self.nodes.labels(self.az, s).set(n)
