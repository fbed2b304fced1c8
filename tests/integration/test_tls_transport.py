"""phalanx.tls on a real gRPC server on loopback, with certificates made by
phalanx.certs: who gets in, and a certificate renewed on disk is served by
the next connection without a restart.

The server is a grpc.aio server with the standard health service plus a
one-method ``Whoami`` that answers the caller's identity as
``phalanx.tls.peer_identity`` reads it.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from phalanx import certs, tls
from phalanx.certs import IdentityError

pytestmark = pytest.mark.integration
CLUSTER = "tls-test"
WHOAMI = "/phalanx.test.Whoami/Get"


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    certs.init_ca(d, CLUSTER, now=now())
    certs.issue(d, "coordinator", "co-1", now=now(), hosts=["127.0.0.1", "localhost"])
    certs.issue(d, "submitter", "alice", queues=["train"], now=now())
    return d


class Server:
    def __init__(self, files: tls.TlsFiles) -> None:
        self.source = tls.ServerCredentialsSource(files, cluster=CLUSTER)
        self.server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), self.server)
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "phalanx.test.Whoami", {"Get": grpc.unary_unary_rpc_method_handler(self.whoami)})])
        self.port = self.server.add_secure_port("127.0.0.1:0", self.source.credentials())
        self.target = f"127.0.0.1:{self.port}"

    async def whoami(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            ident = tls.peer_identity(context, cas=self.source.current.cas, cluster=CLUSTER, now=now())
        except IdentityError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return json.dumps({"uri": ident.uri(), "role": ident.role, "name": ident.name, "queues": list(ident.queues)}).encode()


@pytest.fixture
async def server(pki: Path):
    s = Server(tls.TlsFiles.issued(pki, "coordinator", "co-1"))
    await s.server.start()
    try:
        yield s
    finally:
        await s.server.stop(None)


async def check(channel: grpc.aio.Channel) -> health_pb2.HealthCheckResponse:
    async with channel:
        return await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)


async def refused(channel: grpc.aio.Channel) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await check(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    return info.value


def raw_credentials(ca: Path, cert: Path, key: Path) -> grpc.ChannelCredentials:
    """Credentials straight from files, none of phalanx.tls's own checks:
    what a client that skips them presents."""
    return grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), cert.read_bytes())


async def test_a_client_with_a_certificate_of_this_ca_gets_in_as_its_identity(server: Server, pki: Path) -> None:
    files = tls.TlsFiles.issued(pki, "submitter", "alice")
    assert (await check(tls.secure_channel(server.target, files, cluster=CLUSTER))).status == health_pb2.HealthCheckResponse.SERVING
    async with tls.secure_channel(server.target, files, cluster=CLUSTER) as channel:
        answer = json.loads(await channel.unary_unary(WHOAMI)(b"", timeout=10))
    assert answer == {"uri": f"phalanx://{CLUSTER}/submitter/alice?queues=train", "role": "submitter",
                      "name": "alice", "queues": ["train"]}


async def test_a_plaintext_client_is_refused(server: Server) -> None:
    await refused(grpc.aio.insecure_channel(server.target))


async def test_tls_without_a_client_certificate_is_refused(server: Server, pki: Path) -> None:
    await refused(grpc.aio.secure_channel(server.target, grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes())))


async def test_a_certificate_of_another_ca_is_refused(server: Server, pki: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    certs.init_ca(other, CLUSTER, now=now())  # same cluster name, another CA
    crt, key, _ = certs.issue(other, "admin", "mallory", now=now())
    # phalanx.tls refuses it before connecting, naming the file and the check ...
    with pytest.raises(tls.TlsError) as info:
        tls.channel_credentials(tls.TlsFiles(pki / "ca.crt", crt, key), cluster=CLUSTER)
    assert info.value.check == certs.CHECK_UNKNOWN_CA and info.value.path == str(crt)
    # ... and the server refuses it at the handshake.
    await refused(grpc.aio.secure_channel(server.target, raw_credentials(pki / "ca.crt", crt, key)))


async def test_an_expired_client_certificate_is_refused(server: Server, pki: Path) -> None:
    crt, key, cert = certs.issue(pki, "admin", "old", now=now(), not_before=now() - datetime.timedelta(days=3), days=1)
    assert cert.not_valid_after_utc < now()
    with pytest.raises(tls.TlsError) as info:
        tls.channel_credentials(tls.TlsFiles(pki / "ca.crt", crt, key), cluster=CLUSTER)
    assert info.value.check == certs.CHECK_EXPIRED and info.value.path == str(crt)
    await refused(grpc.aio.secure_channel(server.target, raw_credentials(pki / "ca.crt", crt, key)))


async def test_a_client_checks_the_coordinator_name_whatever_address_it_dials(pki: Path) -> None:
    # The certificate names another host only; the client dials 127.0.0.1
    # and still gets in: what it checks is coordinators.<cluster>.phalanx.invalid.
    certs.issue(pki, "coordinator", "co-far", now=now(), hosts=["coordinator.example"])
    s = Server(tls.TlsFiles.issued(pki, "coordinator", "co-far"))
    await s.server.start()
    try:
        client = tls.TlsFiles.issued(pki, "submitter", "alice")
        assert (await check(tls.coordinator_channel(s.target, client, cluster=CLUSTER))).status == health_pb2.HealthCheckResponse.SERVING
        assert await asyncio.to_thread(tls.probe_server, s.target, client, cluster=CLUSTER, now=now()) is None
    finally:
        await s.server.stop(None)


async def raw_server(crt: Path, key: Path, ca: Path) -> tuple[grpc.aio.Server, str]:
    """A TLS server presenting any certificate (ServerCredentialsSource
    refuses to serve with a non-coordinator one)."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    creds = grpc.ssl_server_credentials([(key.read_bytes(), crt.read_bytes())], root_certificates=ca.read_bytes(),
                                        require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_a_server_presenting_a_non_coordinator_certificate_of_the_same_ca_is_refused(pki: Path) -> None:
    crt, key, _ = certs.issue(pki, "agent", "n1", node="n1", now=now())
    with pytest.raises(tls.TlsError) as info:
        tls.ServerCredentialsSource(tls.TlsFiles(pki / "ca.crt", crt, key), cluster=CLUSTER)
    assert info.value.check == certs.CHECK_WRONG_USE and info.value.path == str(crt)
    client = tls.TlsFiles.issued(pki, "submitter", "alice")
    for role, name, extra in (("agent", "n1", {"node": "n1"}), ("submitter", "alice", {})):
        server, target = await raw_server(*certs.leaf_paths(pki, role, name), pki / "ca.crt")
        try:
            error = await refused(tls.coordinator_channel(target, client, cluster=CLUSTER))
            assert error.code() == grpc.StatusCode.UNAVAILABLE and tls.looks_like_handshake(error.details() or "")
            why = await asyncio.to_thread(tls.probe_server, target, client, cluster=CLUSTER, now=now())
        finally:
            await server.stop(None)
        assert why is not None and why.check == certs.CHECK_WRONG_NAME and why.path == target, why
        assert f"phalanx://{CLUSTER}/{role}/{name}" in str(why)


async def test_a_coordinator_certificate_of_another_ca_is_refused_and_named(pki: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    certs.init_ca(other, CLUSTER, now=now())
    crt, key, _ = certs.issue(other, "coordinator", "co-1", now=now())
    server, target = await raw_server(crt, key, pki / "ca.crt")
    client = tls.TlsFiles.issued(pki, "submitter", "alice")
    try:
        await refused(tls.coordinator_channel(target, client, cluster=CLUSTER))
        why = await asyncio.to_thread(tls.probe_server, target, client, cluster=CLUSTER, now=now())
    finally:
        await server.stop(None)
    assert why is not None and why.check == certs.CHECK_UNKNOWN_CA, why


def served_serial(port: int, pki: Path) -> int:
    """The serial of the certificate the server presents to a new connection
    (a plain TLS handshake with a client certificate, as gRPC clients make)."""
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    client = tls.TlsFiles.issued(pki, "submitter", "alice")
    context.load_cert_chain(client.cert, client.key)
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with context.wrap_socket(sock, server_hostname="127.0.0.1") as conn:
            der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def test_a_server_certificate_renewed_on_disk_is_served_to_the_next_connection(server: Server, pki: Path) -> None:
    client = tls.TlsFiles.issued(pki, "submitter", "alice")
    first = await asyncio.to_thread(served_serial, server.port, pki)
    assert first == server.source.current.cert.serial_number
    assert (await check(tls.secure_channel(server.target, client, cluster=CLUSTER))).status == health_pb2.HealthCheckResponse.SERVING

    _, _, renewed = certs.issue(pki, "coordinator", "co-1", now=now(), hosts=["127.0.0.1", "localhost"])
    assert renewed.serial_number != first
    assert await asyncio.to_thread(served_serial, server.port, pki) == renewed.serial_number
    assert server.source.current.cert.serial_number == renewed.serial_number
    # gRPC clients get in through the renewed certificate too.
    assert (await check(tls.secure_channel(server.target, client, cluster=CLUSTER))).status == health_pb2.HealthCheckResponse.SERVING


async def test_a_refused_renewal_keeps_the_current_certificate(server: Server, pki: Path) -> None:
    """A renewal seen half-way (a new certificate, the old key) is refused,
    named, and the server keeps serving what it had; the completed renewal
    is then picked up."""
    files = tls.TlsFiles.issued(pki, "coordinator", "co-1")
    first = server.source.current.cert.serial_number
    old_key = files.key.read_bytes()
    _, _, renewed = certs.issue(pki, "coordinator", "co-1", now=now(), hosts=["127.0.0.1"])
    new_key = files.key.read_bytes()
    files.key.write_bytes(old_key)  # the new certificate beside the old key
    assert await asyncio.to_thread(served_serial, server.port, pki) == first
    assert server.source.last_error is not None and server.source.last_error.check == "key mismatch"
    assert server.source.last_error.path == str(files.key)
    files.key.write_bytes(new_key)
    assert await asyncio.to_thread(served_serial, server.port, pki) == renewed.serial_number
    assert server.source.last_error is None


def test_a_server_does_not_start_with_a_client_only_certificate(pki: Path) -> None:
    with pytest.raises(tls.TlsError) as info:
        tls.ServerCredentialsSource(tls.TlsFiles.issued(pki, "submitter", "alice"), cluster=CLUSTER)
    assert info.value.check == certs.CHECK_WRONG_USE
    with pytest.raises(tls.TlsError) as info:
        tls.ServerCredentialsSource(tls.TlsFiles.issued(pki, "coordinator", "co-1"), cluster="another")
    assert info.value.check == certs.CHECK_WRONG_CLUSTER
    with pytest.raises(tls.TlsError) as info:
        tls.ServerCredentialsSource(tls.TlsFiles(pki / "ca.crt", pki / "nope.crt", pki / "nope.key"), cluster=CLUSTER)
    assert info.value.check == "cannot read" and info.value.path == str(pki / "nope.crt")
