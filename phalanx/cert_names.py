"""The names a client needs before it touches a certificate: the files
``phalanx certs`` writes and the DNS name every coordinator certificate
carries. Apart from phalanx.certs so that dialing a coordinator (the CLI,
the SDK) imports no X.509 library when its files were checked before
(phalanx/tls_check_cache.py)."""

from __future__ import annotations

from pathlib import Path

CA_CERT = "ca.crt"
# Every coordinator certificate also names this DNS host (not a real one:
# ``.invalid`` never resolves), and every client of a coordinator checks the
# server's certificate against it, whatever address it dialed. So a client
# can dial any address (a pod IP, a netns address, a proxy) and still only a
# coordinator certificate of its cluster's CA passes.
SERVER_NAME_SUFFIX = "phalanx.invalid"


def coordinator_server_name(cluster: str) -> str:
    """The DNS name every coordinator certificate of ``cluster`` carries."""
    return f"coordinators.{cluster}.{SERVER_NAME_SUFFIX}"


def leaf_paths(directory: Path, role: str, name: str) -> tuple[Path, Path]:
    """Where ``phalanx certs issue`` writes a certificate and its key."""
    return directory / f"{role}-{name}.crt", directory / f"{role}-{name}.key"
