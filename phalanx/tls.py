"""gRPC credentials from certificate files, renewed without a restart
(docs/security.md).

A process names three files: the cluster's CA certificate (a bundle of
several during a CA rotation), its own certificate and its own key. Both
sides read them again when they change:

* a server (``ServerCredentialsSource``) gives gRPC a fetcher that gRPC calls
  before every new connection's handshake; the fetcher looks at the three
  files' stat and, when one changed, loads and checks them again and hands
  gRPC the new configuration. A renewal that does not pass the checks (a
  half-written pair, an expired certificate) is logged once, naming the file
  and the check, and the server keeps what it had.
* a client builds channel credentials from the current files for every new
  channel (``channel_credentials`` / ``coordinator_channel``).

Every client of a coordinator (the SDK and CLI, agents, a coordinator's
peer and forward channels) checks the server's certificate against
``coordinator_server_name(cluster)`` whatever address it dialed
(``coordinator_channel``): only a coordinator certificate of the cluster's CA
carries that name, so an agent or submitter certificate of the same CA
cannot pose as a coordinator. When a handshake fails, ``probe_server`` looks
at what the server presented and says which check failed.

Every check failure is a TlsError whose message names the file and the
check (``unknown CA``, ``expired``, ``wrong cluster``, ``wrong name``, ...).
Every process serves or dials TLS by default; plaintext only behind an
explicit ``--insecure`` (a warning at start-up).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import grpc

from phalanx.cert_names import CA_CERT, coordinator_server_name, leaf_paths

if TYPE_CHECKING:
    from cryptography import x509

    from phalanx.certs import Identity

# cryptography and phalanx.certs (which imports it) are imported where a
# certificate is parsed, not here: a client whose files passed before
# (phalanx/tls_check_cache.py) dials without them.

__all__ = [
    "TlsError", "TlsFiles", "Loaded", "load", "ServerCredentialsSource", "channel_credentials",
    "coordinator_channel", "coordinator_server_name", "secure_channel", "peer_identity", "probe_server",
    "etcd_files", "utc_now",
]

log = logging.getLogger("phalanx.tls")

Clock = Callable[[], datetime.datetime]
CHECK_BAD_PEER = "bad certificate"


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class TlsError(Exception):
    """A credential file that cannot be used: ``path`` is the file, ``check``
    the check that failed."""

    def __init__(self, path: Path | str, check: str, detail: str) -> None:
        super().__init__(f"{path}: {check}: {detail}")
        self.path = str(path)
        self.check = check
        self.detail = detail


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def issued(cls, directory: Path | str, role: str, name: str) -> "TlsFiles":
        """The files ``phalanx certs issue --dir D`` writes for ``role``/``name``."""
        d = Path(directory)
        cert, key = leaf_paths(d, role, name)
        return cls(d / CA_CERT, cert, key)

    def paths(self) -> tuple[Path, Path, Path]:
        return self.ca, self.cert, self.key


ETCD_CLIENT_CERT = "client.crt"
ETCD_CLIENT_KEY = "client.key"


def etcd_files(directory: Path | str) -> TlsFiles:
    """``--etcd-tls-dir E``: E/ca.crt (etcd's CA), E/client.crt and
    E/client.key (this process's etcd user), as ``phalanx certs etcd-user``
    writes them. TlsError names the first file that is missing."""
    d = Path(directory)
    files = TlsFiles(d / CA_CERT, d / ETCD_CLIENT_CERT, d / ETCD_CLIENT_KEY)
    for p in files.paths():
        if not p.is_file():
            raise TlsError(p, "cannot read", "no such file (phalanx certs etcd-user writes ca.crt, client.crt and client.key)")
    return files


@dataclass(frozen=True)
class Loaded:
    """Checked credential files, as gRPC wants them (PEM bytes)."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    cas: tuple[x509.Certificate, ...]
    cert: x509.Certificate
    identity: Identity


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsError(path, "cannot read", exc.strerror or str(exc)) from None


def read_key_pair(files: TlsFiles) -> tuple[bytes, bytes, bytes, tuple[x509.Certificate, ...], x509.Certificate]:
    """Read and parse the three files, and check the key is the
    certificate's: ``(ca_pem, cert_pem, key_pem, cas, cert)``, or TlsError
    naming the file and the check. What the certificate must then be is the
    caller's (a Phalanx identity here, an etcd user in phalanx.etcd_pki)."""
    return parse_key_pair(files, _read(files.ca), _read(files.cert), _read(files.key))


def parse_key_pair(files: TlsFiles, ca_pem: bytes, cert_pem: bytes, key_pem: bytes,
                   ) -> tuple[bytes, bytes, bytes, tuple[x509.Certificate, ...], x509.Certificate]:
    """``read_key_pair`` on bytes already read from ``files`` (named in errors)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cas = tuple(x509.load_pem_x509_certificates(ca_pem))
    except ValueError as exc:
        raise TlsError(files.ca, "not a PEM certificate", str(exc)) from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise TlsError(files.cert, "not a PEM certificate", str(exc)) from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TlsError(files.key, "not an unencrypted PEM key", str(exc)) from None
    if key.public_key() != cert.public_key():
        # Most often a renewal seen half-way: the new certificate with the old key.
        raise TlsError(files.key, "key mismatch", f"not the key of {files.cert}")
    return ca_pem, cert_pem, key_pem, cas, cert


def load(files: TlsFiles, *, cluster: str, use: str, now: datetime.datetime) -> Loaded:
    """Read and check the three files: the CA bundle parses, the certificate
    parses, the key is the certificate's, and the certificate is this
    cluster's CA's, valid at ``now``, for ``use`` ("client"/"server")."""
    return check_pems(files, _read(files.ca), _read(files.cert), _read(files.key), cluster=cluster, use=use, now=now)


def check_pems(files: TlsFiles, ca_pem: bytes, cert_pem: bytes, key_pem: bytes, *, cluster: str, use: str,
               now: datetime.datetime) -> Loaded:
    """``load`` on bytes already read from ``files`` (named in errors)."""
    from phalanx.certs import CHECK_WRONG_NAME, IdentityError, dns_names, identity_of

    ca_pem, cert_pem, key_pem, cas, cert = parse_key_pair(files, ca_pem, cert_pem, key_pem)
    try:
        identity = identity_of(cert, ca=cas, cluster=cluster, now=now, use=use)
    except IdentityError as exc:
        raise TlsError(files.cert, exc.check, f"{exc.detail} (CA: {files.ca})") from None
    if use == "server" and coordinator_server_name(cluster) not in dns_names(cert):
        # Every client checks this name: a server without it would be refused
        # by all of them, so it does not start.
        raise TlsError(files.cert, CHECK_WRONG_NAME, f"does not name {coordinator_server_name(cluster)}, the name every "
                       "client checks (issued by an older phalanx: issue it again with phalanx certs issue --role coordinator)")
    return Loaded(ca_pem, cert_pem, key_pem, cas, cert, identity)


def ca_pem_cluster(path: Path | str, ca_pem: bytes) -> str:
    """The cluster a phalanx CA (the first certificate of the bundle) is
    for; TlsError naming ``path`` and the check."""
    from cryptography import x509

    from phalanx.certs import CertError, ca_cluster

    try:
        return ca_cluster(x509.load_pem_x509_certificate(ca_pem))
    except ValueError as exc:  # CertError is a ValueError: a CA phalanx did not make
        raise TlsError(path, "not a PEM certificate" if not isinstance(exc, CertError) else "bad identity",
                       str(exc)) from None


def client_pems(files: TlsFiles, *, cluster: str | None = None,
                now: datetime.datetime | None = None) -> tuple[bytes, bytes, bytes, str]:
    """A client's three files as read now and the cluster its CA is for,
    checked as ``load(use="client")`` checks them (TlsError names the file
    and the check). ``cluster`` None: the CA's. The verdict on these exact
    bytes is remembered (phalanx/tls_check_cache.py): the next command
    with the same files inside the certificate's validity skips the X.509
    parse."""
    from phalanx import tls_check_cache as cache

    ca_pem, cert_pem, key_pem = _read(files.ca), _read(files.cert), _read(files.key)
    now = now or utc_now()
    path = cache.cache_path()
    key = cache.digest(ca_pem, cert_pem, key_pem, "client")
    entries = cache.read_entries(path)
    known = cache.verdict(entries, key, now)
    if known is not None and (cluster is None or cluster == known):
        return ca_pem, cert_pem, key_pem, known
    if cluster is None:
        cluster = ca_pem_cluster(files.ca, ca_pem)
    loaded = check_pems(files, ca_pem, cert_pem, key_pem, cluster=cluster, use="client", now=now)
    cache.write_entries(path, cache.remembered(entries, key, cluster, loaded.cert.not_valid_before_utc,
                                               loaded.cert.not_valid_after_utc, now))
    return ca_pem, cert_pem, key_pem, cluster


def _stat_key(files: TlsFiles) -> tuple[Any, ...]:
    """What changes when a file is replaced or rewritten."""
    out: list[Any] = []
    for p in files.paths():
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size, st.st_ctime_ns))
        except OSError as exc:
            out.append(("missing", exc.errno))
    return tuple(out)


class ServerCredentialsSource:
    """Server credentials that require a client certificate from the CA and
    follow the files on disk (see the module docstring). The first load
    raises TlsError: a server does not start with unusable credentials."""

    def __init__(self, files: TlsFiles, *, cluster: str, clock: Clock = utc_now) -> None:
        self.files = files
        self.cluster = cluster
        self.clock = clock
        self._lock = threading.Lock()
        self._seen = _stat_key(files)
        self.current = load(files, cluster=cluster, use="server", now=clock())
        self._refused: tuple[Any, ...] | None = None
        self.last_error: TlsError | None = None
        log.info("TLS: serving %s (serial %x, until %s)", self.current.identity.uri(),
                 self.current.cert.serial_number, self.current.cert.not_valid_after_utc.isoformat())

    def _config(self, loaded: Loaded) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(loaded.key_pem, loaded.cert_pem)], root_certificates=loaded.ca_pem)

    def credentials(self, *, require_client_auth: bool = True) -> grpc.ServerCredentials:
        """``require_client_auth=False``: for a port that takes bearer
        tokens instead. gRPC's Python API then does not even ask for a
        client certificate (there is no "request and verify if sent"), so
        such a port serves only callers that bring a token; the
        certificate port is separate."""
        return grpc.dynamic_ssl_server_credentials(self._config(self.current), self._fetch,
                                                   require_client_authentication=require_client_auth)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Called by gRPC's own threads before each handshake: it never
        # raises (gRPC would refuse the connection) and is cheap when
        # nothing changed (three stat calls).
        try:
            return self.refresh()
        except Exception:  # pragma: no cover - a bug here must not take the server down
            log.exception("TLS: reloading %s failed", self.files.cert)
            return None

    def refresh(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration if the files changed and pass the checks, else None."""
        with self._lock:
            seen = _stat_key(self.files)
            if seen == self._seen or seen == self._refused:
                return None
            try:
                loaded = load(self.files, cluster=self.cluster, use="server", now=self.clock())
            except TlsError as exc:
                self._refused = seen  # logged once per state of the files
                self.last_error = exc
                log.error("TLS: keeping the current certificate (serial %x): the files on disk are refused: %s",
                          self.current.cert.serial_number, exc)
                return None
            self._seen, self._refused, self.last_error = seen, None, None
            self.current = loaded
            log.info("TLS: now serving %s (serial %x, until %s)", loaded.identity.uri(),
                     loaded.cert.serial_number, loaded.cert.not_valid_after_utc.isoformat())
            return self._config(loaded)


def channel_credentials(files: TlsFiles, *, cluster: str, now: datetime.datetime | None = None) -> grpc.ChannelCredentials:
    """Channel credentials from the files as they are now: call it for each
    new channel, so a renewed certificate is used by the next one."""
    loaded = load(files, cluster=cluster, use="client", now=now or utc_now())
    return grpc.ssl_channel_credentials(root_certificates=loaded.ca_pem, private_key=loaded.key_pem,
                                        certificate_chain=loaded.cert_pem)


def coordinator_channel(target: str, files: TlsFiles, *, cluster: str, options: Sequence[tuple[str, Any]] = (),
                        aio: bool = True, now: datetime.datetime | None = None) -> Any:
    """A grpc.aio (``aio=False``: blocking grpc) channel to a coordinator at
    ``target`` with this process's certificate. gRPC checks that the
    server's certificate is from the CA and names
    ``coordinator_server_name(cluster)``, whatever host ``target`` names:
    only a coordinator certificate of this cluster passes."""
    loaded = load(files, cluster=cluster, use="client", now=now or utc_now())
    return pem_channel(target, loaded.ca_pem, loaded.cert_pem, loaded.key_pem, cluster=cluster, options=options,
                       aio=aio)


def pem_channel(target: str, ca_pem: bytes, cert_pem: bytes, key_pem: bytes, *, cluster: str,
                options: Sequence[tuple[str, Any]] = (), aio: bool = True) -> Any:
    """``coordinator_channel`` from files already checked (``load``,
    ``client_pems``)."""
    opts = [("grpc.ssl_target_name_override", coordinator_server_name(cluster)), *options]
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=key_pem,
                                               certificate_chain=cert_pem)
    if aio:
        return grpc.aio.secure_channel(target, credentials, options=opts)
    return grpc.secure_channel(target, credentials, options=opts)


def secure_channel(target: str, files: TlsFiles, *, cluster: str, options: Sequence[tuple[str, Any]] = (),
                   now: datetime.datetime | None = None) -> grpc.aio.Channel:
    """``coordinator_channel`` (grpc.aio): the one kind of server a phalanx
    process dials over gRPC is a coordinator."""
    return coordinator_channel(target, files, cluster=cluster, options=options, now=now)


# gRPC's words for a failed handshake (its Python API gives no better signal).
_HANDSHAKE_WORDS = ("ssl", "tls", "handshake", "certificate", "peer name", "hostname verification")


def looks_like_handshake(details: str) -> bool:
    low = (details or "").lower()
    return any(w in low for w in _HANDSHAKE_WORDS)


def probe_server(target: str, files: TlsFiles, *, cluster: str, now: datetime.datetime,
                 timeout: float = 2.0) -> TlsError | None:
    """Why a coordinator at ``target`` fails this client's checks: a TLS
    handshake of our own (Python's ssl, which shows the server's certificate
    even when it does not verify), then ``check_coordinator`` on what the
    server presented. A TlsError whose ``path`` is the target and whose
    ``check`` is the failed check (``unknown CA``, ``expired``, ``wrong
    name``, ...); None if the certificate passes or the server could not be
    reached (gRPC's own error says more then). Blocking: run it in a thread."""
    from cryptography import x509

    from phalanx.certs import IdentityError, check_coordinator

    try:
        loaded = load(files, cluster=cluster, use="client", now=now)
    except TlsError as exc:  # our own files changed under us: that is the reason
        return exc
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # Verification is ours (check_coordinator), so that an unknown CA or a
    # wrong name is reported, not just "handshake failed".
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        ctx.load_cert_chain(files.cert, files.key)
        with socket.create_connection((host, int(port)), timeout=timeout) as raw:
            with ctx.wrap_socket(raw, server_hostname=coordinator_server_name(cluster)) as conn:
                der = conn.getpeercert(binary_form=True)
    except (OSError, ValueError):
        return None
    if not der:
        return None
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        return TlsError(target, CHECK_BAD_PEER, f"the server's certificate does not parse: {exc}")
    try:
        check_coordinator(cert, ca=loaded.cas, cluster=cluster, now=now)
    except IdentityError as exc:
        return TlsError(target, exc.check, f"the server is not a coordinator of cluster {cluster!r} "
                        f"this client trusts: {exc.detail} (CA: {files.ca})")
    return None


def peer_identity(context: Any, *, cas: Sequence[x509.Certificate], cluster: str, now: datetime.datetime) -> Identity:
    """The identity of the client of a call, from the certificate gRPC's
    handshake verified (``context`` is a grpc or grpc.aio servicer context).
    IdentityError if the call carries no certificate or it names no valid
    identity of ``cluster``."""
    from cryptography import x509

    from phalanx.certs import IdentityError, identity_of

    pems = context.auth_context().get("x509_pem_cert") or []
    if not pems:
        raise IdentityError("no certificate", "the call carries no client certificate (plaintext, or TLS without client authentication)")
    try:
        cert = x509.load_pem_x509_certificate(pems[0])
    except ValueError as exc:
        raise IdentityError(CHECK_BAD_PEER, f"the client certificate does not parse: {exc}") from None
    return identity_of(cert, ca=cas, cluster=cluster, now=now, use="client")

