"""chaos/pki.py: the certificates of one chaos (or benchmark) run, real files
checked the way the processes check them: a coordinator certificate names
the cluster's coordinator name and no address (clients verify the name, so
namespace addresses and proxies need none), an agent certificate is bound to
its node, the client dir is one the SDK loads, and each etcd user's
certificate names that user (etcd takes the CN as the user)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from chaos.pki import AGENT, COORDINATOR, RunPki
from phalanx import etcd_pki
from phalanx.client import client_tls
from phalanx.tls import TlsFiles, coordinator_server_name, load, utc_now


@pytest.fixture
def pki(tmp_path: Path) -> RunPki:
    return RunPki.create(tmp_path / "pki", "chaos", etcd_hosts=("10.213.7.1", "10.213.7.2"))


def test_coordinator_certificate_names_the_cluster_and_no_address(pki: RunPki) -> None:
    d = pki.coordinator("coord-a1")
    loaded = load(TlsFiles.issued(d, "coordinator", "coord-a1"), cluster="chaos", use="server", now=utc_now())
    san = loaded.cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert coordinator_server_name("chaos") in san.get_values_for_type(x509.DNSName)
    assert san.get_values_for_type(x509.IPAddress) == []
    assert (loaded.identity.role, loaded.identity.name) == ("coordinator", "coord-a1")


def test_agent_certificates_are_bound_to_their_nodes(pki: RunPki) -> None:
    d = pki.agents(["a-n000", "a-n001"])
    for node in ("a-n000", "a-n001"):
        ident = load(TlsFiles.issued(d, "agent", node), cluster="chaos", use="client", now=utc_now()).identity
        assert (ident.role, ident.node) == ("agent", node)


def test_client_dir_is_an_sdk_client_dir_of_the_run(pki: RunPki) -> None:
    files, cluster = client_tls(pki.client("chaos-workload"))
    assert cluster == "chaos"
    ident = load(files, cluster="chaos", use="client", now=utc_now()).identity
    assert (ident.role, ident.name) == ("admin", "chaos-workload")


def test_agents_get_no_etcd_user(pki: RunPki) -> None:
    assert not pki.etcd_user_dir(AGENT).exists(), "agents read through the coordinators"


@pytest.mark.parametrize("role", [COORDINATOR])
def test_etcd_users_are_the_clusters_roles(pki: RunPki, role: str) -> None:
    files = etcd_pki.files(pki.etcd_user_dir(role))
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert cn == etcd_pki.user_for("chaos", role) == f"phalanx-chaos-{role}"
    root = x509.load_pem_x509_certificate(pki.etcd_root.cert.read_bytes())
    assert root.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == etcd_pki.ROOT_USER


def test_server_certificate_names_every_member_address(pki: RunPki) -> None:
    server = x509.load_pem_x509_certificate(etcd_pki.server_files(pki.etcd_dir).cert.read_bytes())
    ips = {str(ip) for ip in server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
           .get_values_for_type(x509.IPAddress)}
    assert {"10.213.7.1", "10.213.7.2"} <= ips


def test_an_existing_etcd_ca_is_used_not_replaced(tmp_path: Path) -> None:
    etcd_dir = tmp_path / "etcd"
    etcd_pki.init(etcd_dir, now=utc_now())
    ca_before = (etcd_dir / "ca.crt").read_bytes()
    pki = RunPki.create(tmp_path / "pki", "chaos", etcd_dir=etcd_dir)
    assert pki.etcd_dir == etcd_dir and (etcd_dir / "ca.crt").read_bytes() == ca_before
    assert pki.etcd_user_dir(COORDINATOR).parent == etcd_dir
