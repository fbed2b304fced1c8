"""The ``/metrics`` endpoint of every phalanx process (docs/metrics.md).

Each process keeps its metrics in its OWN ``CollectorRegistry``
(``new_registry``), never prometheus_client's global default: a test that
runs several coordinators and agents in one Python process must not see one
counter shared between them.

``serve`` starts prometheus_client's WSGI exposition in a daemon thread.
With ``tls`` (the process's --tls-dir files) it serves only HTTPS and asks
every scraper for a client certificate of the cluster's CA naming an
identity of ``cluster`` (any role: the metrics carry no gang ids, node names
or secrets, see docs/metrics.md); a plaintext request or a certificate of
another CA or cluster gets the connection closed. The TLS handshake runs in
the connection's own thread under a deadline, so a scraper that connects
and sends nothing does not hold up the others, and the files are read again
when they change (a renewed certificate is served from the next connection
on), like the gRPC ports do.
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import ssl
import threading
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler, make_wsgi_app
from wsgiref.simple_server import make_server

from phalanx.timings import Timings
from phalanx.tls import TlsError, TlsFiles, load, utc_now
from phalanx.certs import IdentityError, identity_of
from cryptography import x509

__all__ = ["new_registry", "serve", "scrape", "MetricsServer", "ScrapeError", "parse_listen", "format_address"]

log = logging.getLogger("phalanx.metrics")


def new_registry() -> CollectorRegistry:
    """A registry of one process's own metrics (see the module docstring)."""
    return CollectorRegistry(auto_describe=True)


def parse_listen(listen: str, flag: str = "--metrics-listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ValueError naming
    ``flag`` and what is wrong."""
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise ValueError(f"{flag}: expected HOST:PORT (127.0.0.1:0 picks a free port), got {listen!r}")
    try:
        n = int(port)
    except ValueError:
        raise ValueError(f"{flag}: the port must be a number, got {port!r} in {listen!r}") from None
    if not 0 <= n <= 65535:
        raise ValueError(f"{flag}: the port must be 0..65535, got {n} in {listen!r}")
    return host, n


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Context:
    """An ssl server context built from the files, rebuilt when they
    change; a changed set that fails the checks is logged once and the
    previous context stays (as phalanx.tls does for gRPC)."""

    def __init__(self, files: TlsFiles, cluster: str) -> None:
        self.files = files
        self.cluster = cluster
        self._lock = threading.Lock()
        self._seen = self._stat()
        self._refused: Any = None
        self.context, self.cas = self._build()  # raises TlsError: the endpoint does not start

    def _stat(self) -> tuple[Any, ...]:
        out: list[Any] = []
        for p in self.files.paths():
            try:
                st = os.stat(p)
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError as exc:
                out.append(("missing", exc.errno))
        return tuple(out)

    def _build(self) -> tuple[ssl.SSLContext, tuple[x509.Certificate, ...]]:
        # Checked as a client certificate: every role's certificate is one,
        # while only a coordinator's is also marked for server use (and an
        # agent serves its metrics too).
        loaded = load(self.files, cluster=self.cluster, use="client", now=utc_now())
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=loaded.ca_pem.decode())
        try:
            ctx.load_cert_chain(str(self.files.cert), str(self.files.key))
        except (ssl.SSLError, OSError) as exc:  # replaced between load() and here
            raise TlsError(self.files.cert, "cannot read", str(exc)) from None
        return ctx, loaded.cas

    def current(self) -> tuple[ssl.SSLContext, tuple[x509.Certificate, ...]]:
        with self._lock:
            seen = self._stat()
            if seen != self._seen and seen != self._refused:
                try:
                    self.context, self.cas = self._build()
                    self._seen, self._refused = seen, None
                    log.info("metrics: now serving the renewed certificate %s", self.files.cert)
                except TlsError as exc:
                    self._refused = seen
                    log.error("metrics: keeping the current certificate: the files on disk are refused: %s", exc)
            return self.context, self.cas


class _Server(ThreadingWSGIServer):
    """prometheus_client's threading WSGI server, with the TLS handshake
    moved from accept() (the one serving thread) into the connection's
    thread."""

    daemon_threads = True
    tls: _Context | None = None
    cluster = ""
    handshake_timeout_s = 5.0

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        ctx, cas = self.tls.current()
        request.settimeout(self.handshake_timeout_s)
        try:
            conn = ctx.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            # A plaintext request, a certificate of another CA, or none.
            log.debug("metrics: refused a connection from %s: %s", client_address, exc)
            request.close()
            return
        try:
            der = conn.getpeercert(binary_form=True)
            try:
                identity_of(x509.load_der_x509_certificate(der or b""), ca=cas, cluster=self.cluster, now=utc_now())
            except (IdentityError, ValueError) as exc:
                log.debug("metrics: refused a scraper from %s: %s", client_address, exc)
                return
            super().finish_request(conn, client_address)
        finally:
            conn.close()


class MetricsServer:
    """A running endpoint: ``address`` is HOST:PORT as bound; ``close()``
    stops it and frees the port."""

    def __init__(self, httpd: _Server, thread: threading.Thread, address: str, scheme: str) -> None:
        self._httpd = httpd
        self._thread = thread
        self.address = address
        self.scheme = scheme

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve(listen: str, registry: CollectorRegistry, *, tls: TlsFiles | None, cluster: str,
          handshake_timeout_s: float | None = None) -> tuple[MetricsServer | None, str]:
    """Serve ``registry`` at ``http(s)://listen/metrics``; ``listen`` "" is
    off: (None, ""). Returns the server and the bound HOST:PORT. ValueError
    for a malformed ``listen``, TlsError for unusable ``tls`` files, OSError
    for an address that does not resolve or a port that is taken."""
    if not listen:
        return None, ""
    host, port = parse_listen(listen)
    context = _Context(tls, cluster) if tls is not None else None
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]

    class Bound(_Server):
        address_family = family

    Bound.tls = context
    Bound.cluster = cluster
    Bound.handshake_timeout_s = handshake_timeout_s or Timings().metrics_handshake_timeout_s
    httpd = make_server(sockaddr[0], port, make_wsgi_app(registry), Bound, handler_class=_SilentHandler)
    bound_host, bound_port = httpd.server_address[:2]
    address = format_address(str(bound_host), int(bound_port))
    thread = threading.Thread(target=httpd.serve_forever, name=f"metrics {address}", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread, address, "https" if tls is not None else "http"), address


class ScrapeError(Exception):
    """A scrape that did not return metrics: the address and why."""


def scrape(address: str, *, tls: TlsFiles | None, cluster: str, timeout_s: float = 5.0) -> str:
    """GET ``/metrics`` of a phalanx process at HOST:PORT and return the text
    (for tests, ``phalanx top`` and the chaos report). With ``tls`` (a client
    dir's files, e.g. the admin's): HTTPS with that certificate, and the
    server's certificate must be of the same CA and cluster. It is checked
    here rather than by ssl's own verification because an agent's
    certificate is marked for client use only and names no host, while it
    serves its metrics too."""
    host, port = parse_listen(address, flag="address")
    try:
        if tls is None:
            conn: http.client.HTTPConnection = http.client.HTTPConnection(host, port, timeout=timeout_s)
        else:
            loaded = load(tls, cluster=cluster, use="client", now=utc_now())
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE  # checked below, with identity_of
            ctx.load_cert_chain(str(tls.cert), str(tls.key))
            conn = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=ctx)
            conn.connect()
            der = conn.sock.getpeercert(binary_form=True)  # type: ignore[union-attr]
            try:
                identity_of(x509.load_der_x509_certificate(der or b""), ca=loaded.cas, cluster=cluster, now=utc_now())
            except (IdentityError, ValueError) as exc:
                conn.close()
                raise ScrapeError(f"{address}: the server's certificate is not of cluster {cluster!r}'s CA: {exc}") from None
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as exc:
        raise ScrapeError(f"{address}: {type(exc).__name__}: {exc}") from None
    if resp.status != 200:
        raise ScrapeError(f"{address}: HTTP {resp.status} {resp.reason}")
    return body.decode()
