"""Coordinator and agent timing configuration, validated together (docs/style.md §9).

In the shared `phalanx` package because coordinators and agents both read
it, and the agent package does not import the coordinator package.

Every timing assumption of the safety argument lives here, and ``validate()``
checks the relations between them at start-up; a bad combination fails fast
with the rule it breaks. docs/timing.md explains each rule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Timings:
    # etcd lease of a leader's session. etcd TTLs are whole seconds, and etcd
    # itself refuses TTLs below ~1.5 x its election timeout.
    lease_ttl_s: int = 5
    # Keepalive cadence: TTL/3 gives two spare keepalives before expiry.
    keepalive_interval_s: float = 5 / 3
    # Deadline of one etcd request (and one keepalive round trip).
    etcd_timeout_s: float = 1.0
    # A replica that is not the leader forwards a write (or an explain) to
    # the leader within the caller's own remaining deadline; this is the
    # deadline of the forwarded call only when the caller set none.
    forward_timeout_s: float = 5.0
    # The leader stops acting at (send time of the last acknowledged
    # keepalive) + TTL - margin, judged on its own monotonic clock. The
    # margin covers clock-rate drift between this host and the etcd leader.
    step_down_margin_s: float = 0.5
    # Agent -> leader heartbeat cadence, and when a silent node is NotReady.
    heartbeat_interval_s: float = 1.0
    node_not_ready_after_s: float = 5.0
    # An agent that has heard no valid leader for this long stops its members.
    fence_after_s: float = 12.0
    # Time an agent gives itself to find and reach a new leader.
    reconnect_budget_s: float = 3.0
    # Extra wait before the coordinator re-places work from a lost node,
    # beyond that node's fence deadline (clock-rate drift, kill latency).
    replace_margin_s: float = 2.0
    # Member stop: SIGTERM, then SIGKILL after this grace.
    stop_grace_s: float = 5.0
    # Pause between campaign attempts of a standby.
    campaign_retry_s: float = 0.5
    # Two-phase prepare hold timeout before in-doubt resolution (issue 3).
    prepare_timeout_s: float = 10.0
    # Two-phase owner: how long to wait for every participant's vote before
    # deciding ABORT (must be below prepare_timeout_s).
    vote_timeout_s: float = 5.0
    # An AZ without any leader for this long has its PENDING gangs adopted
    # by another AZ's leader (owner-AZ loss).
    owner_adopt_after_s: float = 30.0
    # Whole-gang restart backoff: base * 2^restarts, capped.
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    # A finished gang (SUCCEEDED, FAILED, CANCELLED) is deleted from etcd,
    # with its idempotency key and decision keys, this long after it ended
    # (docs/etcd-keys.md "Retention"). Until then GetGang shows it and a
    # resubmission with its idempotency key returns it.
    gang_retention_s: float = 7 * 24 * 3600.0
    # Backfill (docs/admission.md): gangs behind one that does not fit may be
    # admitted first; once the head has waited this long, the nodes it would
    # take on an empty AZ are kept for it (others stay open to backfill).
    backfill_window_s: float = 30.0
    # "Never fits" (docs/admission.md) is judged against the nodes registered
    # in etcd; a leader judges only once it has led this long, so that at a
    # cluster's start the agents have had time to register their nodes.
    node_register_grace_s: float = 60.0
    # A node whose agent this leadership has not heard for this long (from
    # its takeover for a node not heard yet) is expired (docs/nodes.md): its
    # record says so, placement and never-fits leave it out until its agent
    # registers again.
    node_expire_after_s: float = 600.0
    # The GangService policy a coordinator applies is at most this old: it
    # reads the policy record from etcd again when its copy is older, so an
    # admin's SetPolicy on one coordinator binds every other one within it.
    policy_max_staleness_s: float = 2.0
    # A /metrics scraper gets this long for its TLS handshake and request
    # before the connection is closed (each connection has its own thread,
    # so a silent one only holds that thread).
    metrics_handshake_timeout_s: float = 5.0
    # The leader sets its view's gauges (pending gangs, reservations, nodes,
    # GPUs) at most this often: they cost a pass over its gangs and nodes.
    metrics_view_interval_s: float = 1.0
    # The longest an AZ leader's loop waits for a wake (a submission, freed
    # capacity, a registration, another AZ's inventory on the watch) before
    # it runs a cycle anyway: liveness, start barriers and restart backoffs
    # end on the clock, not on an event. Admission itself never waits for it.
    cycle_wait_s: float = 0.25
    # Two-phase owner (docs/two-phase.md): after an ABORT the next
    # incarnation waits base * 2^(attempts-1), capped, before the admission
    # cycle may place it again (an older gang that won a conflict gets to
    # commit first; its loser does not spin on it).
    twophase_retry_backoff_s: float = 0.3
    twophase_retry_backoff_max_s: float = 4.0
    # Two-phase owner: an attempt record or decision key whose write failed
    # is written again after this pause.
    twophase_store_retry_s: float = 0.5
    # An owner re-evaluates its running cross-AZ gangs from the participants'
    # member summaries this often (a summary that arrives while a write of
    # the gang is in flight is skipped by that evaluation).
    member_evaluate_interval_s: float = 0.5
    # How often a leader reads leader/ to find AZs without a leader (owner-AZ
    # loss, owner_adopt_after_s).
    owner_loss_poll_s: float = 1.0
    # Pause before an etcd call that timed out is tried again where the
    # caller must learn the answer (rebuild, a lost reply's outcome, a read
    # of the two-phase driver, its broken watch).
    store_retry_pause_s: float = 0.2
    # While a backlog of finished gangs drains, the pause between two sweeps
    # of the collector (instead of gc_interval_s).
    gc_backlog_pause_s: float = 1.0
    # How often every coordinator asks etcd for its database size and its
    # alarms (coordinator/etcd_space.py): two small maintenance reads. The
    # warning at 80 % of the quota comes minutes to hours before the alarm
    # at any plausible write rate, so a slow pace misses nothing.
    etcd_space_poll_s: float = 15.0

    @property
    def leader_validity_s(self) -> float:
        """How long after a keepalive was sent the leader may keep acting."""
        return self.lease_ttl_s - self.step_down_margin_s

    def restart_backoff(self, restarts: int) -> float:
        return min(self.restart_backoff_max_s, self.restart_backoff_s * (2 ** max(0, restarts)))

    @property
    def gc_interval_s(self) -> float:
        """How often the owner leader sweeps for finished gangs past
        retention: a gentle pace, so collection never competes with
        admission (each sweep handles a bounded number of gangs)."""
        return min(60.0, self.gang_retention_s / 10)

    @property
    def submit_retry_window_s(self) -> float:
        """How long after its first attempt a well-behaved client may still
        retry one submission (same idempotency key): across an etcd leader
        change (which restarts lease TTLs) plus a failover, and the agents'
        fence deadline. The chaos workload retries for this plus slack; the
        SDK's default deadline (10 s) is below it."""
        return 3 * self.lease_ttl_s + self.fence_after_s

    @property
    def replace_after_s(self) -> float:
        """A lost node's members are re-placed only after this long without
        contact: its agent has fenced them by then."""
        return self.fence_after_s + self.replace_margin_s

    def validate(self) -> "Timings":
        errors: list[str] = []

        def rule(ok: bool, text: str) -> None:
            if not ok:
                errors.append(text)

        rule(isinstance(self.lease_ttl_s, int) and self.lease_ttl_s >= 2,
             f"lease_ttl_s must be a whole number of seconds >= 2 (etcd's minimum), got {self.lease_ttl_s}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            rule(isinstance(v, (int, float)) and v > 0 and math.isfinite(v), f"{f.name} must be a positive number, got {v}")
        if errors:
            raise ConfigError("invalid timings: " + "; ".join(errors))
        rule(self.step_down_margin_s < self.lease_ttl_s,
             "step_down_margin_s must be below lease_ttl_s (a leader must act for some time after a keepalive)")
        # Two keepalives may fail (each taking up to etcd_timeout_s) before the
        # leader's local validity runs out; otherwise one slow request deposes it.
        rule(2 * self.keepalive_interval_s + self.etcd_timeout_s <= self.leader_validity_s,
             "2*keepalive_interval_s + etcd_timeout_s must be <= lease_ttl_s - step_down_margin_s "
             f"({2 * self.keepalive_interval_s + self.etcd_timeout_s:.2f} > {self.leader_validity_s:.2f})")
        rule(self.node_not_ready_after_s >= 2 * self.heartbeat_interval_s,
             "node_not_ready_after_s must be at least two heartbeat intervals")
        # An agent must not fence while a successor can still legitimately be
        # elected and reach it: the old lease may live lease_ttl_s, and the
        # agent then needs reconnect_budget_s to reach the new leader.
        rule(self.fence_after_s > self.lease_ttl_s + self.reconnect_budget_s,
             f"fence_after_s must exceed lease_ttl_s + reconnect_budget_s ({self.fence_after_s} <= {self.lease_ttl_s + self.reconnect_budget_s})")
        rule(self.reconnect_budget_s >= 2 * self.heartbeat_interval_s,
             "reconnect_budget_s must be at least two heartbeat intervals")
        rule(self.stop_grace_s < self.replace_margin_s + self.fence_after_s - self.lease_ttl_s,
             "stop_grace_s must end before a lost node's work is re-placed "
             "(stop_grace_s < fence_after_s + replace_margin_s - lease_ttl_s)")
        rule(self.prepare_timeout_s >= 2 * self.etcd_timeout_s,
             "prepare_timeout_s must be at least two etcd round trips")
        # A forwarded submission costs the leader at least one etcd txn, and
        # a cross-AZ cancel a read and a txn.
        rule(self.forward_timeout_s >= 2 * self.etcd_timeout_s,
             "forward_timeout_s must be at least two etcd round trips "
             f"({self.forward_timeout_s} < {2 * self.etcd_timeout_s:g})")
        rule(self.vote_timeout_s < self.prepare_timeout_s,
             "vote_timeout_s must be below prepare_timeout_s (the owner normally decides before participants give up)")
        rule(self.owner_adopt_after_s > self.lease_ttl_s + self.campaign_retry_s,
             "owner_adopt_after_s must exceed lease_ttl_s + campaign_retry_s (a standby gets the chance to take over first)")
        # An agent finds a new leader within reconnect_budget_s and registers
        # on its next heartbeat; judging sooner could fail a gang against an
        # AZ whose nodes are on their way.
        rule(self.node_register_grace_s >= self.reconnect_budget_s + self.heartbeat_interval_s,
             "node_register_grace_s must be at least reconnect_budget_s + heartbeat_interval_s (agents register "
             f"before gangs are judged against their nodes) ({self.node_register_grace_s} < "
             f"{self.reconnect_budget_s + self.heartbeat_interval_s:g})")
        # An expired node is left out of never-fits: only once it is lost
        # (its members stopped and re-placed) and once a new leader's agents
        # have had time to register.
        floor = max(self.replace_after_s, self.node_register_grace_s)
        rule(self.node_expire_after_s > floor,
             "node_expire_after_s must exceed fence_after_s + replace_margin_s and node_register_grace_s "
             f"(a node expires only after it is lost and its agent had time to register) ({self.node_expire_after_s} <= {floor:g})")
        # A finished gang must outlive (a) every retry of its own submission:
        # a gang created by a first attempt whose reply was lost may finish at
        # once, and a retry after collection would run it a second time; and
        # (b) every hold of it: a participant resolves a PREPARED hold within
        # prepare_timeout_s and releases a COMMITTED one within
        # replace_after_s of seeing the end. Both clocks start about when the
        # gang ends, so the larger one counts. (The collector also checks
        # holds in its txn; this keeps it from finding them.)
        floor = max(self.submit_retry_window_s, self.replace_after_s + self.prepare_timeout_s)
        rule(self.gang_retention_s > floor,
             "gang_retention_s must exceed both 3*lease_ttl_s + fence_after_s (client submit retries) and "
             f"fence_after_s + replace_margin_s + prepare_timeout_s (holds of a finished gang) ({self.gang_retention_s} <= {floor:g})")
        # The cycle checks liveness: a silent node is noticed within one
        # heartbeat of node_not_ready_after_s.
        rule(self.cycle_wait_s <= self.heartbeat_interval_s,
             f"cycle_wait_s must be at most heartbeat_interval_s ({self.cycle_wait_s} > {self.heartbeat_interval_s})")
        rule(self.twophase_retry_backoff_s <= self.twophase_retry_backoff_max_s,
             "twophase_retry_backoff_s must be at most twophase_retry_backoff_max_s "
             f"({self.twophase_retry_backoff_s} > {self.twophase_retry_backoff_max_s})")
        # A decision whose create failed is written again before the
        # participants resolve their PREPARED holds in doubt (safe either
        # way; this keeps a store hiccup from costing the attempt).
        rule(self.twophase_store_retry_s < self.prepare_timeout_s - self.vote_timeout_s,
             "twophase_store_retry_s must be below prepare_timeout_s - vote_timeout_s "
             f"({self.twophase_store_retry_s} >= {self.prepare_timeout_s - self.vote_timeout_s:g})")
        rule(self.owner_loss_poll_s < self.owner_adopt_after_s,
             f"owner_loss_poll_s must be below owner_adopt_after_s ({self.owner_loss_poll_s} >= {self.owner_adopt_after_s})")
        rule(self.store_retry_pause_s <= self.etcd_timeout_s,
             f"store_retry_pause_s must be at most etcd_timeout_s ({self.store_retry_pause_s} > {self.etcd_timeout_s})")
        rule(self.gc_backlog_pause_s <= self.gc_interval_s,
             f"gc_backlog_pause_s must be at most the collector's sweep interval min(60, gang_retention_s/10) "
             f"({self.gc_backlog_pause_s} > {self.gc_interval_s:g})")
        if errors:
            raise ConfigError("invalid timings: " + "; ".join(errors))
        return self

    @classmethod
    def fast(cls) -> "Timings":
        """Short timings for tests and laptops; still valid."""
        return cls(
            lease_ttl_s=2,
            keepalive_interval_s=0.3,
            etcd_timeout_s=0.5,
            forward_timeout_s=2.5,
            step_down_margin_s=0.6,
            heartbeat_interval_s=0.3,
            node_not_ready_after_s=1.5,
            fence_after_s=4.0,
            reconnect_budget_s=1.0,
            replace_margin_s=1.0,
            stop_grace_s=1.0,
            campaign_retry_s=0.2,
            prepare_timeout_s=4.0,
            vote_timeout_s=2.5,
            owner_adopt_after_s=5.0,
            restart_backoff_s=0.2,
            restart_backoff_max_s=2.0,
            node_register_grace_s=2.0,
            node_expire_after_s=30.0,
            policy_max_staleness_s=0.5,
            etcd_space_poll_s=0.5,
            # gang_retention_s stays at its default (7 days): the chaos
            # checker reads every acknowledged gang back at the end of a run
            # and `phalanx up` users read finished gangs long after. Tests of
            # retention pass a short value of their own.
        ).validate()


def timings_from_mapping(data: Mapping[str, Any], base: Timings = Timings()) -> Timings:
    known = {f.name for f in dataclasses.fields(Timings)}
    unknown = set(data) - known
    if unknown:
        raise ConfigError("unknown timing field(s): " + ", ".join(sorted(unknown)) + "; known: " + ", ".join(sorted(known)))
    return dataclasses.replace(base, **dict(data)).validate()


def timings_from_arg(text: str) -> Timings:
    """The ``--timings`` option of every process: "" (defaults), "fast", or a
    JSON object of overrides; validated together either way."""
    if text == "fast":
        return Timings.fast()
    if text:
        import json

        return timings_from_mapping(json.loads(text))
    return Timings().validate()
