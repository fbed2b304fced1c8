"""The I/O of the rendezvous (docs/launcher.md): which address this node
advertises, and whether a port is free to bind."""

from __future__ import annotations

import errno
import ipaddress
import socket


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def local_address_towards(address: str) -> str:
    """The local address this host's sockets use towards ``host:port``: the
    address a peer on the coordinator's network reaches us at. A UDP
    ``connect`` sends nothing; it only makes the kernel pick the route and
    source address. "" when there is no route (the caller falls back)."""
    try:
        host, port = split_host_port(address)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, ValueError):
        return ""
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return ""


def bind_error(port: int, address: str = "") -> str | None:
    """None when ``port`` can be bound (for listening) on every address of
    this host, else why not. SO_REUSEADDR as rendezvous servers set it: a
    connection in TIME_WAIT does not make a port unusable, a listener does.
    The wildcard bind also collides with a listener on any one address."""
    family, wildcard = socket.AF_INET, "0.0.0.0"
    try:
        if address and ipaddress.ip_address(address).version == 6:
            family, wildcard = socket.AF_INET6, "::"
    except ValueError:
        pass  # a DNS name: IPv4, like most rendezvous servers
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((wildcard, port))
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return f"bind: {name}"
    return None
