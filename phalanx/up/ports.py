"""The coordinators' listen ports: ``--base-port``, ``+1``, ... where free,
a free port for each one taken (docs/local-cluster.md, Ports)."""

from __future__ import annotations

import socket

from phalanx.etcd_server import free_port


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR like the gRPC server itself: a TIME_WAIT leftover does
        # not make a port unusable, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def replaced_ports(base: int, ports: list[int]) -> list[tuple[int, int]]:
    """(asked, taken instead) for every port of ``ports`` that is not
    ``base + i``; none with base 0 (nothing was asked for)."""
    if not base:
        return []
    return [(base + i, p) for i, p in enumerate(ports) if p != base + i]


def pick_ports(base: int, count: int) -> list[int]:
    """``base, base+1, ...`` so PHALANX_ADDRESS is the same from run to run;
    any taken port (or all, with base 0) replaced by a free one
    (``replaced_ports`` says which, for the warning)."""
    ports: list[int] = []
    for i in range(count):
        port = base + i if base else 0
        if not port or not port_is_free(port):
            port = free_port()
            while port in ports:
                port = free_port()
        ports.append(port)
    return ports
