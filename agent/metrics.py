"""An agent process's metrics (docs/metrics.md, "Agent").

One ``AgentMetrics`` per process, in the process's own registry
(``phalanx.metrics.new_registry``): ``python -m agent`` has one agent in it,
``python -m agent.sim`` many, which share it. So no metric carries a node,
gang or member label: every label below takes a value from a short fixed
list (``EXIT_CLASSES``, ``FENCE_KINDS``, ``TOKEN_REASONS``,
``REFUSAL_REASONS``, ``SESSION_ERRORS``), and the gauges are sums over the
process's agents (a real agent's ``phalanx_agent_sessions_connected`` is 0
or 1).

Counting rules, so that the counters add up:
- a member is *started* once its launcher returned a handle (the process
  exists, or its failed spawn will be reported as an exit), or *adopted* when
  a restarted agent re-attaches to it; every started or adopted member is
  later *exited* exactly once, classified by ``exit_class`` (a member that
  ended while no agent ran is counted exited by the next agent, which
  neither started nor adopted it);
- every assignment received is counted once; an assignment the agent does
  not start is counted once more in ``assignments_refused`` under its reason.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agent.core.member_exit import EXIT_SPAWN_FAILED, EXIT_UNKNOWN
from agent.shim import EXIT_FENCED

# Exit code classes (label ``class`` of phalanx_agent_members_exited_total).
EXIT_SUCCESS = "success"        # 0
EXIT_CLASS_FENCED = "fenced"    # the shim's EXIT_FENCED: it stopped the member for lack of a leader
EXIT_SIGNAL = "signal"          # killed by a signal (negative code, or the shell's 128+N)
EXIT_CLASS_SPAWN = "spawn_failed"  # could not be started (127)
EXIT_CLASS_UNKNOWN = "unknown"  # ended unseen (adopted, or while the agent was down) without an exit record
EXIT_ERROR = "error"            # any other non-zero code
EXIT_CLASSES = (EXIT_SUCCESS, EXIT_CLASS_FENCED, EXIT_SIGNAL, EXIT_CLASS_SPAWN, EXIT_CLASS_UNKNOWN, EXIT_ERROR)

# Highest signal number Linux has (SIGRTMAX): 128+N above it is a plain code.
_MAX_SIGNAL = 64


def exit_class(code: int) -> str:
    """Pure: the bounded class of a member's exit code."""
    if code == 0:
        return EXIT_SUCCESS
    if code == EXIT_FENCED:
        return EXIT_CLASS_FENCED
    if code == EXIT_UNKNOWN:
        return EXIT_CLASS_UNKNOWN
    if code == EXIT_SPAWN_FAILED:
        return EXIT_CLASS_SPAWN
    if code < 0 or 128 < code <= 128 + _MAX_SIGNAL:
        return EXIT_SIGNAL
    return EXIT_ERROR


# Fence events (label ``kind`` of phalanx_agent_fence_events_total): the
# ways an agent stops or refuses to act on a leader it cannot trust.
FENCE_SILENCE = "silence"            # its own watchdog: no valid leader heard for fence_after_s, members stopped
FENCE_SHIM = "shim"                  # a member's shim fenced it first (same deadline, read from the lease file)
FENCE_TOKEN = "token_refused"        # a start or stop refused at the resource: the token check said no
FENCE_STALE_EPOCH = "stale_epoch"    # a message older than the highest epoch seen, ignored
FENCE_KINDS = (FENCE_SILENCE, FENCE_SHIM, FENCE_TOKEN, FENCE_STALE_EPOCH)

# Why a token check said no (label ``reason`` of phalanx_agent_token_check_failures_total).
TOKEN_NOT_LEADER = "not_leader"          # the sender's epoch is no longer leader/<az>'s create_revision
TOKEN_NO_RESERVATION = "no_reservation"  # no reservation of the gang in the AZ
TOKEN_NOT_COMMITTED = "not_committed"    # the reservation is not COMMITTED for this incarnation
TOKEN_TORN_DOWN = "torn_down"            # the reservation is RELEASING for this incarnation
TOKEN_DEVICES = "devices"                # the reservation does not give these devices on this node
TOKEN_UNCONFIRMED = "unconfirmed"        # etcd did not answer (the leader re-sends)
TOKEN_DENIED = "denied"                  # etcd refused this agent's user the read (its credentials or roles)
TOKEN_REASONS = (TOKEN_NOT_LEADER, TOKEN_NO_RESERVATION, TOKEN_NOT_COMMITTED, TOKEN_TORN_DOWN, TOKEN_DEVICES,
                 TOKEN_UNCONFIRMED, TOKEN_DENIED)

# Why an assignment was not started (label ``reason`` of phalanx_agent_assignments_refused_total).
REFUSED_TOKEN = "token"            # the token check said no (its reason: the token failures counter)
REFUSED_OVERLAP = "overlap"        # its devices overlap a live member's (the agent's own ledger)
REFUSED_PORT = "port"              # rank 0's MASTER_PORT is outside this node's range, held or not bindable
REFUSED_RUN_AS = "run_as"          # the run-as policy lets its owner run nothing here
REFUSED_LAUNCH = "launch_failed"   # the launcher could not start it
REFUSED_REVOKED = "revoked"        # its incarnation was revoked while it waited to start
REFUSAL_REASONS = (REFUSED_TOKEN, REFUSED_OVERLAP, REFUSED_PORT, REFUSED_RUN_AS, REFUSED_LAUNCH, REFUSED_REVOKED)

# How a session with a leader ended badly (label ``kind`` of phalanx_agent_session_errors_total).
SESSION_REFUSED = "refused"   # the leader refused this agent (INVALID_ARGUMENT: what it sent)
SESSION_TLS = "tls"           # the TLS handshake with the leader failed
SESSION_OTHER = "other"       # anything else (the leader went away, the network)
SESSION_ERRORS = (SESSION_REFUSED, SESSION_TLS, SESSION_OTHER)

# Token checks are one linearizable etcd read (retried on a transient
# error): milliseconds when healthy, up to the reconnect budget when not.
TOKEN_CHECK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A start adds the spawn (fork/exec of the shim and the member, or a timer).
START_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class AgentMetrics:
    """The metrics of the agents of one process (see the module docstring).

    ``registry`` None: a fresh one of its own (tests, or a process that
    does not serve them)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        if registry is None:
            from phalanx.metrics import new_registry

            registry = new_registry()
        self.registry = registry
        r = registry
        self.members_started = Counter(
            "phalanx_agent_members_started", "Members this process's agents started (launcher returned a handle).",
            registry=r)
        self.start_seconds = Histogram(
            "phalanx_agent_member_start_seconds",
            "From an assignment's arrival to its member started (token check, ledger, spawn).",
            buckets=START_BUCKETS, registry=r)
        self.members_adopted = Counter(
            "phalanx_agent_members_adopted", "Live members of a previous agent process re-attached at start.",
            registry=r)
        self.orphans_killed = Counter(
            "phalanx_agent_orphans_killed",
            "Processes with this agent's marker but no state record, killed at start.", registry=r)
        self.members_exited = Counter(
            "phalanx_agent_members_exited", "Members that ended, by exit code class.", ["class"], registry=r)
        self.assignments = Counter(
            "phalanx_agent_assignments", "Assignments received from a leader (duplicates included).", registry=r)
        self.assignments_refused = Counter(
            "phalanx_agent_assignments_refused", "Assignments not started, by reason.", ["reason"], registry=r)
        self.fence_events = Counter(
            "phalanx_agent_fence_events",
            "Fencing: members stopped for lack of a leader, commands refused by the token check, stale messages.",
            ["kind"], registry=r)
        self.token_check_failures = Counter(
            "phalanx_agent_token_check_failures", "Commands (start or stop) a token check refused, by reason.",
            ["reason"], registry=r)
        self.token_check_seconds = Histogram(
            "phalanx_agent_token_check_seconds", "Time of one token check (one etcd read, with its retries).",
            buckets=TOKEN_CHECK_BUCKETS, registry=r)
        self.reconnects = Counter(
            "phalanx_agent_reconnects", "Sessions with a leader established after this agent's first one.",
            registry=r)
        self.session_errors = Counter(
            "phalanx_agent_session_errors", "Sessions with a leader that ended in an error, by kind.", ["kind"],
            registry=r)
        # Pre-create every label value: a scrape shows 0 rather than nothing,
        # and a dashboard's rate() starts from the first scrape.
        for c in EXIT_CLASSES:
            self.members_exited.labels(c)
        for k in FENCE_KINDS:
            self.fence_events.labels(k)
        for t in TOKEN_REASONS:
            self.token_check_failures.labels(t)
        for why in REFUSAL_REASONS:
            self.assignments_refused.labels(why)
        for s in SESSION_ERRORS:
            self.session_errors.labels(s)
        # Gauges are read from the agents at scrape time (exact, never out of
        # step with the agents' own state): each agent adds its readers.
        self._lock = threading.Lock()
        self._connected: list[Callable[[], bool]] = []
        self._running: list[Callable[[], int]] = []
        connected = Gauge("phalanx_agent_sessions_connected",
                          "Agents of this process with a session to their AZ's leader (0 or 1 for one agent).",
                          registry=r)
        connected.set_function(lambda: float(sum(1 for f in self._readers(self._connected) if f())))
        running = Gauge("phalanx_agent_members_running", "Live members (starting or running) of this process's agents.",
                        registry=r)
        running.set_function(lambda: float(sum(f() for f in self._readers(self._running))))

    def _readers(self, items: list) -> Iterable:
        # The scrape runs in the server's thread while agents are added.
        with self._lock:
            return list(items)

    def add_agent(self, connected: Callable[[], bool], running: Callable[[], int]) -> None:
        """Count one more agent in the gauges: ``connected()`` whether its
        session is up, ``running()`` its live members. Both are called from
        the scrape's thread: they must only read."""
        with self._lock:
            self._connected.append(connected)
            self._running.append(running)

    # ---------------------------------------------------------------- events
    def member_started(self, seconds: float) -> None:
        """A member started ``seconds`` after its assignment arrived."""
        self.members_started.inc()
        self.start_seconds.observe(seconds)

    def adopted(self, members: int, orphans: int) -> None:
        """At start: ``members`` re-attached, ``orphans`` killed."""
        self.members_adopted.inc(members)
        self.orphans_killed.inc(orphans)

    def member_exited(self, code: int) -> None:
        self.members_exited.labels(exit_class(code)).inc()

    def assignment(self) -> None:
        self.assignments.inc()

    def refused(self, reason: str) -> None:
        self.assignments_refused.labels(_bounded(reason, REFUSAL_REASONS, REFUSED_LAUNCH)).inc()

    def fenced(self, kind: str) -> None:
        self.fence_events.labels(_bounded(kind, FENCE_KINDS, FENCE_TOKEN)).inc()

    def token_refused(self, reason: str) -> None:
        """A command the token check refused: a fence event and its reason."""
        self.fenced(FENCE_TOKEN)
        self.token_check_failures.labels(_bounded(reason, TOKEN_REASONS, TOKEN_UNCONFIRMED)).inc()

    def reconnected(self) -> None:
        self.reconnects.inc()

    def session_error(self, kind: str) -> None:
        self.session_errors.labels(_bounded(kind, SESSION_ERRORS, SESSION_OTHER)).inc()


def _bounded(value: str, allowed: tuple[str, ...], fallback: str) -> str:
    # A label value outside its fixed list would be a bug here; never let it
    # grow the series (a programming error must not become a cardinality one).
    return value if value in allowed else fallback
