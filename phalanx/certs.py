"""A cluster's certificate authority, the certificates it issues, and what a
presented certificate claims (docs/security.md).

An identity lives in one URI subjectAltName of the certificate::

    phalanx://<cluster>/<role>/<name>[?queues=q1,q2][?node=<node>]

(``queues`` for a submitter, ``node`` for an agent; never both). The
subject's CN/OU/O repeat it for people reading ``openssl x509 -text``; only
the URI counts. A coordinator's certificate also carries the DNS name
``coordinators.<cluster>.phalanx.invalid`` (``coordinator_server_name``),
which every client of a coordinator checks whatever address it dialed, and
the DNS and IP subjectAltNames of ``--hosts`` (for other TLS clients); it
alone is marked for server use: no other certificate of the CA names a host,
so no other identity can pose as a coordinator.

The CA certificate carries ``phalanx://<cluster>`` so ``issue`` knows the
cluster and a reader knows whose CA it is. Pure parts (``identity_of``,
``parse_identity_uri``, the ``build_*`` functions) take the time and the keys
as arguments; the file writers are the thin drivers.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Re-exported: phalanx.certs is where callers have always found them.
from phalanx.cert_names import CA_CERT, SERVER_NAME_SUFFIX, coordinator_server_name, leaf_paths  # noqa: F401
from phalanx.limits import (
    DNS_LABEL,
    DNS_LABEL_WHAT,
    LABEL_VALUE,
    LABEL_VALUE_WHAT,
    MAX_AZ_NAME_LEN,
    MAX_NODE_NAME_LEN,
    MAX_QUEUE_LEN,
    NODE_NAME,
    NODE_NAME_WHAT,
    name_error,
)

SCHEME = "phalanx"
ROLES = ("admin", "submitter", "viewer", "agent", "coordinator")
# The roles whose certificate may name the AZ they serve in.
AZ_BOUND_ROLES = ("agent", "coordinator")
CA_KEY = "ca.key"
DEFAULT_CLUSTER = "local"  # the default --cluster of the coordinator and the agents
CA_DAYS = 3650
DEFAULT_DAYS = 365
MAX_NAME_LEN = MAX_NODE_NAME_LEN
MAX_CLUSTER_LEN = 63
MAX_QUEUES = 256
# Hosts a coordinator certificate names when --hosts is not given: what a
# local cluster (``phalanx up``) dials.
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


class CertError(ValueError):
    """Bad input to init/issue, or a CA directory that cannot be used. The
    message names the field or file and the reason."""


class IdentityError(ValueError):
    """A presented certificate does not carry a valid identity. ``check`` is
    the check that failed (one of the ``CHECK_*`` words)."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.check = check
        self.detail = detail


CHECK_UNKNOWN_CA = "unknown CA"
CHECK_EXPIRED = "expired"
CHECK_NOT_YET_VALID = "not yet valid"
CHECK_MISSING = "no identity"
CHECK_BAD = "bad identity"
CHECK_WRONG_CLUSTER = "wrong cluster"
CHECK_WRONG_USE = "wrong use"
CHECK_WRONG_NAME = "wrong name"


@dataclass(frozen=True)
class Identity:
    cluster: str
    role: str
    name: str
    queues: tuple[str, ...] = ()
    node: str | None = None
    # The AZ an agent's node or a coordinator serves; None in certificates
    # issued before the binding existed (docs/security.md "AZ binding").
    az: str | None = None

    def uri(self) -> str:
        return identity_uri(self)


# --- identity: the URI and its checks (pure) -----------------------------------------

def _check_fields(identity: Identity) -> list[str]:
    """Why ``identity`` is not valid (field names as the CLI flags say them)."""
    errors = []
    e = name_error(identity.cluster, DNS_LABEL, MAX_CLUSTER_LEN, DNS_LABEL_WHAT)
    if e:
        errors.append(f"--cluster {e}")
    if identity.role not in ROLES:
        errors.append(f"--role must be one of {', '.join(ROLES)}, got {identity.role!r}")
    e = name_error(identity.name, NODE_NAME, MAX_NAME_LEN, NODE_NAME_WHAT)
    if e:
        errors.append(f"--name {e}")
    if identity.role == "submitter":
        if not identity.queues:
            errors.append("--queues is required for a submitter (the queues it may submit to)")
    elif identity.queues:
        errors.append(f"--queues is only for a submitter, not {identity.role!r}")
    if len(identity.queues) > MAX_QUEUES:
        errors.append(f"--queues must name at most {MAX_QUEUES} queues, got {len(identity.queues)}")
    for q in identity.queues:
        e = name_error(q, DNS_LABEL, MAX_QUEUE_LEN, DNS_LABEL_WHAT)
        if e:
            errors.append(f"--queues: a queue {e}")
    if len(set(identity.queues)) != len(identity.queues):
        errors.append("--queues names a queue twice")
    if identity.role == "agent":
        if identity.node is None:
            errors.append("--node is required for an agent (the node it may register as)")
        else:
            e = name_error(identity.node, NODE_NAME, MAX_NODE_NAME_LEN, NODE_NAME_WHAT)
            if e:
                errors.append(f"--node {e}")
    elif identity.node is not None:
        errors.append(f"--node is only for an agent, not {identity.role!r}")
    if identity.az is not None:
        if identity.role not in AZ_BOUND_ROLES:
            errors.append(f"--az is only for {' and '.join(AZ_BOUND_ROLES)} certificates, not {identity.role!r}")
        else:
            e = name_error(identity.az, LABEL_VALUE, MAX_AZ_NAME_LEN, LABEL_VALUE_WHAT)
            if e:
                errors.append(f"--az {e}")
    return errors


def identity_uri(identity: Identity) -> str:
    uri = f"{SCHEME}://{identity.cluster}/{identity.role}/{identity.name}"
    if identity.queues:
        uri += "?queues=" + ",".join(identity.queues)
    if identity.node is not None:
        uri += "?node=" + identity.node
    if identity.az is not None:
        uri += ("&" if identity.node is not None else "?") + "az=" + identity.az
    return uri


# Every part is drawn from an alphabet without '/', '?', '=', ',' or '%', so
# the URI needs no escaping and is matched whole: nothing is decoded.
_URI = re.compile(
    re.escape(SCHEME) + r"://(?P<cluster>[^/?]*)/(?P<role>[^/?]*)/(?P<name>[^/?]*)"
    r"(?:\?queues=(?P<queues>[^/?&]*)|\?node=(?P<node>[^/?&]*)(?:&az=(?P<node_az>[^/?&]*))?|\?az=(?P<az>[^/?&]*))?"
)


def parse_identity_uri(uri: str) -> Identity:
    """The identity a ``phalanx://`` URI names; IdentityError if it is not
    one valid identity."""
    m = _URI.fullmatch(uri)
    if m is None:
        raise IdentityError(CHECK_BAD, f"{uri!r} is not phalanx://<cluster>/<role>/<name>"
                                       "[?queues=..|?node=..[&az=..]|?az=..]")
    queues = tuple(m["queues"].split(",")) if m["queues"] is not None else ()
    az = m["node_az"] if m["node_az"] is not None else m["az"]
    identity = Identity(m["cluster"], m["role"], m["name"], queues, m["node"], az)
    errors = _check_fields(identity)
    if errors:
        raise IdentityError(CHECK_BAD, f"{uri!r}: " + "; ".join(e.removeprefix("--") for e in errors))
    return identity


def as_utc(t: datetime.datetime) -> datetime.datetime:
    return t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)


def identity_of(
    cert: x509.Certificate,
    *,
    ca: x509.Certificate | Sequence[x509.Certificate],
    cluster: str,
    now: datetime.datetime,
    use: str = "client",
) -> Identity:
    """What ``cert`` claims, once it is checked: signed by ``ca`` (one of
    them, for a bundle during a CA rotation), valid at ``now``, carrying
    exactly one identity URI of ``cluster``, and marked for ``use``
    ("client" or "server"; a server is always a coordinator). Raises
    IdentityError naming the failed check. gRPC's handshake checks the chain
    and the dates too; this repeats them so the answer does not depend on
    how the caller got the certificate."""
    cas = [ca] if isinstance(ca, x509.Certificate) else list(ca)
    if not any(issued_by(cert, c) for c in cas):
        raise IdentityError(CHECK_UNKNOWN_CA, f"issuer {cert.issuer.rfc4514_string()!r} is not this cluster's CA (or the signature does not verify)")
    now = as_utc(now)
    if now < cert.not_valid_before_utc:
        raise IdentityError(CHECK_NOT_YET_VALID, f"valid from {cert.not_valid_before_utc.isoformat()}, now is {now.isoformat()}")
    if now > cert.not_valid_after_utc:
        raise IdentityError(CHECK_EXPIRED, f"expired at {cert.not_valid_after_utc.isoformat()}, now is {now.isoformat()}")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise IdentityError(CHECK_MISSING, "the certificate has no subjectAltName (a phalanx:// URI names the identity)") from None
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.lower().startswith(SCHEME + ":")]
    if not uris:
        raise IdentityError(CHECK_MISSING, "no phalanx:// URI in the subjectAltName")
    if len(uris) > 1:
        raise IdentityError(CHECK_BAD, f"{len(uris)} phalanx:// URIs in the subjectAltName; a certificate names one identity")
    identity = parse_identity_uri(uris[0])
    if identity.cluster != cluster:
        raise IdentityError(CHECK_WRONG_CLUSTER, f"the certificate is for cluster {identity.cluster!r}, this is {cluster!r}")
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        eku = x509.ExtendedKeyUsage([])
    wanted = {"client": ExtendedKeyUsageOID.CLIENT_AUTH, "server": ExtendedKeyUsageOID.SERVER_AUTH}[use]
    if wanted not in eku:
        raise IdentityError(CHECK_WRONG_USE, f"the certificate of {identity.uri()} is not marked for {use} use")
    if use == "server" and identity.role != "coordinator":
        raise IdentityError(CHECK_WRONG_USE, f"a server must be a coordinator, this is {identity.role!r}")
    return identity


def check_coordinator(
    cert: x509.Certificate,
    *,
    ca: x509.Certificate | Sequence[x509.Certificate],
    cluster: str,
    now: datetime.datetime,
) -> Identity:
    """What a client of a coordinator requires of the server's certificate:
    a coordinator identity of ``cluster`` from ``ca``, valid at ``now``,
    naming ``coordinator_server_name(cluster)`` (the name gRPC checks).
    IdentityError names the failed check; any other role, or a coordinator
    certificate issued without the name, fails ``wrong name``."""
    try:
        identity = identity_of(cert, ca=ca, cluster=cluster, now=now, use="server")
    except IdentityError as exc:
        if exc.check == CHECK_WRONG_USE:
            raise IdentityError(CHECK_WRONG_NAME, f"not a coordinator certificate: {exc.detail}") from None
        raise
    name = coordinator_server_name(cluster)
    if name not in dns_names(cert):
        raise IdentityError(CHECK_WRONG_NAME, f"the certificate of {identity.uri()} does not name {name} "
                                              "(issued by an older phalanx: issue it again with phalanx certs issue --role coordinator)")
    return identity


def dns_names(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return list(san.get_values_for_type(x509.DNSName))


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


# --- building certificates (pure: keys and times are passed in) -------------------------

def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def ca_cluster(ca: x509.Certificate) -> str:
    """The cluster a phalanx CA certificate is for."""
    try:
        san = ca.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = x509.SubjectAlternativeName([])
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        m = re.fullmatch(re.escape(SCHEME) + r"://(" + DNS_LABEL + ")", uri)
        if m:
            return m.group(1)
    raise CertError("the CA certificate names no cluster (no phalanx://<cluster> subjectAltName): not made by phalanx certs init")


def self_signed_ca(key: ec.EllipticCurvePrivateKey, name: x509.Name, *, not_before: datetime.datetime, days: int,
                   sans: Sequence[x509.GeneralName] = ()) -> x509.Certificate:
    """A CA certificate for ``key`` that signs leaf certificates only (the
    gRPC CA here, the etcd CA in phalanx.etcd_pki)."""
    check_days(days)
    not_before = as_utc(not_before)
    public = key.public_key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_before + datetime.timedelta(days=days))
        # path_length 0: the CA signs leaves only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(key, hashes.SHA256())


def build_ca(key: ec.EllipticCurvePrivateKey, cluster: str, *, not_before: datetime.datetime, days: int = CA_DAYS) -> x509.Certificate:
    e = name_error(cluster, DNS_LABEL, MAX_CLUSTER_LEN, DNS_LABEL_WHAT)
    if e:
        raise CertError(f"--cluster {e}")
    name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"phalanx {cluster}"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"phalanx {cluster} CA"),
    ])
    return self_signed_ca(key, name, not_before=not_before, days=days,
                          sans=[x509.UniformResourceIdentifier(f"{SCHEME}://{cluster}")])


def parse_hosts(text: str) -> tuple[str, ...]:
    """``--hosts a.example,10.0.0.7`` -> the names, each a DNS name or an IP."""
    hosts = parse_list(text, "--hosts")
    for h in hosts:
        try:
            ipaddress.ip_address(h)
            continue
        except ValueError:
            pass
        if len(h) > 253 or _HOST.fullmatch(h) is None:
            raise CertError(f"--hosts: {h!r} is neither an IP address nor a DNS name")
    return hosts


def san_for_host(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def check_days(days: int) -> None:
    if not isinstance(days, int) or isinstance(days, bool) or not 1 <= days <= 100 * 366:
        raise CertError(f"--days must be between 1 and {100 * 366}, got {days!r}")


def build_leaf(
    identity: Identity,
    public_key: ec.EllipticCurvePublicKey,
    *,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
    hosts: Iterable[str] = (),
) -> x509.Certificate:
    """A certificate for ``identity`` signed by the CA. ``hosts`` (DNS names
    and IPs) only for a coordinator, the one role that serves."""
    errors = _check_fields(identity)
    hosts = tuple(hosts)
    if hosts and identity.role != "coordinator":
        errors.append(f"--hosts is only for a coordinator (the one role that serves), not {identity.role!r}")
    if identity.cluster != ca_cluster(ca):
        errors.append(f"--cluster {identity.cluster!r} is not the CA's cluster {ca_cluster(ca)!r}")
    not_before, not_after = as_utc(not_before), as_utc(not_after)
    if not not_before < not_after:
        errors.append("--days: the certificate must end after it starts")
    elif not_after > ca.not_valid_after_utc:
        errors.append(f"--days: the certificate would outlive its CA (the CA expires {ca.not_valid_after_utc.isoformat()})")
    if errors:
        raise CertError("; ".join(errors))
    server = identity.role == "coordinator"
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri())]
    if server:
        sans.append(x509.DNSName(coordinator_server_name(identity.cluster)))
    sans += [san_for_host(h) for h in hosts if h != coordinator_server_name(identity.cluster)]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    subject = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"phalanx {identity.cluster}"),
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.role),
        x509.NameAttribute(NameOID.COMMON_NAME, identity.name),
    ])
    return leaf_certificate(subject, public_key, ca=ca, ca_key=ca_key, not_before=not_before, not_after=not_after,
                            usages=usages, sans=sans)


def leaf_certificate(
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    *,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
    usages: list[x509.ObjectIdentifier],
    sans: list[x509.GeneralName],
) -> x509.Certificate:
    """The one shape of an end-entity certificate both PKIs issue (the
    cluster's gRPC CA here, etcd's own CA in phalanx/etcd_pki.py): signing
    only, the given extended usages, SANs when there are any, key ids."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return (
        builder
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()), critical=False)  # type: ignore[arg-type]
        .sign(ca_key, hashes.SHA256())
    )


# --- files (the thin drivers) ---------------------------------------------------------------

def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def parse_list(text: str, flag: str) -> tuple[str, ...]:
    """``a,b`` -> ("a", "b"); an empty entry is an error naming ``flag``."""
    items = tuple(item.strip() for item in text.split(","))
    if any(not item for item in items):
        raise CertError(f"{flag} has an empty entry in {text!r}")
    return items


def describe(cert: x509.Certificate) -> str:
    """One line for people: the identity URI, the hosts, serial and end."""
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        sans = [str(v) for v in names.get_values_for_type(x509.UniformResourceIdentifier)]
        hosts = [str(v) for v in names.get_values_for_type(x509.DNSName)] + [str(v) for v in names.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        sans, hosts = [], []
    text = " ".join(sans) or "(no identity)"
    if hosts:
        text += " hosts " + ",".join(hosts)
    return f"{text}, serial {cert.serial_number:x}, valid until {cert.not_valid_after_utc.isoformat()}"


def write_file(path: Path, data: bytes, mode: int) -> None:
    """Write ``path`` whole or not at all: a temporary file in the same
    directory, created with ``mode`` (a key is never readable by others, not
    even for a moment), then renamed over the old one. A reader sees the old
    file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # the umask may have narrowed it; never widened
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def init_ca(directory: Path, cluster: str = DEFAULT_CLUSTER, *, now: datetime.datetime, days: int = CA_DAYS) -> tuple[Path, Path]:
    """Create ``directory`` (0700) with a new CA: ``ca.crt`` and ``ca.key``
    (0600). An existing CA is never replaced (every certificate it issued
    would stop working)."""
    key = new_key()
    cert = build_ca(key, cluster, not_before=now, days=days)  # validates before anything is written
    crt_path, key_path = directory / CA_CERT, directory / CA_KEY
    for p in (crt_path, key_path):
        if p.exists():
            raise CertError(f"{p} already exists: a CA is never replaced (remove the directory to start over)")
    if directory.exists() and not directory.is_dir():
        raise CertError(f"--dir {directory} is not a directory")
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_file(key_path, key_pem(key), 0o600)
        write_file(crt_path, cert_pem(cert), 0o644)
    except OSError as exc:
        raise CertError(f"--dir {directory}: cannot write: {exc.strerror or exc}") from None
    return crt_path, key_path


def load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    crt_path, key_path = directory / CA_CERT, directory / CA_KEY
    if not crt_path.is_file() or not key_path.is_file():
        raise CertError(f"--dir {directory}: no CA there ({CA_CERT} and {CA_KEY}); create one with phalanx certs init --dir {directory}")
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
    ca_cluster(cert)
    return cert, key


def issue(
    directory: Path,
    role: str,
    name: str,
    *,
    now: datetime.datetime,
    queues: Sequence[str] = (),
    node: str | None = None,
    az: str | None = None,
    days: int = DEFAULT_DAYS,
    hosts: Sequence[str] | None = None,
    not_before: datetime.datetime | None = None,
    out: tuple[Path, Path] | None = None,
) -> tuple[Path, Path, x509.Certificate]:
    """Issue a certificate for ``role``/``name`` from the CA in ``directory``
    into ``<role>-<name>.crt`` and ``.key`` (0600) there, or into ``out``.
    Re-issuing replaces both files (a renewal: a new key too); each file is
    replaced whole, and a reader that sees a new certificate with the old
    key refuses the pair (phalanx.tls). ``hosts`` defaults to DEFAULT_HOSTS
    for a coordinator. ``not_before`` (default ``now``) exists for tests that
    need a certificate already expired."""
    check_days(days)
    ca, ca_key = load_ca(directory)
    identity = Identity(ca_cluster(ca), role, name, tuple(queues), node, az)
    if hosts is None:
        hosts = DEFAULT_HOSTS if role == "coordinator" else ()
    start = as_utc(not_before or now)
    key = new_key()
    cert = build_leaf(identity, key.public_key(), ca=ca, ca_key=ca_key, not_before=start,
                      not_after=start + datetime.timedelta(days=days), hosts=hosts)
    crt_path, key_path = out or leaf_paths(directory, role, name)
    try:
        # The key first: a reader that sees the new certificate early checks
        # that the pair matches and keeps what it had.
        write_file(key_path, key_pem(key), 0o600)
        write_file(crt_path, cert_pem(cert), 0o644)
    except OSError as exc:
        raise CertError(f"{crt_path.parent}: cannot write: {exc.strerror or exc}") from None
    return crt_path, key_path, cert
