"""A node agent's Session with its AZ's leader (docs/agents.md).

The agent finds the leader through ``leader/<az>`` (its only etcd access is
read-only, via ``phalanx.store``), keeps one bidi stream to it, and
enforces the rules of ``agent.core.enforcement`` on everything it receives:

1. epoch rule: a message older than the highest epoch seen is ignored;
2. the token checked at the resource: before starting or stopping a member on
   a leader's word, one linearizable read confirms the sender's epoch is still
   the create_revision of ``leader/<az>`` and (for a start) that the
   reservation is COMMITTED for that incarnation and covers these devices;
3. its own device ledger: an overlapping assignment is refused and reported;
4. self-fencing: no valid leader heard for ``fence_after_s`` -> stop members.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, stop_after_delay, wait_exponential

from agent.core.enforcement import Arrivals, DeviceLedger, EpochGuard, FenceTimer
from agent.core.member_exit import EXIT_UNKNOWN
from agent.core.rendezvous import port_refusal
from agent import metrics as am
from agent.launcher import Launcher, MemberKey, MemberLaunch
from agent.metrics import AgentMetrics
from agent.rendezvous import bind_error, local_address_towards
from agent.run_as import RunAsRefused
from agent.shim import EXIT_FENCED, LeaseWriter, read_lease
from phalanx.timings import Timings
from phalanx.ports import DEFAULT_PORTS, validate_port_range
from phalanx.store import Get, Store, StoreDenied, StoreUnavailable
from phalanx import failpoints
from phalanx.agent_messages import (Assign, FromAgent, FromLeader, Heartbeat, HeartbeatAck, MemberStatus, MessageError,
                                    Register, Revoke, ToLeader, Welcome, bounded_reason)
from phalanx.leader_record import BadLeaderRecord, LeaderInfo
from phalanx.logfmt import bind, log_context, new_stimulus
from phalanx.model import MemberPhase
from phalanx.reservation import Reservation
from phalanx.tls import TlsFiles, coordinator_channel, looks_like_handshake, probe_server, utc_now
from phalanx.topology import NodeTopology
from phalanx.v1 import agent_pb2_grpc as agrpc

log = logging.getLogger(__name__)

# A member that exits EXIT_FENCED counts as fenced by its shim when our own
# fence deadline is this close (the lease file may lag our FenceTimer by a
# write interval, so the shim can fence a little before we would).
SHIM_FENCE_TOLERANCE_S = 1.0


@dataclass
class MemberRecord:
    key: MemberKey
    phase: MemberPhase
    epoch: int
    gpus: tuple[int, ...]
    exit_code: int = 0
    reason: str = ""
    pid: int = 0
    at: float = 0.0
    stop_requested: bool = False


UNCONFIRMED = "cannot confirm the leader's token"
# The leader's own reservation says this incarnation was torn down (a
# cancel that raced its admission): the member will never start here.
TORN_DOWN = "torn down by its leader"
# Its incarnation was revoked between the assignment's arrival and its start.
REVOKED_FIRST = "revoked before it started"


class TokenRefusal(str):
    """Why a token check said no: the message (a str, as logged and
    reported) and its bounded class (``agent.metrics.TOKEN_REASONS``), so
    the metrics never parse messages."""

    reason: str

    def __new__(cls, reason: str, text: str) -> "TokenRefusal":
        obj = super().__new__(cls, text)
        obj.reason = reason
        return obj


@dataclass(frozen=True)
class TokenVerdict:
    """What a token check found: ``refusal`` None when the sender's epoch is
    still the leader's (and, for a start, the reservation is COMMITTED for
    the incarnation); ``granted``: the GPUs that reservation gives this node
    (None: it names no device of this node)."""

    refusal: TokenRefusal | None = None
    granted: frozenset[int] | None = frozenset()

    def covering(self, gang: str, gpus: tuple[int, ...], node: str) -> "TokenVerdict":
        """This verdict for a start on ``gpus``: refused unless granted."""
        if self.refusal is not None or (self.granted is not None and set(gpus) <= self.granted):
            return self
        return TokenVerdict(TokenRefusal(am.TOKEN_DEVICES, f"reservation of {gang} does not give GPUs {list(gpus)} on {node}"),
                            self.granted)


# Recorded effects, for tests and the chaos history: (monotonic, wall, event, detail)
HistoryHook = Callable[[str, dict[str, Any]], None]


class Agent:
    def __init__(
        self,
        *,
        cluster: str,
        az: str,
        topology: NodeTopology,
        store: Store,
        launcher_factory: Callable[[Callable[[MemberKey, int], Any]], Launcher],
        timings: Timings = Timings(),
        agent_id: str = "",
        history: HistoryHook | None = None,
        channels: dict[str, grpc.aio.Channel] | None = None,
        fence_lease: Path | None = None,
        advertise_address: str = "",
        rendezvous_ports: tuple[int, int] = DEFAULT_PORTS,
        check_ports: bool = True,
        tls: TlsFiles | None = None,
        metrics: AgentMetrics | None = None,
    ):
        self.cluster = cluster
        # The process's agent metrics (shared by the agents of agent.sim);
        # None: counters of its own, which nobody serves.
        self.metrics = metrics if metrics is not None else AgentMetrics()
        self._connected_before = False
        # This agent's certificate files (--tls-dir): its channels to leaders
        # are TLS with them; None: plaintext.
        self.tls = tls
        self.az = az
        self.topology = topology
        self.node = topology.node
        self.store = store
        self.keys = store.keys
        self.t = timings
        self.agent_id = agent_id or f"{self.node}-{uuid.uuid4().hex[:8]}"
        self.launcher = launcher_factory(self._on_exit_logged)
        self.guard = EpochGuard()
        self.ledger: DeviceLedger[MemberKey] = DeviceLedger()
        # Assignments read off the stream and not yet started or refused: a
        # revocation that comes meanwhile refuses them (a racing cancel).
        self.arrivals = Arrivals()
        self.fence = FenceTimer(timings.fence_after_s, time.monotonic())
        # Member-side fencing (agent/shim.py): the members' shims read this
        # file and fence on their own when it goes stale, even if we are dead.
        self.lease: LeaseWriter | None = None
        if fence_lease is not None:
            self.lease = LeaseWriter(fence_lease)
            # A restart must not extend the lease of the members we adopt: the
            # coordinator re-places them fence_after_s (+ margin) after the last
            # contact, however often this agent restarts in between. So keep a
            # previous value from this boot (<= now) as the last valid contact.
            previous = read_lease(fence_lease)
            if previous is not None and previous <= self.fence.last_valid:
                self.fence.last_valid = previous
        self.members: dict[MemberKey, MemberRecord] = {}
        # Rendezvous (docs/launcher.md): the address we advertise ("" = the
        # local address towards the leader, found per session), the ports we
        # own, and the MASTER_PORT of each live rank-0 member we run.
        self.advertise_address = advertise_address
        self.address = advertise_address
        self.rendezvous_ports = validate_port_range(*rendezvous_ports, "rendezvous_ports")
        self.check_ports = check_ports
        self._ports: dict[MemberKey, int] = {}
        self.history = history
        self._channels = channels if channels is not None else {}
        self._own_channels = channels is None
        self._outbox: asyncio.Queue | None = None
        self._refused = ""  # the last refusal logged (details), so each is said once
        self._stopping = asyncio.Event()
        self.connected = asyncio.Event()
        self.leader_address = ""
        self._dialed = ""  # the address of the last leader dialed (for a refusal's message)
        self._probed: tuple[tuple[str, str], str] = (("", ""), "")  # (address, gRPC's words) -> the reason found
        self.leader_epoch = 0
        self.fenced_count = 0
        self._fenced_episode: float | None = None
        self._seq = 0
        self._last_heard = 0.0
        self._token_flights: dict[tuple[int, str, int], asyncio.Future] = {}
        # Assignment handling is serialized so ledger checks and starts never
        # interleave for one node.
        self._lock = asyncio.Lock()
        self.metrics.add_agent(self.connected_now, self.live_members)

    # ------------------------------------------------------------ plumbing
    def connected_now(self) -> bool:
        """Whether a session with a leader is up (read by the metrics scrape,
        from its own thread: only reads)."""
        return self.connected.is_set()

    def live_members(self) -> int:
        """Members starting or running (read by the metrics scrape)."""
        # list(): one C-level copy, safe against the loop changing the dict.
        return sum(1 for r in list(self.members.values()) if r.phase.live)

    def _record(self, event: str, **detail: Any) -> None:
        if self.history is not None:
            self.history(event, {"node": self.node, "az": self.az, "mono": time.monotonic(), "wall": time.time(), **detail})

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            # A cached channel keeps the certificate it was made with; a
            # renewal on disk is used by the channels made after it. The
            # leader must present a coordinator certificate of this cluster
            # (coordinator_channel checks the name only those carry).
            if self.tls is not None:
                ch = coordinator_channel(address, self.tls, cluster=self.cluster)
            else:
                ch = grpc.aio.insecure_channel(address)
            self._channels[address] = ch
        return ch

    def _status(self, rec: MemberRecord) -> MemberStatus:
        # The reason cut to what the leader takes: a long one (a launch
        # error, a list of clashes) must not get every report refused.
        return MemberStatus(
            gang=rec.key.gang, incarnation=rec.key.incarnation, rank=rec.key.rank, phase=rec.phase,
            exit_code=rec.exit_code, epoch=rec.epoch, reason=bounded_reason(rec.reason), gpus=tuple(rec.gpus),
            pid=rec.pid, at=rec.at, node=self.node,
        )

    def _send(self, msg: ToLeader) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(FromAgent(msg).to_pb())

    def _report(self, rec: MemberRecord) -> None:
        self._send(self._status(rec))

    # ------------------------------------------------------------------ run
    def _heard(self) -> None:
        """A valid leader was heard: push the fence deadline (ours and the
        members' shims')."""
        self.fence.heard(time.monotonic())
        if self.lease is not None:
            self.lease.update(self.fence.last_valid)

    async def run(self) -> None:
        # This task's lines and its tasks' name the node (agent.sim runs
        # many agents in one process).
        bind(az=self.az, node=self.node)
        if self.lease is not None:
            self.lease.update(self.fence.last_valid, force=True)
        adopted = await self.launcher.adopt()
        self.metrics.adopted(len(adopted), len(getattr(self.launcher, "orphans_killed", ())))
        for h in adopted:
            self.members[h.key] = MemberRecord(h.key, MemberPhase.RUNNING, h.epoch, h.gpus, pid=h.pid, at=h.started_at)
            self.ledger.hold(h.key, h.gpus, h.nics)
        fencer = asyncio.create_task(self._fence_loop(), name=f"fence-{self.node}")
        try:
            while not self._stopping.is_set():
                try:
                    await self._session_once()
                except asyncio.CancelledError:
                    raise
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        self.metrics.session_error(am.SESSION_REFUSED)
                        # A refusal of what this agent sent: retrying sends the
                        # same again, so say it loudly (once per reason); the
                        # fence loop keeps running meanwhile.
                        if exc.details() != self._refused:
                            log.error("agent %s: the leader refused this agent: %s", self.node, exc.details())
                        self._refused = exc.details()
                    elif (self.tls is not None and exc.code() == grpc.StatusCode.UNAVAILABLE
                          and looks_like_handshake(exc.details() or "")):
                        self.metrics.session_error(am.SESSION_TLS)
                        await self._refuse_leader(exc.details() or "")
                    else:
                        self.metrics.session_error(am.SESSION_OTHER)
                        log.debug("agent %s session ended: %r", self.node, exc)
                except StoreDenied as exc:
                    # Misconfigured etcd credentials do not heal by retrying:
                    # say so loudly, once per reason (retrying keeps going in
                    # case the roles are provisioned meanwhile).
                    self.metrics.session_error(am.SESSION_OTHER)
                    if str(exc) != self._refused:
                        log.error("agent %s: %s: %s", self.node, self.store.refused_read, exc)
                    self._refused = str(exc)
                except Exception as exc:  # noqa: BLE001 - reconnect on anything
                    self.metrics.session_error(am.SESSION_OTHER)
                    log.debug("agent %s session ended: %r", self.node, exc)
                self.connected.clear()
                if not self._stopping.is_set():
                    await self._sleep(self.t.heartbeat_interval_s)
        finally:
            fencer.cancel()
            await asyncio.gather(fencer, return_exceptions=True)

    async def _refuse_leader(self, details: str) -> None:
        """Say once per reason why the TLS handshake with the leader failed:
        which peer and which check (our own look at its certificate), else
        gRPC's words."""
        address = self._dialed or "the leader"
        assert self.tls is not None
        if self._probed[0] == (address, details):
            reason = self._probed[1]  # the same failure again: no second look every heartbeat
        else:
            refusal = await asyncio.to_thread(probe_server, address, self.tls, cluster=self.cluster, now=utc_now()) \
                if self._dialed else None
            reason = str(refusal) if refusal is not None else f"{address}: TLS handshake failed: {details}"
            self._probed = ((address, details), reason)
        if reason != self._refused:
            log.error("agent %s: refusing the leader: %s", self.node, reason)
        self._refused = reason

    async def _sleep(self, s: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), s)
        except asyncio.TimeoutError:
            pass

    async def stop(self, *, stop_members: bool = True) -> None:
        self._stopping.set()
        if stop_members:
            await self.launcher.stop_all(self.t.stop_grace_s)
        await self.launcher.close()
        if self._own_channels:
            for ch in self._channels.values():
                await ch.close()

    async def _find_leader(self) -> LeaderInfo | None:
        """The leader to dial, parsed by the coordinators' own parser; None
        when there is none or its record cannot be read (said once per
        reason: retrying reads it again, and the fence loop keeps running)."""
        kv = await self.store.get(self.keys.leader(self.az))
        if kv is None:
            return None
        try:
            return LeaderInfo.from_kv(self.az, kv)
        except BadLeaderRecord as exc:
            if str(exc) != self._refused:
                log.error("agent %s: cannot read the leader record, not dialing: %s", self.node, exc)
            self._refused = str(exc)
            return None

    async def _session_once(self) -> None:
        if failpoints.on("agent.cut_off"):
            return  # fault injection: as if the network to every coordinator were cut
        found = await self._find_leader()
        if found is None:
            return
        address, epoch = found.address, found.epoch
        if epoch < self.guard.highest:
            return  # a stale key cannot be: epochs only grow; wait for etcd to catch up
        self._dialed = address
        stub = agrpc.AgentServiceStub(self._channel(address))
        self._outbox = outbox = asyncio.Queue()
        members = tuple(self._status(r) for r in self.members.values())
        self.address = self.advertise_address or local_address_towards(address)
        if not self.address:
            log.warning("agent %s: no route to the leader at %s to learn our address from; advertising none "
                        "(MASTER_ADDR falls back to the node name): pass --advertise-address", self.node, address)
        reg = Register(agent_id=self.agent_id, topology=self.topology, members=members,
                       highest_epoch=self.guard.highest, address=self.address, rendezvous_ports=self.rendezvous_ports)
        outbox.put_nowait(FromAgent(reg).to_pb())

        async def upward():
            while True:
                msg = await outbox.get()
                if msg is None:
                    return
                yield msg

        call = stub.Session(upward())
        beat = asyncio.create_task(self._heartbeat_loop(outbox), name=f"hb-{self.node}")
        # A leader that stops answering (paused, partitioned) keeps its TCP
        # stream open: drop it after a few silent heartbeats and look the
        # leader up again, so a successor is found well before fence_after_s.
        self._last_heard = time.monotonic()
        watchdog = asyncio.create_task(self._silence_watchdog(call), name=f"wd-{self.node}")
        try:
            async for pb in self._until_silent(call, watchdog):
                if failpoints.on("agent.cut_off"):
                    break
                try:
                    msg = FromLeader.from_pb(pb)
                except MessageError as exc:
                    # Nothing is done on a word that cannot be read; a newer
                    # leader's kind of message is one such.
                    log.warning("agent %s ignored a message it cannot take: %s", self.node, exc)
                    continue
                # failpoint agent.ignore_epoch: a planted bug for the chaos checker
                if not self.guard.accept(msg.epoch) and not failpoints.on("agent.ignore_epoch"):
                    self._record("stale_message_ignored", epoch=msg.epoch, highest=self.guard.highest)
                    self.metrics.fenced(am.FENCE_STALE_EPOCH)
                    log.warning("agent %s ignored a message with stale epoch %d (highest %d)", self.node, msg.epoch, self.guard.highest)
                    continue
                self._last_heard = time.monotonic()
                body = msg.body
                if isinstance(body, (Welcome, HeartbeatAck)):
                    # Heard a valid leader (it acks only while its lease is valid).
                    self._heard()
                    if isinstance(body, Welcome):
                        self.leader_address, self.leader_epoch = address, msg.epoch
                        bind(epoch=msg.epoch)  # this session's later lines
                        self.connected.set()
                        if self._connected_before:
                            self.metrics.reconnected()
                        self._connected_before = True
                        self._record("connected", epoch=msg.epoch, leader=body.coordinator_id)
                elif isinstance(body, Assign):
                    self._heard()
                    self.metrics.assignment()
                    self.arrivals.arrive(body.gang, body.incarnation, body.rank)
                    asyncio.create_task(self._on_assign(msg.epoch, body))
                elif isinstance(body, Revoke):
                    self._heard()
                    self.arrivals.revoke(body.gang, body.incarnation)
                    asyncio.create_task(self._on_revoke(msg.epoch, body))
        finally:
            beat.cancel()
            watchdog.cancel()
            outbox.put_nowait(None)
            self._outbox = None
            call.cancel()

    @staticmethod
    async def _until_silent(call: Any, watchdog: asyncio.Task):
        """Iterate the stream; end quietly when the watchdog cancelled it
        (grpc.aio surfaces a cancelled call as CancelledError, which must
        otherwise propagate: it may be our own task being cancelled)."""
        try:
            async for msg in call:
                yield msg
        except asyncio.CancelledError:
            if watchdog.done() and not watchdog.cancelled():
                return
            raise

    async def _silence_watchdog(self, call: Any) -> None:
        limit = max(3 * self.t.heartbeat_interval_s, self.t.reconnect_budget_s)
        while True:
            await asyncio.sleep(self.t.heartbeat_interval_s / 2)
            if time.monotonic() - self._last_heard > limit:
                log.info("agent %s: leader silent for %.1fs; reconnecting", self.node, time.monotonic() - self._last_heard)
                call.cancel()
                return

    async def _heartbeat_loop(self, outbox: asyncio.Queue) -> None:
        n = 0
        while True:
            await asyncio.sleep(self.t.heartbeat_interval_s)
            self._seq += 1
            n += 1
            # Anti-entropy: the full member list now and then.
            members = tuple(self._status(r) for r in self.members.values()) if n % 5 == 0 else ()
            outbox.put_nowait(FromAgent(Heartbeat(seq=self._seq, members=members)).to_pb())

    # ------------------------------------------------------------- fencing
    def _record_fenced(self, members: list[MemberRecord], by: str) -> None:
        # One "fenced" event per fence episode (one last_valid), whether the
        # agent or the members' shims got there first.
        if self._fenced_episode == self.fence.last_valid:
            return
        self._fenced_episode = self.fence.last_valid
        self.metrics.fenced(am.FENCE_SILENCE if by == "agent" else am.FENCE_SHIM)
        self._record("fenced", members=[str(r.key) for r in members],
                     silent_s=time.monotonic() - self.fence.last_valid, by=by)

    async def _fence_loop(self) -> None:
        while True:
            await asyncio.sleep(min(0.2, self.t.fence_after_s / 10))
            if self.lease is not None:
                if failpoints.on("agent.no_fencing"):
                    # The planted bug disables member-side fencing too: the
                    # lease claims contact it does not have.
                    self.lease.update(time.monotonic())
                else:
                    self.lease.flush()
            now = time.monotonic()
            live = [r for r in self.members.values() if r.phase.live]
            if live and self.fence.overdue(now) and not failpoints.on("agent.no_fencing"):
                self.fenced_count += 1
                log.warning(
                    "agent %s FENCING: no valid leader heard for %.1fs (fence_after_s=%.1f); stopping %d member(s)",
                    self.node, now - self.fence.last_valid, self.t.fence_after_s, len(live),
                )
                self._record_fenced(live, by="agent")
                for r in live:
                    r.stop_requested = True
                    r.reason = "fenced: no valid leader heard"
                await self.launcher.stop_all(self.t.stop_grace_s)

    # ------------------------------------------------------------ commands
    async def _token_ok(self, epoch: int, gang: str | None = None, incarnation: int = 0,
                        gpus: tuple[int, ...] = ()) -> TokenVerdict:
        """One linearizable read: is ``epoch`` still the leader's, and (for a
        start, ``gang`` given) is the reservation COMMITTED for this
        incarnation and does it give ``gpus`` on this node?"""
        verdict = await self._token_read(epoch, gang, incarnation)
        return verdict if gang is None else verdict.covering(gang, gpus, self.node)

    async def _token_read(self, epoch: int, gang: str | None, incarnation: int) -> TokenVerdict:
        """The read of the token check; for a ``gang``, its verdict carries
        the devices the reservation gives this node."""
        if failpoints.on("agent.skip_token_check"):
            return TokenVerdict(granted=frozenset(range(1024)))
        ops = [Get(self.keys.leader(self.az))]
        if gang is not None:
            ops.append(Get(self.keys.reservation(self.az, gang)))
        # A transient etcd error (e.g. "no leader" during an etcd election)
        # must not silently drop an assignment: retry briefly, three tries
        # at most and never past the reconnect budget, then report the token
        # unconfirmed (the leader re-sends; nothing is started unconfirmed).
        started = time.monotonic()
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(StoreUnavailable),
                stop=stop_after_attempt(3) | stop_after_delay(self.t.reconnect_budget_s),
                wait=wait_exponential(multiplier=0.2),
                reraise=True,
            ):
                with attempt:
                    res = await self.store.txn([], ops)
        except StoreUnavailable as exc:
            return TokenVerdict(TokenRefusal(am.TOKEN_UNCONFIRMED, f"{UNCONFIRMED}: {exc}"))
        except StoreDenied as exc:
            # The read was refused (by a coordinator: this node's certificate
            # is not of this AZ; by etcd: a wrong --etcd-tls-dir or roles not
            # provisioned): the token cannot be confirmed, so it is refused
            # like an unreachable etcd, and the fence loop fences.
            log.error("agent %s: the token check: %s: %s", self.node, self.store.refused_read, exc)
            return TokenVerdict(TokenRefusal(am.TOKEN_DENIED, f"{UNCONFIRMED}: {exc}"))
        finally:
            self.metrics.token_check_seconds.observe(time.monotonic() - started)
        leader = res.results[0]
        # failpoint agent.ignore_stale_epoch: a planted bug for the chaos checker
        if (not leader or leader[0].create_revision != epoch) and not failpoints.on("agent.ignore_stale_epoch"):
            return TokenVerdict(TokenRefusal(am.TOKEN_NOT_LEADER, f"epoch {epoch} is no longer the leader of {self.az}"))
        if gang is None:
            return TokenVerdict()
        r = res.results[1]
        if not r:
            return TokenVerdict(TokenRefusal(am.TOKEN_NO_RESERVATION, f"no reservation for {gang} in {self.az}"))
        try:
            hold = Reservation.from_dict(r[0].json())
        except ValueError as exc:  # not JSON, or BadReservation naming the field
            # Nothing starts on a record that cannot be read (its leader
            # keeps the devices held, coordinator/core/records.py).
            return TokenVerdict(TokenRefusal(am.TOKEN_NOT_COMMITTED, f"reservation of {gang} is unreadable: {exc}"))
        if hold.releasing(incarnation):
            return TokenVerdict(TokenRefusal(
                am.TOKEN_TORN_DOWN, f"{TORN_DOWN}: reservation of {gang} is RELEASING for incarnation {incarnation}"))
        if not hold.holds(gang, incarnation):
            return TokenVerdict(TokenRefusal(am.TOKEN_NOT_COMMITTED,
                                             f"reservation of {gang} is {hold.state.value} for incarnation "
                                             f"{hold.incarnation}, not COMMITTED for {incarnation}"))
        mine = hold.nodes.get(self.node)
        return TokenVerdict(granted=frozenset(mine.gpus) if mine is not None else None)

    async def _token_ok_shared(self, epoch: int, gang: str, incarnation: int, gpus: tuple[int, ...]) -> TokenVerdict:
        """Coalesce concurrent checks of the same (epoch, gang, incarnation)
        into one read in flight. Never reuses a finished read: each start is
        still preceded by a read that began after its assignment arrived."""
        flight_key = (epoch, gang, incarnation)
        fut = self._token_flights.get(flight_key)
        if fut is None:
            fut = asyncio.ensure_future(self._token_read(epoch, gang, incarnation))
            self._token_flights[flight_key] = fut
            fut.add_done_callback(lambda _f: self._token_flights.pop(flight_key, None))
        verdict: TokenVerdict = await asyncio.shield(fut)
        return verdict.covering(gang, gpus, self.node)

    async def _on_assign(self, epoch: int, a: Assign) -> None:
        try:
            await self._assign(epoch, a)
        finally:
            self.arrivals.done(a.gang, a.incarnation, a.rank)

    async def _assign(self, epoch: int, a: Assign) -> None:
        # Its own task. The leader's stimulus id when it sent one: the
        # decision that placed the member, followed into this agent's lines.
        bind(epoch=epoch, gang=a.gang, incarnation=a.incarnation, stimulus=a.stimulus_id or new_stimulus(self.node))
        received = time.monotonic()
        key = MemberKey(a.gang, a.incarnation, a.rank)
        gpus, nics = tuple(a.gpus), tuple(a.nics)
        # The token check runs before the lock, so the members of one gang
        # arriving together share one etcd read (see _token_ok_shared).
        await failpoints.hit("agent.before_token_check")  # a slow agent: the epoch may move on meanwhile
        why = (await self._token_ok_shared(epoch, a.gang, a.incarnation, gpus)).refusal
        stop_now = False  # revoked or fenced while its launch was in flight (below)
        async with self._lock:
            existing = self.members.get(key)
            if existing is not None:
                self._report(existing)  # duplicate assignment: idempotent
                return
            if self.arrivals.revoked(a.gang, a.incarnation, a.rank):
                # Revoked while it waited for its token check or its turn:
                # the revocation found nothing to stop and the leader sends
                # no other, so it never starts; reported, so the leader can
                # release the incarnation's devices.
                self.metrics.refused(am.REFUSED_REVOKED)
                rec = MemberRecord(key, MemberPhase.REJECTED, epoch, gpus, reason=REVOKED_FIRST, at=time.time())
                self.members[key] = rec
                self._record("assign_refused_revoked", key=str(key), epoch=epoch)
                log.warning("agent %s refused %s: %s", self.node, key, REVOKED_FIRST)
                self._report(rec)
                return
            if why:
                self.metrics.refused(am.REFUSED_TOKEN)
                self.metrics.token_refused(why.reason)
                self._record("assign_refused_token", key=str(key), epoch=epoch, reason=why)
                log.warning("agent %s refused %s: %s", self.node, key, why)
                if why.startswith((UNCONFIRMED, TORN_DOWN)):
                    # Not started, and say so: the leader can fail (and
                    # restart) the gang now instead of at its start timeout.
                    # A torn-down incarnation's devices stay held (RELEASING)
                    # until the leader hears that no member of it runs; a
                    # refusal said to no one held them until the agent
                    # registered again.
                    rec = MemberRecord(key, MemberPhase.REJECTED, epoch, gpus, reason=why, at=time.time())
                    self.members[key] = rec
                    self._report(rec)
                return  # a stale leader's word: say nothing, do nothing
            # the ledger uses live members only
            clash = self.ledger.conflicts(key, gpus, nics)
            if clash:
                rec = MemberRecord(key, MemberPhase.REJECTED, epoch, gpus, reason="; ".join(clash), at=time.time())
                self.members[key] = rec
                self.metrics.refused(am.REFUSED_OVERLAP)
                self._record("assign_rejected_overlap", key=str(key), epoch=epoch, reason=rec.reason)
                log.warning("agent %s rejected %s: %s", self.node, key, rec.reason)
                self._report(rec)
                return
            if a.rank == 0 and a.master_port and self.check_ports:
                # Rank 0 listens on MASTER_PORT: refuse now, cleanly, rather
                # than let every member time out at its rendezvous.
                held = {k.gang: p for k, p in self._ports.items() if k in self.members and self.members[k].phase.live}
                why = port_refusal(a.master_port, self.node, a.gang, held, bind_error(a.master_port, self.address),
                                   self.rendezvous_ports)
                if why:
                    rec = MemberRecord(key, MemberPhase.REJECTED, epoch, gpus, reason=why, at=time.time())
                    self.members[key] = rec
                    self.metrics.refused(am.REFUSED_PORT)
                    self._record("assign_rejected_port", key=str(key), epoch=epoch, reason=why)
                    log.warning("agent %s rejected %s: %s", self.node, key, why)
                    self._report(rec)
                    return
                self._ports[key] = a.master_port
            self.ledger.hold(key, gpus, nics)
            launch = MemberLaunch(
                key=key, world_size=a.world_size, local_rank=a.local_rank, local_world_size=a.local_world_size,
                gpus=gpus, nics=nics, command=tuple(a.command), env=dict(a.env), duration_s=a.duration_s,
                master_addr=a.master_addr, master_port=a.master_port, epoch=epoch, node=self.node,
                placement=f"{self.az}/{self.topology.spine}/{self.topology.leaf}/{self.node}",
                owner=a.owner,
            )
            rec = MemberRecord(key, MemberPhase.STARTING, epoch, gpus, at=time.time())
            self.members[key] = rec
            try:
                await failpoints.hit("agent.during_launch")  # a slow launch: a revoke or a fence may come meanwhile
                handle = await self.launcher.start(launch)
            except Exception as exc:  # noqa: BLE001
                self.metrics.refused(am.REFUSED_RUN_AS if isinstance(exc, RunAsRefused) else am.REFUSED_LAUNCH)
                self.ledger.release(key)
                self._ports.pop(key, None)
                rec.phase, rec.exit_code, rec.reason = MemberPhase.FAILED, 127, f"launch failed: {exc}"
                self._report(rec)
                return
            # Started: its one exit is counted in _on_exit, whenever it comes.
            self.metrics.member_started(time.monotonic() - received)
            if rec.phase == MemberPhase.STARTING:
                rec.phase, rec.pid, rec.at = MemberPhase.RUNNING, handle.pid, handle.started_at
                self._record("member_started", key=str(key), epoch=epoch, gpus=list(gpus), pid=handle.pid)
                if rec.stop_requested:
                    # Revoked or fenced while its launch was in flight: that
                    # stop found no process to signal and none will follow,
                    # so stop it now, never reported RUNNING; its exit
                    # reports how it ended.
                    self._record("member_stopped_after_launch", key=str(key), epoch=epoch, reason=rec.reason)
                    log.info("agent %s stops %s as its launch returns: %s", self.node, key, rec.reason)
                    stop_now = True
                else:
                    log.info("agent %s launched %s: pid %s, GPUs %s", self.node, key, handle.pid, list(gpus))
                    self._report(rec)
        if stop_now:
            # Outside the lock: a stop may wait out the stop grace, and other
            # assignments must not wait for it (a revocation's stop does not).
            await self.launcher.stop(key, self.t.stop_grace_s)

    async def _on_revoke(self, epoch: int, r: Revoke) -> None:
        bind(epoch=epoch, gang=r.gang, incarnation=r.incarnation,  # its own task; the stimulus as for assignments
             stimulus=r.stimulus_id or new_stimulus(self.node))
        targets = [m for k, m in self.members.items() if k.gang == r.gang and k.incarnation == r.incarnation]
        if not any(m.phase.live for m in targets):
            # Nothing to stop: the revocation only lets us forget finished
            # members, which needs no token (it changes nothing outside).
            for m in targets:
                self.members.pop(m.key, None)
            return
        why = (await self._token_ok(epoch)).refusal
        if why:
            self.metrics.token_refused(why.reason)
            self._record("revoke_refused_token", gang=r.gang, epoch=epoch, reason=why)
            log.warning("agent %s ignored revoke of %s: %s", self.node, r.gang, why)
            return
        targets = [m for k, m in self.members.items() if k.gang == r.gang and k.incarnation == r.incarnation]
        for m in targets:
            if m.phase.live:
                m.stop_requested = True
                m.reason = f"revoked: {r.reason}"
                await self.launcher.stop(m.key, self.t.stop_grace_s)
        # The leader has seen the end of this incarnation: forget it.
        for m in targets:
            if not m.phase.live:
                self.members.pop(m.key, None)

    def _keep_vanished(self, key: MemberKey, code: int) -> None:
        """A member that ended while this agent was down, with the status its
        shim recorded: keep it as an exited member, so the registration
        reports how it ended (a success stays a success) instead of the
        leader finding it missing ("member vanished"). Without a recorded
        status there is nothing true to report: the leader's rule applies."""
        handle = getattr(self.launcher, "vanished_handles", {}).get(key)
        record = getattr(self.launcher, "vanished_exits", {}).get(key)
        if handle is None or record is None or code == EXIT_UNKNOWN:
            return
        if record["fenced"]:
            phase, reason = MemberPhase.STOPPED, "fenced by its shim while the agent was down"
        elif record["signalled"]:
            # Stopped (drain, revoke, our own fencing) just before the agent
            # died: an interrupted run even if it exited 0.
            phase, reason = MemberPhase.STOPPED, f"stopped by a signal (exit {code}) while the agent was down"
        elif code == 0:
            phase, reason = MemberPhase.SUCCEEDED, "exited 0 while the agent was down"
        else:
            phase, reason = MemberPhase.FAILED, f"exited {code} while the agent was down"
        self.members[key] = MemberRecord(key, phase, handle.epoch, handle.gpus, exit_code=code, reason=reason,
                                         pid=handle.pid, at=float(record["ended_wall"]))

    async def _on_exit_logged(self, key: MemberKey, code: int, ended_mono: float | None = None) -> None:
        """_on_exit with its lines naming the member's gang: the launcher
        may call it from a task that watches many members, so the context
        is scoped to the call, not bound."""
        with log_context(gang=key.gang, incarnation=key.incarnation, stimulus=new_stimulus(self.node)):
            await self._on_exit(key, code, ended_mono)

    async def _on_exit(self, key: MemberKey, code: int, ended_mono: float | None = None) -> None:
        self.metrics.member_exited(code)
        rec = self.members.get(key)
        self.ledger.release(key)
        self._ports.pop(key, None)
        # When the member ended while this agent could not see it, its shim's
        # exit record says when its devices were free; the history carries that
        # time (``mono``), not the time we learned of it (``reported_mono``).
        when: dict[str, Any] = {} if ended_mono is None else {"mono": ended_mono, "reported_mono": time.monotonic()}
        if rec is None:
            # A member that ended while this agent was down (adopt() reports it
            # as vanished): still an effect, so record when its devices were
            # known free, else the history shows it running forever.
            self._record("member_exited", key=str(key), epoch=0, code=code, phase="VANISHED", **when)
            self._keep_vanished(key, code)
            return
        if code == EXIT_FENCED and self.lease is not None and not rec.stop_requested \
                and self.fence.deadline() - time.monotonic() < SHIM_FENCE_TOLERANCE_S:
            # Its shim fenced it at the deadline we share (agent/shim.py): the
            # same outcome as our own fencing, which it merely beat to it.
            rec.stop_requested = True
            rec.reason = "fenced by its shim: no valid leader heard"
            self._record_fenced([rec], by="shim")
        if rec.stop_requested:
            rec.phase = MemberPhase.STOPPED
        else:
            rec.phase = MemberPhase.SUCCEEDED if code == 0 else MemberPhase.FAILED
        rec.exit_code, rec.at = code, time.time()
        self._record("member_exited", key=str(key), epoch=rec.epoch, code=code, phase=rec.phase.name, **when)
        log.info("agent %s: %s exited %d (%s)", self.node, key, code, rec.phase.name)
        self._report(rec)
