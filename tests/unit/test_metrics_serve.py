"""phalanx/metrics.py (the /metrics endpoint over real TLS with certificates
from phalanx.certs) and coordinator/metrics.py's pure counting rules."""

from __future__ import annotations

import socket
import ssl
from types import SimpleNamespace

import pytest
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from coordinator.config import CoordinatorConfig

from phalanx.timings import ConfigError
from coordinator.metrics import CoordinatorMetrics, lifecycle_steps, pending_class, twophase_outcome
from phalanx.metrics import ScrapeError, new_registry, parse_listen, scrape, serve
from tests.pki import ClusterPki


def value(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    return None


@pytest.fixture
def pki(tmp_path):
    return ClusterPki(tmp_path, "metrics-unit")


def registry_with(n: int):
    r = new_registry()
    Counter("phalanx_test_things_total", "things", registry=r).inc(n)
    return r


@pytest.mark.parametrize("role", ["coordinator", "agent"])
def test_https_with_a_cluster_client_certificate(pki, role) -> None:
    files = pki.coordinator("c0") if role == "coordinator" else pki.agent("n0")
    server, address = serve("127.0.0.1:0", registry_with(3), tls=files, cluster="metrics-unit")
    try:
        assert server is not None and server.url == f"https://{address}/metrics"
        assert value(scrape(address, tls=pki.client_files(), cluster="metrics-unit"), "phalanx_test_things_total") == 3
        # A viewer may scrape too: every role of the cluster's CA.
        assert value(scrape(address, tls=pki.client_files("viewer", "v"), cluster="metrics-unit"),
                     "phalanx_test_things_total") == 3
        with pytest.raises(ScrapeError):  # plaintext HTTP to the HTTPS port
            scrape(address, tls=None, cluster="metrics-unit")
    finally:
        server.close()


def test_a_certificate_of_another_ca_or_none_is_refused(pki, tmp_path) -> None:
    server, address = serve("127.0.0.1:0", registry_with(1), tls=pki.coordinator("c0"), cluster="metrics-unit")
    other = ClusterPki(tmp_path / "other", "metrics-unit").client_files()  # same cluster name, another CA
    host, port = address.rsplit(":", 1)

    def attempt(cert) -> bytes:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        if cert is not None:
            ctx.load_cert_chain(str(cert.cert), str(cert.key))
        try:
            with socket.create_connection((host, int(port)), timeout=5) as raw, ctx.wrap_socket(raw) as conn:
                conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                return conn.recv(65536)
        except (ssl.SSLError, OSError):
            return b""

    try:
        assert attempt(other) == b""
        assert attempt(None) == b""
        assert attempt(pki.client_files()).startswith(b"HTTP/1.0 200")
    finally:
        server.close()


def test_plaintext_without_tls_and_off_when_empty() -> None:
    server, address = serve("127.0.0.1:0", registry_with(2), tls=None, cluster="x")
    try:
        assert value(scrape(address, tls=None, cluster="x"), "phalanx_test_things_total") == 2
    finally:
        server.close()
    assert serve("", registry_with(0), tls=None, cluster="x") == (None, "")


def test_registries_are_per_process_not_global() -> None:
    a, b = CoordinatorMetrics(az="a"), CoordinatorMetrics(az="b")
    a.submitted("q")
    assert a.registry.get_sample_value("phalanx_gangs_submitted_total", {"queue": "q"}) == 1
    assert b.registry.get_sample_value("phalanx_gangs_submitted_total", {"queue": "q"}) is None


@pytest.mark.parametrize("listen, why", [
    ("nohostport", "expected HOST:PORT"),
    ("127.0.0.1:http", "the port must be a number"),
    ("127.0.0.1:70000", "0..65535"),
    (":9100", "expected HOST:PORT"),
])
def test_bad_listen_names_the_flag(listen, why) -> None:
    with pytest.raises(ValueError, match="--metrics-listen") as err:
        parse_listen(listen)
    assert why in str(err.value)
    with pytest.raises(ConfigError, match=why):
        CoordinatorConfig(cluster="c", az="a", coordinator_id="i", etcd=("e:1",), metrics_listen=listen).validate()


def test_a_taken_port_is_an_oserror() -> None:
    server, address = serve("127.0.0.1:0", registry_with(0), tls=None, cluster="x")
    try:
        with pytest.raises(OSError):
            serve(address, registry_with(0), tls=None, cluster="x")
    finally:
        server.close()


P, RV, RD, ST, RN, RS = "PENDING", "RESERVING", "RESERVED", "STARTING", "RUNNING", "RESTARTING"


@pytest.mark.parametrize("before, after, steps", [
    (None, (1, P, 0), []),
    ((1, P, 0), (1, P, 0), []),
    ((1, P, 0), (1, RD, 0), ["admitted"]),
    ((1, RV, 0), (1, RD, 0), ["admitted"]),            # two-phase
    ((1, P, 0), (1, ST, 0), ["admitted"]),              # RESERVED seen only through a later write
    ((1, RD, 0), (1, ST, 0), []),
    ((1, ST, 0), (1, RN, 0), ["running"]),
    ((1, P, 0), (1, RN, 0), ["admitted", "running"]),
    ((1, RN, 0), (1, RS, 0), ["restarted"]),
    ((1, RS, 0), (2, P, 1), []),                        # the requeue of a restart already counted
    ((1, RN, 0), (2, P, 1), ["restarted"]),             # the RESTARTING write's reply was lost
    ((2, P, 1), (2, RD, 1), ["admitted"]),
    ((1, RN, 0), (1, "SUCCEEDED", 0), ["finished"]),
    ((1, P, 0), (1, "FAILED", 0), ["finished"]),        # admission timeout: finished, never admitted
    ((1, "CANCELLED", 0), (1, "CANCELLED", 0), []),
    ((1, RS, 0), (1, "CANCELLED", 0), ["finished"]),
])
def test_lifecycle_steps(before, after, steps) -> None:
    assert lifecycle_steps(before, after) == steps


def decision(not_before=0.0, held_by="", keeps=(), rule=""):
    return SimpleNamespace(gang=SimpleNamespace(not_before=not_before), held_by=held_by, keeps=keeps, rule=rule)


@pytest.mark.parametrize("d, cls", [
    (decision(not_before=105.0, rule="restart backoff"), "backoff"),
    (decision(held_by="older", rule="held back"), "held_back"),
    (decision(keeps=("n1",), rule="kept"), "keeps_nodes"),
    (decision(rule="would not fit even if empty"), "too_large"),
    (decision(), "no_room"),
    (decision(not_before=99.0), "no_room"),
])
def test_pending_class(d, cls) -> None:
    assert pending_class(d, now=100.0) == cls


@pytest.mark.parametrize("outcome, reason, label", [
    ("COMMIT", "every AZ voted yes", "commit"),
    ("ABORT", "az-b voted no", "abort"),
    ("ABORT", "in doubt: no decision within 4s in az-b", "in_doubt_abort"),
])
def test_twophase_outcome(outcome, reason, label) -> None:
    assert twophase_outcome(outcome, reason) == label


def test_not_leading_zeroes_the_view() -> None:
    m = CoordinatorMetrics(az="a")
    m.leading(7)
    m.view(pending=["no_room", "no_room", "backoff"], reservations=["COMMITTED"], holds=["PREPARED"],
           agents=2, nodes_ready=2, gpus_free=10, gpus_used=6)
    got = m.registry.get_sample_value
    assert got("phalanx_gangs_pending", {"reason": "no_room"}) == 2
    assert got("phalanx_gpus", {"az": "a", "state": "used"}) == 6
    assert got("phalanx_leader_epoch", {"az": "a"}) == 7
    m.not_leading()
    assert got("phalanx_gangs_pending", {"reason": "no_room"}) == 0
    assert got("phalanx_leader_epoch", {"az": "a"}) == 0
    assert got("phalanx_leadership_changes_total", {"az": "a"}) == 1
