"""etcd's CA, the members' certificate, etcd users' client directories, the
checks a client's files pass before any connection, and the CLI's
``certs etcd-init|etcd-user`` and ``etcd-auth`` (bad input only: the rest
needs a real etcd, tests/integration/test_etcd_auth.py)."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from phalanx import store
from phalanx import certs, cli, etcd_auth, etcd_pki
from phalanx.tls import TlsError, TlsFiles

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=datetime.timezone.utc)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _tree(d: Path) -> list[str] | None:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else None


def test_init_writes_the_ca_and_the_members_certificate(tmp_path: Path) -> None:
    d = tmp_path / "etcd"
    out = etcd_pki.init(d, hosts=("10.0.0.7", "etcd-a.example"), now=NOW)
    assert out == etcd_pki.server_files(d)
    assert _tree(d) == ["ca.crt", "ca.key", "server.crt", "server.key"]
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for key in ("ca.key", "server.key"):
        assert stat.S_IMODE((d / key).stat().st_mode) == 0o600
    ca, server = _cert(out.ca), _cert(out.cert)
    server.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [etcd_pki.ETCD_SERVER_NAME, "localhost", "etcd-a.example"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1", "10.0.0.7"]
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    # Server use for clients, client use for its peers.
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    # Made with the CA's start and days, it ends with the CA, not after it.
    assert server.not_valid_after_utc == ca.not_valid_after_utc


def test_the_etcd_ca_is_not_a_phalanx_ca(tmp_path: Path) -> None:
    etcd_pki.init(tmp_path / "etcd", now=NOW)
    with pytest.raises(certs.CertError, match="names no cluster"):
        certs.load_ca(tmp_path / "etcd")


def test_init_never_replaces_a_ca_and_checks_hosts_before_writing(tmp_path: Path) -> None:
    d = tmp_path / "etcd"
    with pytest.raises(certs.CertError, match="'a b' is neither an IP address nor a DNS name"):
        etcd_pki.init(d, hosts=("a b",), now=NOW)
    assert not d.exists()
    etcd_pki.init(d, now=NOW)
    before = (d / "ca.crt").read_bytes()
    with pytest.raises(certs.CertError, match="never replaced"):
        etcd_pki.init(d, now=NOW)
    assert (d / "ca.crt").read_bytes() == before


def test_issue_client_writes_a_self_contained_user_dir(tmp_path: Path) -> None:
    d = tmp_path / "etcd"
    etcd_pki.init(d, now=NOW)
    user = etcd_pki.user_for("prod", "agent")
    out = etcd_pki.issue_client(d, user, now=NOW, days=30)
    assert out == d / "phalanx-prod-agent"
    assert _tree(out) == ["ca.crt", "client.crt", "client.key"]
    assert stat.S_IMODE((out / "client.key").stat().st_mode) == 0o600
    assert (out / "ca.crt").read_bytes() == (d / "ca.crt").read_bytes()
    cert = _cert(out / "client.crt")
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == user
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)  # names no host: cannot serve
    *_, got = etcd_pki.check_client(etcd_pki.files(out), now=NOW)
    assert got == user
    first = (out / "client.key").read_bytes()
    etcd_pki.issue_client(d, user, now=NOW)  # a renewal: a new key
    assert (out / "client.key").read_bytes() != first


@pytest.mark.parametrize("cluster,role,want", [
    ("prod", "coordinator", "phalanx-prod-coordinator"),
    ("a-1", "agent", "phalanx-a-1-agent"),
])
def test_user_for(cluster: str, role: str, want: str) -> None:
    assert etcd_pki.user_for(cluster, role) == want


@pytest.mark.parametrize("cluster,role,words", [
    ("Prod", "agent", "--cluster must be a DNS label"),
    ("prod", "admin", "--role must be one of coordinator, agent"),
    ("a/b", "agent", "--cluster"),
])
def test_user_for_refuses(cluster: str, role: str, words: str) -> None:
    with pytest.raises(certs.CertError, match=words):
        etcd_pki.user_for(cluster, role)


def test_roles_are_exactly_the_cluster_prefix_and_the_token_keys() -> None:
    coordinator = {
        "phalanx-prod-coordinator": (etcd_auth.Perm(etcd_auth.READWRITE, b"/phalanx/prod/", b"/phalanx/prod0"),)}
    # By default agents get no etcd user (they read through the coordinators).
    assert etcd_auth.roles_for("prod") == coordinator
    roles = etcd_auth.roles_for("prod", agent_user=True)
    assert roles == {
        **coordinator,
        "phalanx-prod-agent": (
            etcd_auth.Perm(etcd_auth.READ, b"/phalanx/prod/leader/", b"/phalanx/prod/leader0"),
            etcd_auth.Perm(etcd_auth.READ, b"/phalanx/prod/reservations/", b"/phalanx/prod/reservations0"),
        ),
    }


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    d = tmp_path / "etcd"
    etcd_pki.init(d, now=NOW)
    etcd_pki.issue_client(d, "alice", now=NOW, days=10)
    etcd_pki.issue_client(d, "bob", now=NOW, days=10)
    etcd_pki.init(tmp_path / "other", now=NOW)
    etcd_pki.issue_client(tmp_path / "other", "alice", now=NOW)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    return d


# name -> (ca, cert, key) relative to the fixture's parent, the "now", the file named, the check
CHECKS = {
    "key of another user": (("etcd/alice/ca.crt", "etcd/alice/client.crt", "etcd/bob/client.key"), NOW, "etcd/bob/client.key", etcd_pki.CHECK_KEY_MISMATCH),
    "another etcd CA": (("etcd/ca.crt", "other/alice/client.crt", "other/alice/client.key"), NOW, "other/alice/client.crt", etcd_pki.CHECK_UNKNOWN_CA),
    "expired": (("etcd/ca.crt", "etcd/alice/client.crt", "etcd/alice/client.key"), NOW + datetime.timedelta(days=11), "etcd/alice/client.crt", etcd_pki.CHECK_EXPIRED),
    "not yet valid": (("etcd/ca.crt", "etcd/alice/client.crt", "etcd/alice/client.key"), NOW - datetime.timedelta(days=1), "etcd/alice/client.crt", etcd_pki.CHECK_NOT_YET_VALID),
    "missing ca": (("etcd/nope.crt", "etcd/alice/client.crt", "etcd/alice/client.key"), NOW, "etcd/nope.crt", "cannot read"),
    "garbage cert": (("etcd/ca.crt", "junk.pem", "etcd/alice/client.key"), NOW, "junk.pem", "not a PEM certificate"),
    "garbage key": (("etcd/ca.crt", "etcd/alice/client.crt", "junk.pem"), NOW, "junk.pem", "not an unencrypted PEM key"),
}


@pytest.mark.parametrize("name", CHECKS)
def test_check_client_names_the_file_and_the_check(name: str, pki: Path) -> None:
    (ca, cert, key), now, path, check = CHECKS[name]
    base = pki.parent
    with pytest.raises(TlsError) as err:
        etcd_pki.check_client(TlsFiles(base / ca, base / cert, base / key), now=now)
    assert (err.value.path, err.value.check) == (str(base / path), check)
    assert str(err.value).startswith(f"{base / path}: {check}: ")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_etcd_init_and_users(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "etcd"
    rc, out, err = run_cli(capsys, "certs", "etcd-init", "--dir", str(d), "--hosts", "10.0.0.7")
    assert (rc, err) == (0, "") and "etcd.phalanx.invalid,localhost,127.0.0.1,::1,10.0.0.7" in out
    rc, out, err = run_cli(capsys, "certs", "etcd-user", "--dir", str(d), "--user", "root")
    assert (rc, err) == (0, "") and f"--etcd-tls-dir {d / 'root'}" in out
    rc, out, err = run_cli(capsys, "certs", "etcd-user", "--dir", str(d), "--cluster", "prod", "--role", "coordinator")
    assert (rc, err) == (0, "") and "etcd user phalanx-prod-coordinator" in out
    assert _tree(d / "phalanx-prod-coordinator") == ["ca.crt", "client.crt", "client.key"]


CLI_ERRORS = {
    "no CA in the dir": (["certs", "etcd-user", "--dir", "{d}/none", "--user", "root"], "no etcd CA there"),
    "user with a slash": (["certs", "etcd-user", "--dir", "{d}", "--user", "a/b"], "--user must be an etcd user name"),
    "user and cluster": (["certs", "etcd-user", "--dir", "{d}", "--user", "a", "--cluster", "c", "--role", "agent"], "not both"),
    "cluster without role": (["certs", "etcd-user", "--dir", "{d}", "--cluster", "c"], "--cluster and --role: both are required"),
    "neither": (["certs", "etcd-user", "--dir", "{d}"], "--cluster and --role: both are required"),
    "bad cluster": (["certs", "etcd-user", "--dir", "{d}", "--cluster", "C_1", "--role", "agent"], "--cluster must be a DNS label"),
    "unknown role": (["certs", "etcd-user", "--dir", "{d}", "--cluster", "c", "--role", "root"], "argument --role: invalid choice"),
    "zero days": (["certs", "etcd-user", "--dir", "{d}", "--user", "a", "--days", "0"], "must be between 1 and 36600"),
    "outlives the CA": (["certs", "etcd-user", "--dir", "{d}", "--user", "a", "--days", "36600"], "would outlive its CA"),
    "init over a CA": (["certs", "etcd-init", "--dir", "{d}"], "never replaced"),
    "init bad host": (["certs", "etcd-init", "--dir", "{d}/new", "--hosts", "a b"], "neither an IP address nor a DNS name"),
    "init empty host": (["certs", "etcd-init", "--dir", "{d}/new", "--hosts", "a,,b"], "--hosts has an empty entry"),
    "auth bad endpoint": (["etcd-auth", "--etcd", "https://h:1", "--etcd-tls-dir", "{d}/root", "--cluster", "c"], "scheme 'https' is not supported"),
    "auth bad cluster": (["etcd-auth", "--etcd", "127.0.0.1:1", "--etcd-tls-dir", "{d}/root", "--cluster", "C!"], "--cluster must be a DNS label"),
    "auth no client files": (["etcd-auth", "--etcd", "127.0.0.1:1", "--etcd-tls-dir", "{d}", "--cluster", "c"], "client.crt: cannot read"),
}


@pytest.mark.parametrize("name", CLI_ERRORS)
def test_cli_bad_input_is_one_error_line_and_writes_nothing(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv, words = CLI_ERRORS[name]
    d = tmp_path / "etcd"
    etcd_pki.init(d, now=datetime.datetime.now(datetime.timezone.utc))
    etcd_pki.issue_client(d, "root", now=datetime.datetime.now(datetime.timezone.utc))
    before = _tree(tmp_path)
    rc, out, err = run_cli(capsys, *[a.replace("{d}", str(d)) for a in argv])
    assert rc == cli.EXIT_INVALID and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    assert _tree(tmp_path) == before


# What the store makes of etcd's error answers (phalanx.store.classify).
ETCD_ANSWERS = [
    (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", "denied"),
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: user name is empty", "denied"),
    (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: user name not found", "denied"),
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: revision of auth store is old", "auth-old"),
    (grpc.StatusCode.UNKNOWN, "auth: revision in header is old", "auth-old"),
    (grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader", "transient"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "transient"),
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request", "refused"),
    (grpc.StatusCode.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted", "refused"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded", "no-space"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "grpc: received message larger than max (5000 vs. 4000)", "refused"),
]


@pytest.mark.parametrize("code,details,want", ETCD_ANSWERS)
def test_store_classifies_etcd_answers(code: grpc.StatusCode, details: str, want: str) -> None:
    assert store.classify(code, details) == want
