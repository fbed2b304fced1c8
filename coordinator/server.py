"""One coordinator replica: gRPC server + election loop (docs/design.md §2.2).

Serves GangService (reads from etcd; writes at the leader, forwarded by
standbys), AgentService (leader only), CoordinatorPeer (cross-AZ, issue 3),
standard health checking and server reflection. Campaigns for its AZ's leader
key and runs an ``AzLeader`` while it holds it; on losing it, steps down and
campaigns again with a fresh lease.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.agents import AgentServicer
from coordinator.config import CoordinatorConfig
from coordinator.core.authz import Policy
from coordinator.election import Election, LeaseLost, LeaseSession
from coordinator.leader import AzLeader
from coordinator.etcd_space import EtcdSpaceWatch
from coordinator.broadcast import Broadcaster
from coordinator.throttle import Throttle
from coordinator.metrics import CoordinatorMetrics
from coordinator.policy_store import PolicyCache
from coordinator.service import GangServicer
from phalanx.store import Store, StoreUnavailable, jitter
from coordinator.tokens import TokenSource
from coordinator.peer_service import PeerServicer
from coordinator.undecodable import UndecodableRequests
from phalanx.errors import NotLeader
from phalanx import etcd_version, metrics as metrics_http
from phalanx.tls import ServerCredentialsSource, TlsError, TlsFiles, coordinator_channel
from phalanx.v1 import agent_pb2, agent_pb2_grpc, gang_pb2, gang_pb2_grpc, peer_pb2, peer_pb2_grpc

log = logging.getLogger(__name__)


PLAINTEXT_WARNING = ("--insecure: serving plaintext (no --tls-dir): anyone who reaches this port can submit and "
                     "cancel gangs or pose as an agent or a peer")
ETCD_PLAINTEXT_WARNING = ("--insecure: reaching etcd in plaintext (no --etcd-tls-dir): anyone who reaches etcd can "
                          "read and rewrite this cluster's state")


class Coordinator:
    """``tls``: this coordinator's certificate files (``--tls-dir``). With
    them every service is served only over TLS with client certificates from
    the CA, and peer and forward channels present the same certificate and
    accept only a coordinator certificate of this cluster; None: plaintext
    (``--insecure``, warned about at start). ``etcd_tls``: the etcd client
    files (``--etcd-tls-dir``); None: etcd in plaintext (``--insecure``,
    warned about too). ``policy``: what GangService allows each role
    (``--policy``): the first policy record in etcd when there is none, and
    what applies while there is none; enforced only with TLS, where callers
    have identities. ``config.token_file``: bearer tokens, taken on the
    second TLS port ``config.token_listen`` (``token_address``). It is the
    ``ServingContext`` (coordinator/serving.py) of the servicers it builds."""

    def __init__(self, config: CoordinatorConfig, tls: TlsFiles | None = None, policy: Policy | None = None,
                 etcd_tls: TlsFiles | None = None):
        self.config = config.validate()
        self.tls = tls
        self.etcd_tls = etcd_tls
        self.policy = policy or Policy()
        self.tls_source: ServerCredentialsSource | None = None
        # This process's own metrics (coordinator/metrics.py), served at
        # config.metrics_listen once started (metrics_address).
        self.metrics = CoordinatorMetrics(metrics_http.new_registry(), az=config.az)
        self.metrics_server: metrics_http.MetricsServer | None = None
        self.metrics_address = ""
        self.store = Store(list(config.etcd), config.cluster, tls=etcd_tls, timeout=config.timings.etcd_timeout_s,
                           metrics=self.metrics)
        self.policies = PolicyCache(self.store, config.timings.policy_max_staleness_s, initial=policy,
                                    initial_source=f"--policy {config.policy_file}" if policy is not None else "")
        self.tokens: TokenSource | None = None
        self.token_address = ""
        self.leader: AzLeader | None = None
        self.address = ""
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._stopping = asyncio.Event()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.wall = time.time
        self.leader_changes = 0
        self.space_watch = EtcdSpaceWatch(self.store, config.etcd_quota_bytes, config.timings.etcd_space_poll_s,
                                          self.metrics, compact_retention_s=config.etcd_compact_retention_s,
                                          leading=lambda: self.leader is not None)
        self._space_task: asyncio.Task[None] | None = None
        # The one etcd watch every WatchEvents/WatchGang stream is fed from.
        self.fanout = Broadcaster(self.store, config.watch, self.metrics)
        self.throttle = Throttle(config.rates, self.metrics)
        self._version_task: asyncio.Task[str] | None = None

    def peer_channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            opts = [("grpc.max_receive_message_length", 8 * 1024 * 1024)]
            # A cached channel keeps the certificate it was made with; a
            # renewal on disk is used by channels made after it.
            if self.tls is not None:
                ch = coordinator_channel(address, self.tls, cluster=self.config.cluster, options=opts)
            else:
                ch = grpc.aio.insecure_channel(address, options=opts)
            self._channels[address] = ch
        return ch

    async def start(self) -> str:
        if self.tls is not None:
            # Before anything else: unusable files stop the start (TlsError
            # names the file and the check).
            self.tls_source = ServerCredentialsSource(self.tls, cluster=self.config.cluster)
            own = self.tls_source.current.identity
            if own.az is not None and own.az != self.config.az:
                # Peers would refuse every call it makes for its own AZ.
                raise TlsError(self.tls.cert, "wrong AZ", f"the certificate is bound to AZ {own.az!r}; "
                               f"this coordinator serves --az {self.config.az!r}")
            if self.config.token_file:
                self.tokens = TokenSource(self.config.token_file, cluster=self.config.cluster)
        else:
            log.warning(PLAINTEXT_WARNING)
        if self.etcd_tls is None:
            log.warning(ETCD_PLAINTEXT_WARNING)
        await self.store.connect()
        # One line about etcd's version and its advisories, once etcd answers.
        self._version_task = asyncio.create_task(etcd_version.report(
            self.store, who=f"coordinator {self.config.coordinator_id}", retry_s=self.config.timings.etcd_space_poll_s))
        await self.policies.seed()
        self.fanout.start()
        opts = [
            ("grpc.max_receive_message_length", self.config.max_request_bytes),
            ("grpc.so_reuseport", 0),
        ]
        # (malformed request bytes: INVALID_ARGUMENT, not grpc's UNKNOWN)
        server = grpc.aio.server(options=opts, interceptors=[UndecodableRequests()])
        gang_pb2_grpc.add_GangServiceServicer_to_server(GangServicer(self), server)
        agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentServicer(self), server)
        peer_pb2_grpc.add_CoordinatorPeerServicer_to_server(PeerServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [
            gang_pb2.DESCRIPTOR.services_by_name["GangService"].full_name,
            agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
            peer_pb2.DESCRIPTOR.services_by_name["CoordinatorPeer"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, server)
        try:
            if self.tls_source is not None:
                port = server.add_secure_port(self.config.listen, self.tls_source.credentials())
                if self.tokens is not None:
                    # No client certificate is asked for on this port, so
                    # only GangService calls with a bearer token pass there.
                    tport = server.add_secure_port(self.config.token_listen,
                                                   self.tls_source.credentials(require_client_auth=False))
                    if tport == 0:
                        raise OSError(f"cannot listen on --token-listen {self.config.token_listen}")
                    self.token_address = f"{self.config.token_listen.rsplit(':', 1)[0]}:{tport}"
            else:
                port = server.add_insecure_port(self.config.listen)
        except RuntimeError as exc:  # grpc >= 1.58 raises instead of returning 0
            raise OSError(f"cannot listen on {self.config.listen}: {' '.join(str(exc).split(';')[0].split())}") from None
        if port == 0:
            raise OSError(f"cannot listen on {self.config.listen}")
        host = self.config.listen.rsplit(":", 1)[0]
        self.address = self.config.advertise or f"{host}:{port}"
        await server.start()
        self.server = server
        # Same TLS rules as the gRPC ports: with --tls-dir only HTTPS with a
        # client certificate of the cluster's CA (phalanx/metrics.py).
        try:
            self.metrics_server, self.metrics_address = metrics_http.serve(
                self.config.metrics_listen, self.metrics.registry, tls=self.tls, cluster=self.config.cluster,
                handshake_timeout_s=self.config.timings.metrics_handshake_timeout_s)
        except OSError as exc:  # taken, or a host that does not resolve
            await server.stop(grace=None)
            raise OSError(f"--metrics-listen {self.config.metrics_listen}: cannot serve: {exc.strerror or exc}") from None
        if self.metrics_server is not None:
            log.info("metrics at %s", self.metrics_server.url)
        self._space_task = asyncio.create_task(self.space_watch.run(self._stopping))
        await self._set_health(serving=True)
        return self.address

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for svc in ("", "phalanx.v1.GangService"):
            r = self.health.set(svc, status)
            if asyncio.iscoroutine(r):
                await r

    async def run(self) -> None:
        """Campaign, lead, step down, repeat — until ``stop()``."""
        t = self.config.timings
        election = Election(self.store, self.config.az, self.config.coordinator_id, self.address, t)
        while not self._stopping.is_set():
            session = LeaseSession(self.store, t, metrics=self.metrics)
            try:
                await session.start()
            except StoreUnavailable as exc:
                log.info("cannot start a lease session: %s", exc)
                await self._sleep(jitter(t.campaign_retry_s * 2))
                continue
            leader_info = None
            try:
                campaign = asyncio.create_task(election.campaign(session))
                stop = asyncio.create_task(self._stopping.wait())
                done, _ = await asyncio.wait({campaign, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if campaign not in done:
                    campaign.cancel()
                    await asyncio.gather(campaign, return_exceptions=True)
                    break
                leader_info = campaign.result()
                self.leader_changes += 1
                self.metrics.leading(leader_info.epoch)
                log.info("%s leads %s with epoch %d", self.config.coordinator_id, self.config.az, leader_info.epoch)
                leader = AzLeader(self.store, self.config, leader_info, session, peer_channel=self.peer_channel,
                                  metrics=self.metrics)
                self.leader = leader
                lead = asyncio.create_task(leader.run())
                # The record we lead by must stay the one we wrote (docs/design.md §5).
                guard = asyncio.create_task(election.guard(session, leader_info))
                stop = asyncio.create_task(self._stopping.wait())
                done, _ = await asyncio.wait({lead, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                guard.cancel()
                if lead not in done:
                    lead.cancel()
                await asyncio.gather(lead, guard, return_exceptions=True)
                exc = lead.exception() if lead.done() and not lead.cancelled() else None
                if exc is not None:
                    log.warning("%s steps down in %s: %r", self.config.coordinator_id, self.config.az, exc)
            except (LeaseLost, NotLeader) as exc:
                log.warning("%s lost leadership of %s: %s", self.config.coordinator_id, self.config.az, exc)
            finally:
                self.leader = None
                self.metrics.not_leading()
                if leader_info is not None and self._stopping.is_set() and session.is_valid():
                    await election.resign(leader_info)
                await session.close(revoke=True)
            await self._sleep(jitter(t.campaign_retry_s))

    async def _sleep(self, s: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), s)
        except asyncio.TimeoutError:
            pass

    def stop(self) -> None:
        self._stopping.set()

    async def close(self) -> None:
        self._stopping.set()
        await self._set_health(serving=False)
        if self.server is not None:
            await self.server.stop(grace=1.0)
        for ch in self._channels.values():
            await ch.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        if self._version_task is not None:
            self._version_task.cancel()
            await asyncio.gather(self._version_task, return_exceptions=True)
        if self._space_task is not None:
            await asyncio.gather(self._space_task, return_exceptions=True)
        await self.fanout.close()
        await self.store.close()
