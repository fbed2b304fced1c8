"""The async client, :class:`AsyncClient` over ``grpc.aio``: every
GangService call with one deadline and failover across the coordinators
(phalanx/client/failover.py says how and why), watches that resume on
another address, ``wait`` and a ``cancel`` retried after a lost race."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio
from tenacity import AsyncRetrying, retry_if_exception_type

from phalanx.cert_names import coordinator_server_name
from phalanx.client.config import ClientConfigError, Connection, client_tls, connection_settings
from phalanx.client.failover import (
    BACKOFF_MAX_S,
    BACKOFF_START_S,
    MIN_ATTEMPT_S,
    RESUMABLE,
    NoConnection,
    TryNext,
    conflict_backoff,
    exhausted,
    not_connected,
    round_backoff,
    translate,
    until,
)
from phalanx.client.specs import SpecLike, to_spec
from phalanx.client.tokens import TOKEN_NEEDS_TLS, resolve_token, token_credentials
from phalanx.client_names import (
    MAX_LIMIT,
    MAX_MESSAGE_BYTES,
    StateLike,
    check_timeout,
    is_terminal,
    parse_states,
    state_name,
)
from phalanx.errors import Conflict, FailedPrecondition, PhalanxError
from phalanx.model import GangState
from phalanx.tls import TlsFiles, client_pems, looks_like_handshake, pem_channel, probe_server, utc_now
from phalanx.v1 import gang_pb2, gang_pb2_grpc
from phalanx.v1 import types_pb2 as pb
from phalanx.wire import spec_to_pb

# Reconnect quickly after a coordinator restarts: gRPC's default backoff grows
# to 120 s, during which a channel fails every call without trying to connect.
_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
# WatchEvents' response header: resumed, gap or new (docs/events.md "Bounds and resume").
_RESUME_HEADER = "x-phalanx-resume"

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class SubmitResult:
    """Outcome of ``submit``: the gang as stored, and whether this call created
    it (``False`` when the idempotency key matched an earlier submission)."""

    gang: pb.Gang
    created: bool


class TerminalStateReached(PhalanxError):
    """``wait`` gave up early: the gang reached a terminal state the caller did
    not ask for (e.g. FAILED while waiting for RUNNING), so the wanted state can
    never come. ``gang`` is the gang as last seen."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, gang: pb.Gang, wanted: Collection[GangState]):
        self.gang = gang
        self.state = GangState(gang.state)
        self.wanted = frozenset(wanted)
        reason = f" ({gang.reason})" if gang.reason else ""
        want = " or ".join(sorted(s.name for s in self.wanted))
        super().__init__(f"gang {gang.id} reached {self.state.name}{reason} instead of {want}")


class AsyncClient:
    """Async client for one Phalanx cluster. Use as ``async with AsyncClient(...)``
    or call :meth:`close`. Channels are opened lazily, on the running loop.

    ``addresses`` ``None`` (the default): ``$PHALANX_ADDRESS``, else the
    config file's, else ``127.0.0.1:7070``, as the CLI. ``timeout``: each
    call's deadline in seconds, failover included, at most MAX_TIMEOUT_S.
    ``tls_dir``: a directory with ``ca.crt``, ``client.crt`` and
    ``client.key`` (TLS with this client certificate); ``None`` (the
    default): ``$PHALANX_TLS_DIR``, else the config file's ``tls_dir``
    (``$PHALANX_CONFIG``, default ``~/.config/phalanx/config.yaml``).
    Plaintext only with ``insecure=True`` (or ``$PHALANX_INSECURE=1``, or
    ``insecure: true`` in the config file); no credentials at all is a
    ClientConfigError naming every way to give them (``resolve_connection``).
    The TLS files are checked here (TlsError names the file and the check)
    and read again for every new channel; the server must present a
    coordinator certificate of the CA's cluster."""

    def __init__(self, addresses: str | Sequence[str] | None = None, timeout: float = 10.0,
                 tls_dir: str | os.PathLike[str] | None = None, insecure: bool = False, *,
                 connection: Connection | None = None, token: str | None = None, fail_fast: bool = False):
        self.timeout = check_timeout(timeout)
        # ``fail_fast`` (the CLI): a round in which no address could even be
        # connected to (nothing listening, no route, no such host, a failed
        # TLS handshake) ends the call at once instead of retrying until the
        # deadline; an SDK caller may be waiting for a cluster to come up.
        self._fail_fast = fail_fast
        # ``connection``: already resolved (the CLI, whose errors name its flags).
        self.connection = connection or connection_settings(addresses, tls_dir, insecure)
        self.addresses: tuple[str, ...] = self.connection.addresses
        self._tls: tuple[TlsFiles, str] | None = None
        # ``token`` (else $PHALANX_TOKEN): a bearer token, sent only over TLS.
        self._token = resolve_token(token)
        if self._token is not None:
            if self.connection.tls_dir is None:
                raise ClientConfigError(TOKEN_NEEDS_TLS)
            token_credentials(self.connection.tls_dir, self._token)  # checked now, as the TLS files are
        if self.connection.tls_dir is not None and self._token is None:
            self._tls = client_tls(self.connection.tls_dir)
            config = self.connection.config
            if config is not None and config.cluster and str(config.path) in self.connection.tls_from \
                    and config.cluster != self._tls[1]:
                raise ClientConfigError(f"{config.path}: cluster: {config.cluster!r}, but the CA in tls_dir "
                                        f"{self.connection.tls_dir} is cluster {self._tls[1]!r}")
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, gang_pb2_grpc.GangServiceStub] = {}
        # Index of the address that answered last: stick to a working server.
        self._current = 0
        self._closed = False

    @property
    def last_address(self) -> str:
        """The address that answered the last call (the first one before any)."""
        return self.addresses[self._current]

    # -- plumbing --

    def _stub(self, address: str) -> gang_pb2_grpc.GangServiceStub:
        if self._closed:
            raise RuntimeError("client is closed")
        stub = self._stubs.get(address)
        if stub is None:
            if self._token is not None and self.connection.tls_dir is not None:
                credentials, cluster = token_credentials(self.connection.tls_dir, self._token)
                channel = grpc.aio.secure_channel(address, credentials, options=[
                    ("grpc.ssl_target_name_override", coordinator_server_name(cluster)), *_CHANNEL_OPTIONS])
            elif self._tls is not None:
                files, cluster = self._tls
                # The files as they are now (a renewal is used by the next
                # channel), checked as coordinator_channel checks them.
                ca_pem, cert_pem, key_pem, _ = client_pems(files, cluster=cluster)
                channel = pem_channel(address, ca_pem, cert_pem, key_pem, cluster=cluster, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.insecure_channel(address, options=list(_CHANNEL_OPTIONS))
            self._channels[address] = channel
            stub = self._stubs[address] = gang_pb2_grpc.GangServiceStub(channel)
        return stub

    async def _call(
        self,
        method: str,
        request: Any,
        *,
        timeout: float | None = None,
        retried: bool = False,
        on_retry_error: Callable[[PhalanxError], Awaitable[Any]] | None = None,
    ) -> Any:
        """One unary RPC with failover (module docstring). ``on_retry_error``
        may turn an error seen on a *retry* into a result (used by cancel);
        ``retried``: this whole call is itself a retry."""

        async def attempt(k: int, address: str, share: float) -> Any:
            try:
                return await getattr(self._stub(address), method)(request, timeout=share)
            except grpc.aio.AioRpcError as exc:
                # DEADLINE_EXCEEDED: this attempt's share ran out; the next
                # address is tried while the call's own deadline allows.
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise TryNext(address, exc) from None
                err = translate(exc, address)
                if (k or retried) and on_retry_error is not None:
                    return await on_retry_error(err)
                raise err from None

        return await self._failover(method, self.timeout if timeout is None else timeout, attempt)

    async def _failover(self, method: str, budget: float, attempt: Callable[[int, str, float], Awaitable[T]]) -> T:
        """The failover schedule shared by unary calls and watch opening, run
        by tenacity: ``attempt(k, address, share)`` on the addresses in
        rotation (from the one that answered last), each given a share of
        the time left split over the addresses not yet tried this round,
        until one answers or ``budget`` is spent; after each whole round
        that failed, a short backoff. ``attempt`` raises TryNext to move on;
        any other error ends the call at once."""
        deadline = time.monotonic() + budget
        n = len(self.addresses)
        start = self._current
        counter = itertools.count()
        failed: list[TryNext] = []

        async def once() -> T:
            k = next(counter)
            index = (start + k) % n
            address = self.addresses[index]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TryNext(address)
            share = max(remaining / (n - k % n), min(MIN_ATTEMPT_S, remaining))
            try:
                result = await attempt(k, address, share)
            except TryNext as exc:
                failed.append(exc)
                if self._fail_fast and k % n == n - 1 \
                        and all(not_connected(f, tls=self.connection.tls_dir is not None) for f in failed[-n:]):
                    raise NoConnection() from None  # retrying cannot help: say so now
                raise
            self._current = index
            return result

        retrying = AsyncRetrying(
            stop=until(deadline),
            wait=round_backoff(n, deadline),
            retry=retry_if_exception_type(TryNext),
            reraise=True,
        )
        try:
            return await retrying(once)
        except (TryNext, NoConnection):
            raise exhausted(method, budget, failed, self.addresses, tls=self._tls is not None,
                            token=self._token is not None, why=await self._why_refused(failed)) from None

    async def _why_refused(self, failed: Sequence[TryNext]) -> str:
        """Under TLS, when the last address failed the handshake: which
        check the server's certificate failed (probe_server), else ""."""
        last = next((f for f in reversed(failed) if f.error is not None), None)
        if self._tls is None or last is None or last.error is None or last.error.code() != grpc.StatusCode.UNAVAILABLE \
                or not looks_like_handshake(last.error.details() or ""):
            return ""
        files, cluster = self._tls
        refusal = await asyncio.to_thread(probe_server, last.address, files, cluster=cluster, now=utc_now())
        return str(refusal) if refusal is not None else ""

    # -- API --

    async def submit(self, spec: SpecLike, idempotency_key: str | None = None) -> SubmitResult:
        """Validate ``spec`` locally (raises InvalidSpec, nothing is sent), then
        submit it. Returns once the gang is durable in etcd."""
        domain = to_spec(spec)
        if not idempotency_key:
            import uuid  # here: only a submission needs it (docs/cli.md "Start-up time")

            idempotency_key = str(uuid.uuid4())
        request = gang_pb2.SubmitGangRequest(spec=spec_to_pb(domain), idempotency_key=idempotency_key)
        response: gang_pb2.SubmitGangResponse = await self._call("SubmitGang", request)
        return SubmitResult(gang=response.gang, created=response.created)

    async def get(self, id: str) -> pb.Gang:
        """The gang with this id; for a name, the live gang of that name,
        else the newest kept (finished, not yet collected) one."""
        return await self._call("GetGang", gang_pb2.GetGangRequest(id=id))

    async def list(
        self,
        states: Collection[StateLike] | StateLike | None = None,
        queue: str = "",
        owner_az: str = "",
        name_prefix: str = "",
        limit: int = 0,
    ) -> list[pb.Gang]:
        """Gangs matching every given filter (``limit`` 0: the server's default;
        at most MAX_LIMIT, the wire's int32)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= MAX_LIMIT:
            raise ValueError(f"limit must be an integer between 0 and {MAX_LIMIT}, got {limit!r}")
        request = gang_pb2.ListGangsRequest(
            states=[int(s) for s in sorted(parse_states(states))],
            queue=queue,
            owner_az=owner_az,
            name_prefix=name_prefix,
            limit=limit,
        )
        # A reply carries a bounded number of bytes; follow the pages. A
        # coordinator older than paging sends no token: one page is all.
        gangs: list[pb.Gang] = []
        while True:
            response: gang_pb2.ListGangsResponse = await self._call("ListGangs", request)
            gangs.extend(response.gangs)
            if not response.next_page_token:
                return gangs
            request.page_token = response.next_page_token

    async def watch(self, id: str) -> AsyncIterator[pb.Gang]:
        """Yield the gang now, then on every change, until it is terminal.

        If the stream breaks (coordinator gone, or it ended the stream before
        the gang was terminal), the watch resumes on the next address; changes
        already delivered are not repeated (events are ordered by etcd
        revision). Each (re)connection must deliver its first event within
        ``timeout``; there is no overall deadline, a watch lasts as long as the
        gang does. A coordinator that hangs mid-stream (SIGSTOP) without
        closing its connection is not detected (no keepalive pings: servers
        punish clients that ping more often than they allow)."""
        last_revision = -1
        pause = BACKOFF_START_S
        while True:
            call, event = await self._open_watch(id)
            try:
                while event is not grpc.aio.EOF:
                    revision = event.revision or event.gang.mod_revision
                    if not revision or revision > last_revision:
                        last_revision = max(last_revision, revision)
                        pause = BACKOFF_START_S
                        yield event.gang
                    if is_terminal(event.gang):
                        return
                    try:
                        event = await call.read()
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() not in RESUMABLE or self._closed:
                            raise translate(exc, self.last_address) from None
                        break
            finally:
                call.cancel()
            # Paced, so a server that keeps ending streams early is not spun on.
            await asyncio.sleep(pause)
            pause = min(pause * 2, BACKOFF_MAX_S)

    async def watch_events(self, id: str, after_seq: int = 0) -> AsyncIterator[pb.GangEventRecord]:
        """Yield the gang's events (``Gang.events``, docs/events.md) with a
        ``seq`` above ``after_seq``, oldest first: those recorded so far, then
        each new one as the gang's record changes, until the gang is
        terminal. Built on ``watch``, so it resumes the same way. A
        ``dropped`` marker is yielded when events were dropped (the bound)
        before this reader saw them."""
        last = after_seq
        async for gang in self.watch(id):
            for e in gang.events:
                if e.seq > last:
                    last = e.seq
                    yield e

    async def watch_cluster_events(self, queue: str = "", on_open: Callable[[], None] | None = None,
                                   on_gap: Callable[[int], None] | None = None
                                   ) -> AsyncIterator[gang_pb2.ClusterEvent]:
        """Yield every gang event recorded from now on, of every queue or of
        ``queue``, as ``ClusterEvent`` (the gang's id, name and queue, and the
        event), in etcd order (so each gang's in ``seq`` order); only the
        gangs this caller may see. Never ends by itself. ``on_open`` is
        called each time the stream is open (events from then on reach it).
        If the stream breaks it is reopened on the next address, with the
        same failover rules as ``watch``, after the last revision received:
        events recorded while it was closed are sent when that coordinator
        still holds them (docs/events.md "Bounds and resume"; each gang's
        ``watch_events`` has its history). When it no longer does,
        ``on_gap`` is called with the revision asked for: events recorded
        after it and before the reopen are not sent."""
        pause = BACKOFF_START_S
        after = 0  # the last revision whose events all arrived
        newest, at_newest = 0, set[tuple[str, int]]()  # the newest revision received, and its events
        while True:
            call = await self._open_cluster_events(queue, after)
            if after and on_gap is not None and dict(await call.initial_metadata()).get(_RESUME_HEADER) == "gap":
                on_gap(after)
            if on_open is not None:
                on_open()
            try:
                while True:
                    try:
                        event = await call.read()
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() not in RESUMABLE or self._closed:
                            raise translate(exc, self.last_address) from None
                        break
                    if event is grpc.aio.EOF:
                        break
                    pause = BACKOFF_START_S
                    if event.revision:
                        # Events of one revision come together: a resume asks
                        # again for the last one, whose events already here are skipped.
                        key = (event.gang_id, event.event.seq)
                        if event.revision < newest or (event.revision == newest and key in at_newest):
                            continue
                        if event.revision > newest:
                            newest, at_newest = event.revision, set()
                        at_newest.add(key)
                        after = newest - 1
                    yield event
            finally:
                call.cancel()
            await asyncio.sleep(pause)
            pause = min(pause * 2, BACKOFF_MAX_S)

    async def _open_cluster_events(self, queue: str, after: int = 0) -> Any:
        """Open a WatchEvents stream and wait for its headers (sent once the
        coordinator has read where every gang stands), with the same
        failover and deadline rules as a unary call."""

        async def attempt(_k: int, address: str, share: float) -> Any:
            call = self._stub(address).WatchEvents(gang_pb2.WatchEventsRequest(queue=queue, after_revision=after))
            try:
                await asyncio.wait_for(call.initial_metadata(), timeout=share)
            except asyncio.TimeoutError:
                call.cancel()
                raise TryNext(address) from None
            except BaseException:
                call.cancel()
                raise
            if call.done():
                # Refused before it opened (authorization, a bad queue): the
                # status says why; a resumable one tries the next address.
                code = await call.code()
                if code != grpc.StatusCode.OK:
                    exc = grpc.aio.AioRpcError(code, await call.initial_metadata(), await call.trailing_metadata(),
                                               details=await call.details())
                    if code in RESUMABLE and not self._closed:
                        raise TryNext(address, exc)
                    raise translate(exc, address)
            return call

        return await self._failover("WatchEvents", self.timeout, attempt)

    async def _open_watch(self, id: str) -> tuple[Any, gang_pb2.GangEvent]:
        """Open a WatchGang stream and read its first event, with the same
        failover and deadline rules as a unary call."""

        async def attempt(_k: int, address: str, share: float) -> tuple[Any, gang_pb2.GangEvent]:
            call = self._stub(address).WatchGang(gang_pb2.WatchGangRequest(id=id))
            try:
                event = await asyncio.wait_for(call.read(), timeout=share)
            except asyncio.TimeoutError:
                call.cancel()
                raise TryNext(address) from None
            except grpc.aio.AioRpcError as exc:
                if exc.code() in RESUMABLE and not self._closed:
                    raise TryNext(address, exc) from None
                raise translate(exc, address) from None
            except BaseException:
                call.cancel()
                raise
            if event is grpc.aio.EOF:
                raise TryNext(address)  # closed with OK before any event: ask someone else
            return call, event

        return await self._failover("WatchGang", self.timeout, attempt)

    async def wait(self, id: str, states: Collection[StateLike] | StateLike, timeout: float) -> pb.Gang:
        """Return the gang as soon as it is in one of ``states``.

        Raises ``TimeoutError`` after ``timeout`` seconds, and
        :class:`TerminalStateReached` as soon as the gang reaches a terminal
        state (SUCCEEDED, FAILED, CANCELLED) that is not among ``states`` —
        the wanted state can then never come, so there is nothing to wait for."""
        wanted = parse_states(states)
        if not wanted:
            raise ValueError("wait needs at least one state")
        wanted_ints = {int(s) for s in wanted}
        last: pb.Gang | None = None

        async def follow() -> pb.Gang:
            nonlocal last
            agen = self.watch(id)
            try:
                async for gang in agen:
                    last = gang
                    if gang.state in wanted_ints:
                        return gang
                    if is_terminal(gang):
                        raise TerminalStateReached(gang, wanted)
            finally:
                await agen.aclose()
            # watch only ends on a terminal gang, handled above.
            raise PhalanxError(f"watch of gang {id} ended unexpectedly")

        try:
            return await asyncio.wait_for(follow(), timeout=timeout)
        except asyncio.TimeoutError:
            now = f" (now {state_name(last)})" if last is not None else ""
            want = " or ".join(sorted(s.name for s in wanted))
            raise TimeoutError(f"gang {id} did not reach {want} within {timeout:g}s{now}") from None

    async def cancel(self, id: str, reason: str = "") -> pb.Gang:
        """Cancel a gang (whole-gang teardown). Returns the gang as updated.

        A cancel that races another write of the gang (admission placing it
        at that moment) loses its compare and is answered ABORTED; it is
        retried (tenacity, within this call's deadline) until it takes
        effect, so a returned cancel has happened."""
        deadline = time.monotonic() + self.timeout
        request = gang_pb2.CancelGangRequest(id=id, reason=reason)
        tries = itertools.count()

        async def already_done(err: PhalanxError) -> pb.Gang:
            # A retry whose first attempt did land sees a finished gang: that
            # is our own cancel succeeding, not an error.
            if isinstance(err, FailedPrecondition):
                gang = await self.get(id)
                if gang.state == int(GangState.CANCELLED):
                    return gang
            raise err

        async def once() -> pb.Gang:
            retried = next(tries) > 0
            return await self._call(
                "CancelGang", request, timeout=max(deadline - time.monotonic(), 1e-3),
                retried=retried, on_retry_error=already_done,
            )

        retrying = AsyncRetrying(
            stop=until(deadline),
            wait=conflict_backoff(deadline),
            retry=retry_if_exception_type(Conflict),
            reraise=True,
        )
        return await retrying(once)

    async def explain(self, id: str) -> gang_pb2.ExplainGangResponse:
        """Why a gang is where it is: a summary and, when it cannot be placed,
        the shortfall in each candidate domain."""
        return await self._call("ExplainGang", gang_pb2.ExplainGangRequest(id=id))

    async def nodes(self, az: str = "") -> list[pb.NodeStatus]:
        response: gang_pb2.ListNodesResponse = await self._call("ListNodes", gang_pb2.ListNodesRequest(az=az))
        return list(response.nodes)

    async def status(self) -> gang_pb2.ClusterStatusResponse:
        """Each AZ's leader, epoch and capacity; gang counts by state."""
        return await self._call("ClusterStatus", gang_pb2.ClusterStatusRequest())

    # -- node lifecycle (docs/nodes.md), admin only --

    async def cordon(self, az: str, node: str, cordoned: bool = True) -> pb.NodeStatus:
        """Cordon ``node`` of ``az`` (nothing new is placed on it, what runs
        there stays), or uncordon it with ``cordoned=False``."""
        return await self._call("CordonNode", gang_pb2.CordonNodeRequest(az=az, node=node, cordoned=cordoned))

    async def drain(self, az: str, node: str, *, requeue: bool = False, timeout: float = 300.0) -> gang_pb2.DrainNodeResponse:
        """Cordon the node and, with ``requeue``, restart its gangs on other
        nodes (else let them finish); then wait until it holds no devices
        or ``timeout`` s pass. The last answer: ``gangs`` is empty when the
        node holds no devices, else it names those still there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        answer = await self._call("DrainNode", gang_pb2.DrainNodeRequest(az=az, node=node, requeue=requeue))
        requeued = list(answer.requeued)
        pause = BACKOFF_START_S
        while answer.gangs and loop.time() + pause < deadline:
            await asyncio.sleep(pause)
            pause = min(pause * 2, BACKOFF_MAX_S)
            answer = await self._call("DrainNode", gang_pb2.DrainNodeRequest(az=az, node=node))
        del answer.requeued[:]
        answer.requeued.extend(requeued)
        return answer

    async def delete_node(self, az: str, node: str, *, force: bool = False) -> list[str]:
        """Remove the node's record; FailedPrecondition naming the gangs
        while it holds devices, unless ``force``. The gangs that held its
        devices (``force`` only). A live agent registers it again."""
        response = await self._call("DeleteNode", gang_pb2.DeleteNodeRequest(az=az, node=node, force=force))
        return list(response.gangs)

    # -- the policy (docs/security.md "Policy as data") --

    async def get_policy(self) -> tuple[dict[str, Any], gang_pb2.PolicyRecord]:
        """The cluster's policy (defaults filled in) and its record
        (``revision``: pass it to set_policy; 0 when none is stored)."""
        record = await self._call("GetPolicy", gang_pb2.GetPolicyRequest())
        return json.loads(record.policy_json), record

    async def set_policy(self, policy: Mapping[str, Any], expected_revision: int) -> gang_pb2.PolicyRecord:
        """Replace the policy (admin only), if it is still at
        ``expected_revision`` (from get_policy; 0: none stored yet);
        FailedPrecondition when someone changed it since."""
        request = gang_pb2.SetPolicyRequest(policy_json=json.dumps(dict(policy), sort_keys=True),
                                            expected_revision=expected_revision)
        return await self._call("SetPolicy", request)

    async def close(self) -> None:
        self._closed = True
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        for channel in channels:
            await channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
