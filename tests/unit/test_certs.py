"""phalanx.certs on real certificates it makes: the CA, issued certificates,
and identity_of's verdict on what a presented certificate claims (a table),
plus ``phalanx certs init|issue`` through the CLI."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID

from phalanx import certs, cli
from phalanx.certs import Identity, IdentityError, identity_of

NOW = datetime.datetime(2030, 6, 1, 12, 0, tzinfo=datetime.timezone.utc)
DAY = datetime.timedelta(days=1)
CLUSTER = "prod"

# One CA for the whole module: key generation is the slow part.
CA_KEY = certs.new_key()
CA = certs.build_ca(CA_KEY, CLUSTER, not_before=NOW - 30 * DAY)
OTHER_KEY = certs.new_key()
OTHER_CA = certs.build_ca(OTHER_KEY, CLUSTER, not_before=NOW - 30 * DAY)  # same cluster name, another key
LEAF_KEY = certs.new_key()


def leaf(identity: Identity, *, ca: x509.Certificate = CA, ca_key=CA_KEY, start=NOW - DAY, end=NOW + DAY,
         hosts=()) -> x509.Certificate:
    return certs.build_leaf(identity, LEAF_KEY.public_key(), ca=ca, ca_key=ca_key, not_before=start, not_after=end, hosts=hosts)


def hand_made(sans: list[x509.GeneralName] | None, *, usages=(ExtendedKeyUsageOID.CLIENT_AUTH,)) -> x509.Certificate:
    """A certificate from the CA that build_leaf would never make (to see
    identity_of refuse what another tool might have issued)."""
    b = (x509.CertificateBuilder().subject_name(x509.Name([])).issuer_name(CA.subject)
         .public_key(LEAF_KEY.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(NOW - DAY).not_valid_after(NOW + DAY)
         .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False))
    if sans is not None:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(CA_KEY, hashes.SHA256())


ALICE = Identity(CLUSTER, "submitter", "alice", ("train", "eval"))
AGENT = Identity(CLUSTER, "agent", "agent-7", node="gpu-007.az1")
COORD = Identity(CLUSTER, "coordinator", "co-a")
URI = x509.UniformResourceIdentifier

ACCEPTED = {
    "submitter with queues": (leaf(ALICE), "client", ALICE),
    "agent bound to a node": (leaf(AGENT), "client", AGENT),
    "admin": (leaf(Identity(CLUSTER, "admin", "root-ops")), "client", Identity(CLUSTER, "admin", "root-ops")),
    "viewer": (leaf(Identity(CLUSTER, "viewer", "grafana")), "client", Identity(CLUSTER, "viewer", "grafana")),
    "coordinator as a client (peer calls)": (leaf(COORD, hosts=["localhost"]), "client", COORD),
    "coordinator as a server": (leaf(COORD, hosts=["10.0.0.1"]), "server", COORD),
    "a bundle during a CA rotation": (leaf(ALICE, ca=OTHER_CA, ca_key=OTHER_KEY), "client", ALICE),
    "valid at its very last second": (leaf(ALICE, end=NOW), "client", ALICE),
    "other SANs beside the identity": (hand_made([URI(ALICE.uri()), x509.DNSName("alice.example"), URI("https://x/")]), "client", ALICE),
}


@pytest.mark.parametrize("name", ACCEPTED)
def test_identity_of_accepts(name: str) -> None:
    cert, use, want = ACCEPTED[name]
    cas = [CA, OTHER_CA] if "bundle" in name else CA
    assert identity_of(cert, ca=cas, cluster=CLUSTER, now=NOW, use=use) == want


REFUSED = {
    "another CA": (leaf(ALICE, ca=OTHER_CA, ca_key=OTHER_KEY), CLUSTER, "client", certs.CHECK_UNKNOWN_CA, "not this cluster's CA"),
    "self-signed copy of the CA's subject": (leaf(ALICE, ca=CA, ca_key=OTHER_KEY), CLUSTER, "client", certs.CHECK_UNKNOWN_CA, "signature"),
    "expired": (leaf(ALICE, start=NOW - 3 * DAY, end=NOW - DAY), CLUSTER, "client", certs.CHECK_EXPIRED, "expired at 2030-05-31"),
    "not yet valid": (leaf(ALICE, start=NOW + DAY, end=NOW + 2 * DAY), CLUSTER, "client", certs.CHECK_NOT_YET_VALID, "valid from 2030-06-02"),
    "wrong cluster": (leaf(Identity("staging", "admin", "a"), ca=certs.build_ca(CA_KEY, "staging", not_before=NOW - DAY)),
                      CLUSTER, "client", certs.CHECK_UNKNOWN_CA, "not this cluster's CA"),
    "wrong cluster, same CA key": (hand_made([URI("phalanx://staging/admin/a")]), CLUSTER, "client", certs.CHECK_WRONG_CLUSTER, "'staging'"),
    "asked for another cluster": (leaf(ALICE), "staging", "client", certs.CHECK_WRONG_CLUSTER, "for cluster 'prod', this is 'staging'"),
    "no SAN at all": (hand_made(None), CLUSTER, "client", certs.CHECK_MISSING, "no subjectAltName"),
    "SAN without a phalanx URI": (hand_made([x509.DNSName("alice.example")]), CLUSTER, "client", certs.CHECK_MISSING, "no phalanx:// URI"),
    "two identities": (hand_made([URI(ALICE.uri()), URI(AGENT.uri())]), CLUSTER, "client", certs.CHECK_BAD, "2 phalanx:// URIs"),
    "unknown role": (hand_made([URI("phalanx://prod/root/alice")]), CLUSTER, "client", certs.CHECK_BAD, "role must be one of"),
    "submitter without queues": (hand_made([URI("phalanx://prod/submitter/alice")]), CLUSTER, "client", certs.CHECK_BAD, "queues is required"),
    "agent without a node": (hand_made([URI("phalanx://prod/agent/a1")]), CLUSTER, "client", certs.CHECK_BAD, "node is required"),
    "node on an admin": (hand_made([URI("phalanx://prod/admin/a?node=n1")]), CLUSTER, "client", certs.CHECK_BAD, "node is only for an agent"),
    "percent-escaped name": (hand_made([URI("phalanx://prod/admin/a%2Fb")]), CLUSTER, "client", certs.CHECK_BAD, "name must be a node name"),
    "extra path segment": (hand_made([URI("phalanx://prod/agent/a1/x?node=n1")]), CLUSTER, "client", certs.CHECK_BAD, "is not phalanx://"),
    "queue not a DNS label": (hand_made([URI("phalanx://prod/submitter/a?queues=Train")]), CLUSTER, "client", certs.CHECK_BAD, "queue must be a DNS label"),
    "not marked for client use": (hand_made([URI(ALICE.uri())], usages=[ExtendedKeyUsageOID.SERVER_AUTH]), CLUSTER, "client", certs.CHECK_WRONG_USE, "client use"),
    "a submitter as a server": (leaf(ALICE), CLUSTER, "server", certs.CHECK_WRONG_USE, "server use"),
    "a server that is not a coordinator": (hand_made([URI(AGENT.uri())], usages=[ExtendedKeyUsageOID.SERVER_AUTH]), CLUSTER, "server",
                                           certs.CHECK_WRONG_USE, "must be a coordinator"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_identity_of_refuses(name: str) -> None:
    cert, cluster, use, check, words = REFUSED[name]
    with pytest.raises(IdentityError) as info:
        identity_of(cert, ca=CA, cluster=cluster, now=NOW, use=use)
    assert info.value.check == check
    assert words in str(info.value)


def test_identity_uri_round_trips() -> None:
    for ident in (ALICE, AGENT, COORD):
        assert certs.parse_identity_uri(ident.uri()) == ident
    assert ALICE.uri() == "phalanx://prod/submitter/alice?queues=train,eval"
    assert AGENT.uri() == "phalanx://prod/agent/agent-7?node=gpu-007.az1"
    # Bound to an AZ; the unbound form above still parses (older certificates).
    bound_agent = Identity(CLUSTER, "agent", "agent-7", node="gpu-007", az="us-east-1a")
    bound_coord = Identity(CLUSTER, "coordinator", "c0", az="az-b")
    assert bound_agent.uri() == "phalanx://prod/agent/agent-7?node=gpu-007&az=us-east-1a"
    assert bound_coord.uri() == "phalanx://prod/coordinator/c0?az=az-b"
    for ident in (bound_agent, bound_coord):
        assert certs.parse_identity_uri(ident.uri()) == ident
        assert identity_of(leaf(ident), ca=CA, cluster=CLUSTER, now=NOW,
                           use="server" if ident.role == "coordinator" else "client") == ident


@pytest.mark.parametrize("uri,words", [
    ("phalanx://prod/submitter/alice?queues=a&az=az-a", "not phalanx://"),
    ("phalanx://prod/admin/root?az=az-a", "az is only for agent and coordinator"),
    ("phalanx://prod/agent/a?az=az-a&node=n", "not phalanx://"),
    ("phalanx://prod/agent/a?node=n&az=a/b", "not phalanx://"),
    ("phalanx://prod/agent/a?node=n&az=a*b", "az must be a label value"),
])
def test_identity_uri_az_refused(uri: str, words: str) -> None:
    with pytest.raises(IdentityError) as info:
        certs.parse_identity_uri(uri)
    assert words in str(info.value), str(info.value)


BUILD_ERRORS = {
    "hosts on a submitter": (dict(identity=ALICE, hosts=["localhost"]), "--hosts is only for a coordinator"),
    "another cluster than the CA's": (dict(identity=Identity("dev", "admin", "a")), "is not the CA's cluster 'prod'"),
    "outlives the CA": (dict(identity=ALICE, end=NOW + 9000 * DAY), "would outlive its CA"),
    "ends before it starts": (dict(identity=ALICE, end=NOW - 2 * DAY), "must end after it starts"),
    "queue twice": (dict(identity=Identity(CLUSTER, "submitter", "a", ("q", "q"))), "names a queue twice"),
    "agent node with a slash": (dict(identity=Identity(CLUSTER, "agent", "a", node="x/y")), "--node must be a node name"),
}


@pytest.mark.parametrize("name", BUILD_ERRORS)
def test_build_leaf_refuses(name: str) -> None:
    kw, words = BUILD_ERRORS[name]
    identity = kw.pop("identity")
    with pytest.raises(certs.CertError) as info:
        leaf(identity, **kw)
    assert words in str(info.value)


def test_only_a_coordinator_certificate_names_hosts_and_serves() -> None:
    cert = leaf(COORD, hosts=["co.example", "10.0.0.1", "::1"])
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    # The name every client of a coordinator checks, then the --hosts.
    assert san.get_values_for_type(x509.DNSName) == ["coordinators.prod.phalanx.invalid", "co.example"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.1", "::1"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku and ExtendedKeyUsageOID.CLIENT_AUTH in eku
    client_eku = leaf(ALICE).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(client_eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not leaf(ALICE).extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


OTHER_CLUSTER_CA = certs.build_ca(OTHER_KEY, "dev", not_before=NOW - 30 * DAY)
SERVER_CHECKS = {
    # name: (the certificate a "coordinator" presents, the failed check or None)
    "a coordinator of the cluster": (leaf(COORD), None),
    "a coordinator with --hosts": (leaf(COORD, hosts=["10.0.0.1"]), None),
    "an agent of the same CA": (leaf(AGENT), certs.CHECK_WRONG_NAME),
    "a submitter of the same CA": (leaf(ALICE), certs.CHECK_WRONG_NAME),
    "a coordinator of another CA": (leaf(COORD, ca=OTHER_CA, ca_key=OTHER_KEY), certs.CHECK_UNKNOWN_CA),
    "a coordinator of another cluster": (certs.build_leaf(Identity("dev", "coordinator", "co-a"), LEAF_KEY.public_key(),
                                                          ca=OTHER_CLUSTER_CA, ca_key=OTHER_KEY, not_before=NOW - DAY,
                                                          not_after=NOW + DAY), certs.CHECK_UNKNOWN_CA),
    "an expired coordinator": (leaf(COORD, start=NOW - 3 * DAY, end=NOW - DAY), certs.CHECK_EXPIRED),
    "a coordinator without the name (an older phalanx)": (
        hand_made([URI(COORD.uri()), x509.DNSName("localhost")],
                  usages=(ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH)), certs.CHECK_WRONG_NAME),
}


@pytest.mark.parametrize("name", SERVER_CHECKS)
def test_check_coordinator(name: str) -> None:
    cert, check = SERVER_CHECKS[name]
    if check is None:
        assert certs.check_coordinator(cert, ca=CA, cluster=CLUSTER, now=NOW) == COORD
        return
    with pytest.raises(IdentityError) as info:
        certs.check_coordinator(cert, ca=CA, cluster=CLUSTER, now=NOW)
    assert info.value.check == check


def test_coordinator_server_name_is_per_cluster_and_never_resolves() -> None:
    assert certs.coordinator_server_name("prod") == "coordinators.prod.phalanx.invalid"
    assert certs.coordinator_server_name("dev") != certs.coordinator_server_name("prod")
    # --hosts naming it again does not repeat it
    cert = leaf(COORD, hosts=[certs.coordinator_server_name(CLUSTER), "localhost"])
    assert certs.dns_names(cert) == ["coordinators.prod.phalanx.invalid", "localhost"]


def test_the_ca_names_its_cluster_and_signs_leaves_only() -> None:
    assert certs.ca_cluster(CA) == CLUSTER
    bc = CA.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.ca and bc.path_length == 0
    with pytest.raises(certs.CertError, match="names no cluster"):
        certs.ca_cluster(leaf(ALICE))
    with pytest.raises(certs.CertError, match="--cluster must be a DNS label"):
        certs.build_ca(CA_KEY, "Prod", not_before=NOW)


# --- the files and the CLI ------------------------------------------------------------------------

def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_and_issue_write_real_files_with_private_keys_0600(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    now = datetime.datetime.now(datetime.timezone.utc)
    crt, key = certs.init_ca(d, CLUSTER, now=now)
    assert mode(d) == 0o700 and mode(key) == 0o600
    ca, _ = certs.load_ca(d)
    c, k, cert = certs.issue(d, "agent", "a1", node="gpu-1", now=now)
    assert (c, k) == (d / "agent-a1.crt", d / "agent-a1.key") and mode(k) == 0o600
    assert x509.load_pem_x509_certificate(c.read_bytes()) == cert
    assert identity_of(cert, ca=ca, cluster=CLUSTER, now=now) == Identity(CLUSTER, "agent", "a1", node="gpu-1")
    # Re-issuing renews: a new key and a new serial in the same files.
    old_key = k.read_bytes()
    _, _, renewed = certs.issue(d, "agent", "a1", node="gpu-1", now=now)
    assert renewed.serial_number != cert.serial_number and k.read_bytes() != old_key
    assert sorted(p.name for p in d.iterdir()) == ["agent-a1.crt", "agent-a1.key", "ca.crt", "ca.key"]  # no temporary left


def test_init_never_replaces_a_ca(tmp_path: Path) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    d = tmp_path / "pki"
    certs.init_ca(d, CLUSTER, now=now)
    before = (d / "ca.key").read_bytes()
    with pytest.raises(certs.CertError, match="already exists"):
        certs.init_ca(d, "other", now=now)
    assert (d / "ca.key").read_bytes() == before


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_certs_init_and_issue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "pki"
    rc, out, err = run_cli(capsys, "certs", "init", "--dir", str(d), "--cluster", "prod")
    assert (rc, err) == (0, "") and "the CA of cluster prod" in out
    rc, out, err = run_cli(capsys, "certs", "issue", "--dir", str(d), "--role", "submitter", "--name", "alice", "--queues", "train,eval", "--days", "30")
    assert (rc, err) == (0, "")
    assert "phalanx://prod/submitter/alice?queues=train,eval" in out
    cert = x509.load_pem_x509_certificate((d / "submitter-alice.crt").read_bytes())
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == datetime.timedelta(days=30)
    rc, out, err = run_cli(capsys, "certs", "issue", "--dir", str(d), "--role", "coordinator", "--name", "co-a", "--hosts", "co.example,10.1.2.3")
    assert rc == 0 and "hosts coordinators.prod.phalanx.invalid,co.example,10.1.2.3" in out


CLI_ERRORS = {
    "no CA in the dir": (["issue", "--role", "admin", "--name", "a"], "no CA there"),
    "submitter without queues": (["issue", "--role", "submitter", "--name", "a"], "--queues is required for a submitter"),
    "agent without node": (["issue", "--role", "agent", "--name", "a"], "--node is required for an agent"),
    "queues on an agent": (["issue", "--role", "agent", "--name", "a", "--node", "n", "--queues", "q"], "--queues is only for a submitter"),
    "unknown role": (["issue", "--role", "root", "--name", "a"], "argument --role: invalid choice: 'root'"),
    "bad name": (["issue", "--role", "admin", "--name", "../x"], "--name must be a node name"),
    "bad host": (["issue", "--role", "coordinator", "--name", "c", "--hosts", "a b"], "'a b' is neither an IP address nor a DNS name"),
    "hosts on a viewer": (["issue", "--role", "viewer", "--name", "v", "--hosts", "x"], "--hosts is only for a coordinator"),
    "zero days": (["issue", "--role", "admin", "--name", "a", "--days", "0"], "must be between 1 and 36600"),
    "empty queue": (["issue", "--role", "submitter", "--name", "a", "--queues", "a,,b"], "--queues has an empty entry"),
    "bad cluster": (["init", "--cluster", "Prod_1"], "--cluster must be a DNS label"),
}


@pytest.mark.parametrize("name", CLI_ERRORS)
def test_cli_certs_bad_input_is_one_error_line_and_writes_nothing(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv, words = CLI_ERRORS[name]
    d = tmp_path / "pki"
    if name not in ("no CA in the dir", "bad cluster"):
        certs.init_ca(d, CLUSTER, now=datetime.datetime.now(datetime.timezone.utc))
    before = sorted(p.name for p in d.iterdir()) if d.exists() else None
    rc, out, err = run_cli(capsys, "certs", argv[0], "--dir", str(d), *argv[1:])
    assert rc == cli.EXIT_INVALID and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    assert (sorted(p.name for p in d.iterdir()) if d.exists() else None) == before
