"""etcd's own certificate authority: the server (and peer) certificate of
the etcd members and the client certificates of etcd users
(docs/security.md "etcd: TLS and roles").

It is a separate CA from a cluster's Phalanx gRPC CA (as kubeadm keeps an
etcd CA apart from the Kubernetes one): a Phalanx coordinator or agent
certificate never opens etcd, and an etcd client certificate never opens a
coordinator. etcd runs with ``--client-cert-auth`` and takes the client
certificate's CN as the etcd user, so the CN *is* the credential: the
client directory of user ``phalanx-<cluster>-agent`` gets that user's
(read-only) role, nothing more.

Layout of a directory made by ``init`` (``phalanx certs etcd-init``)::

    ca.crt ca.key                 the etcd CA (ca.key 0600)
    server.crt server.key         every member's server and peer certificate
    <user>/ca.crt client.crt client.key   one per user (issue_client)

A client directory is self-contained (it carries a copy of ``ca.crt``), so
it can be handed to a process as ``--etcd-tls-dir`` alone. Pure parts (the
``build_*`` functions, ``check_client``) take keys and times as arguments;
``init`` and ``issue_client`` are the thin file writers.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Iterable

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from phalanx.certs import (
    CA_CERT,
    CA_KEY,
    CA_DAYS,
    CHECK_EXPIRED,
    CHECK_NOT_YET_VALID,
    CHECK_UNKNOWN_CA,
    CHECK_WRONG_USE,
    DEFAULT_DAYS,
    MAX_CLUSTER_LEN,
    CertError,
    as_utc,
    check_days,
    issued_by,
    leaf_certificate,
    san_for_host,
    write_file,
    cert_pem,
    key_pem,
    new_key,
    parse_hosts,
    self_signed_ca,
)
from phalanx.limits import DNS_LABEL, DNS_LABEL_WHAT, name_error
from phalanx.tls import TlsError, TlsFiles, read_key_pair

# The name every etcd client verifies the server certificate against
# (grpc.ssl_target_name_override), whatever address it dials: only a
# certificate of this CA that names it passes, and ``.invalid`` can never be
# a real DNS name, so no public certificate can carry it by accident.
ETCD_SERVER_NAME = "etcd.phalanx.invalid"
ROOT_USER = "root"
ROLES = ("coordinator", "agent")
SERVER_CERT = "server.crt"
SERVER_KEY = "server.key"
CLIENT_CERT = "client.crt"
CLIENT_KEY = "client.key"
# Hosts the server certificate always names besides ETCD_SERVER_NAME: a
# member's peers dial its peer URL by address, and etcdctl users dial
# localhost.
DEFAULT_SERVER_HOSTS = ("localhost", "127.0.0.1", "::1")
# An etcd user name here doubles as a directory name: no '/', no leading '.'.
USER_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
MAX_USER_LEN = 128
USER_WHAT = "an etcd user name (letters, digits, '.', '_', '-' inside; no '/')"

# check_client's words: phalanx.certs' CHECK_* (imported above, so the same
# failure reads the same for both CAs) and these two.
CHECK_KEY_MISMATCH = "key mismatch"
CHECK_NO_USER = "no user"


def user_for(cluster: str, role: str) -> str:
    """The etcd user (and role) a cluster's coordinators or agents use."""
    e = name_error(cluster, DNS_LABEL, MAX_CLUSTER_LEN, DNS_LABEL_WHAT)
    if e:
        raise CertError(f"--cluster {e}")
    if role not in ROLES:
        raise CertError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    return f"phalanx-{cluster}-{role}"


def check_user(user: str) -> str:
    e = name_error(user, USER_NAME, MAX_USER_LEN, USER_WHAT)
    if e:
        raise CertError(f"--user {e}")
    return user


def files(directory: Path | str) -> TlsFiles:
    """The client files of a directory made by ``issue_client``."""
    d = Path(directory)
    return TlsFiles(d / CA_CERT, d / CLIENT_CERT, d / CLIENT_KEY)


def server_files(directory: Path | str) -> TlsFiles:
    """The server (and peer) files of a directory made by ``init``."""
    d = Path(directory)
    return TlsFiles(d / CA_CERT, d / SERVER_CERT, d / SERVER_KEY)


# --- building certificates (pure) -------------------------------------------------------

def build_ca(key: ec.EllipticCurvePrivateKey, *, not_before: datetime.datetime, days: int = CA_DAYS) -> x509.Certificate:
    name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "phalanx etcd"),
        x509.NameAttribute(NameOID.COMMON_NAME, "phalanx etcd CA"),
    ])
    return self_signed_ca(key, name, not_before=as_utc(not_before).replace(microsecond=0), days=days)


def build_leaf(
    common_name: str,
    public_key: ec.EllipticCurvePublicKey,
    *,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    not_before: datetime.datetime,
    days: int,
    hosts: Iterable[str] = (),
    server: bool = False,
) -> x509.Certificate:
    """A client certificate (CN = the etcd user), or with ``server`` the
    members' certificate: DNS ETCD_SERVER_NAME plus ``hosts``, marked for
    server and client use because etcd also presents it to its peers."""
    check_days(days)
    # Whole seconds, as X.509 stores them: a server certificate made with the
    # CA's own start and days ends exactly with the CA, not a fraction after.
    not_before = as_utc(not_before).replace(microsecond=0)
    not_after = not_before + datetime.timedelta(days=days)
    if not_after > ca.not_valid_after_utc:
        raise CertError(f"--days: the certificate would outlive its CA (the CA expires {ca.not_valid_after_utc.isoformat()})")
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    names: list[str] = []
    for h in ((ETCD_SERVER_NAME, *DEFAULT_SERVER_HOSTS, *hosts) if server else ()):
        if h not in names:
            names.append(h)
    subject = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "phalanx etcd"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])
    return leaf_certificate(subject, public_key, ca=ca, ca_key=ca_key, not_before=not_before, not_after=not_after,
                            usages=usages, sans=[san_for_host(h) for h in names])


# --- checking a client's files (pure but for the reads) ---------------------------------

def check_client(tls: TlsFiles, *, now: datetime.datetime) -> tuple[bytes, bytes, bytes, str]:
    """Read and check an etcd client's three files before any connection:
    the CA parses, the certificate parses, is the CA's, valid at ``now``,
    marked for client use and names a user (CN); the key is the
    certificate's. Returns ``(ca_pem, cert_pem, key_pem, user)``; TlsError
    names the file and the check (etcd itself would only say "bad
    certificate" or refuse the handshake)."""
    ca_pem, crt_pem, k_pem, cas, cert = read_key_pair(tls)
    if not any(issued_by(cert, c) for c in cas):
        raise TlsError(tls.cert, CHECK_UNKNOWN_CA,
                       f"issuer {cert.issuer.rfc4514_string()!r} is not the etcd CA in {tls.ca}")
    now = as_utc(now)
    if now < cert.not_valid_before_utc:
        raise TlsError(tls.cert, CHECK_NOT_YET_VALID, f"valid from {cert.not_valid_before_utc.isoformat()}, now is {now.isoformat()}")
    if now > cert.not_valid_after_utc:
        raise TlsError(tls.cert, CHECK_EXPIRED, f"expired at {cert.not_valid_after_utc.isoformat()}, now is {now.isoformat()}")
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        eku = x509.ExtendedKeyUsage([])
    if ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
        raise TlsError(tls.cert, CHECK_WRONG_USE, "the certificate is not marked for client use")
    user = user_of(cert)
    if not user:
        raise TlsError(tls.cert, CHECK_NO_USER, "the certificate has no CN (etcd takes the CN as the user)")
    return ca_pem, crt_pem, k_pem, user


def channel_credentials(tls: TlsFiles, *, now: datetime.datetime | None = None) -> tuple[grpc.ChannelCredentials, str]:
    """Channel credentials from checked client files, and the etcd user they
    log in as. Use them with CHANNEL_OPTIONS (the server-name override)."""
    ca, crt, key, user = check_client(tls, now=now or datetime.datetime.now(datetime.timezone.utc))
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=crt), user


# Every member's certificate names ETCD_SERVER_NAME, whatever address it is
# dialled at.
CHANNEL_OPTIONS = (("grpc.ssl_target_name_override", ETCD_SERVER_NAME),)


def user_of(cert: x509.Certificate) -> str:
    """The etcd user a client certificate logs in as: its CN ("" if none)."""
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if cns else ""


# --- files (the thin drivers) -----------------------------------------------------------

def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    crt_path, key_path = directory / CA_CERT, directory / CA_KEY
    if not crt_path.is_file() or not key_path.is_file():
        raise CertError(f"--dir {directory}: no etcd CA there ({CA_CERT} and {CA_KEY}); "
                        f"create one with phalanx certs etcd-init --dir {directory}")
    try:
        cert = x509.load_pem_x509_certificate(crt_path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CertError(f"{crt_path}: not a readable PEM certificate: {exc}") from None
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise CertError(f"{key_path}: not a readable unencrypted PEM key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise CertError(f"{key_path} is not the key of {crt_path}")
    return cert, key


def _check_hosts(hosts: Iterable[str]) -> tuple[str, ...]:
    hosts = tuple(hosts)
    return parse_hosts(",".join(hosts)) if hosts else ()


def init(directory: Path | str, *, hosts: Iterable[str] = (), now: datetime.datetime, days: int = CA_DAYS) -> TlsFiles:
    """Create ``directory`` (0700) with a new etcd CA and the members'
    server certificate (``server_files``). An existing CA is never replaced
    (every client certificate it issued would stop working). Everything is
    checked before anything is written."""
    directory = Path(directory)
    hosts = _check_hosts(hosts)
    check_days(days)
    if directory.exists() and not directory.is_dir():
        raise CertError(f"--dir {directory} is not a directory")
    for name in (CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY):
        if (directory / name).exists():
            raise CertError(f"{directory / name} already exists: an etcd CA is never replaced (remove the directory to start over)")
    ca_key = new_key()
    ca = build_ca(ca_key, not_before=now, days=days)
    server_key = new_key()
    server = build_leaf("etcd", server_key.public_key(), ca=ca, ca_key=ca_key, not_before=now, days=days,
                        hosts=hosts, server=True)
    out = server_files(directory)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_file(directory / CA_KEY, key_pem(ca_key), 0o600)
        write_file(out.ca, cert_pem(ca), 0o644)
        write_file(out.key, key_pem(server_key), 0o600)
        write_file(out.cert, cert_pem(server), 0o644)
    except OSError as exc:
        raise CertError(f"--dir {directory}: cannot write: {exc.strerror or exc}") from None
    return out


def issue_client(directory: Path | str, user: str, *, now: datetime.datetime, days: int = DEFAULT_DAYS) -> Path:
    """Write ``directory/<user>/{ca.crt,client.crt,client.key}`` (CN=user,
    client use only; the key 0600) from the etcd CA in ``directory``, and
    return that directory. Re-issuing renews (a new key too)."""
    directory = Path(directory)
    check_user(user)
    check_days(days)
    ca, ca_key = _load_ca(directory)
    key = new_key()
    cert = build_leaf(user, key.public_key(), ca=ca, ca_key=ca_key, not_before=now, days=days)
    out_dir = directory / user
    out = files(out_dir)
    try:
        out_dir.mkdir(mode=0o700, exist_ok=True)
        write_file(out.ca, cert_pem(ca), 0o644)
        # The key before the certificate: a reader that sees the new
        # certificate with the old key refuses the pair (check_client).
        write_file(out.key, key_pem(key), 0o600)
        write_file(out.cert, cert_pem(cert), 0o644)
    except OSError as exc:
        raise CertError(f"{out_dir}: cannot write: {exc.strerror or exc}") from None
    return out_dir
