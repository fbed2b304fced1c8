"""Where a gang's members meet: ``MASTER_ADDR`` / ``MASTER_PORT`` (docs/launcher.md).

Pure: no I/O. Every node agent owns a range of ports for the rendezvous of
gangs whose rank 0 runs on its node and advertises it with its address at
registration. When a gang is placed, its leader picks the port from the rank-0
node's range and writes it, with that node's address, into the gang record, so
every later dispatch (a re-sent assignment, a successor leader, the other AZs
of a cross-AZ gang) gives every member the same rendezvous.
"""

from __future__ import annotations

import hashlib
from typing import Collection, Iterable



def _start(gang_id: str, incarnation: int, size: int) -> int:
    digest = hashlib.sha256(f"{gang_id}#{incarnation}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % size


def pick_master_port(ports: tuple[int, int], gang_id: str, incarnation: int, taken: Collection[int] = ()) -> int:
    """The rendezvous port of one incarnation of a gang.

    Starts at a point of the range that depends on (gang, incarnation), so a
    restarted gang moves to another port, and walks the range to the first
    port not in ``taken`` (the ports of the rank-0 node's other live gangs,
    and this gang's previous port). With every port taken it returns the
    starting one: the rank-0 agent then refuses the start with a clear reason
    rather than share a port."""
    first, last = ports
    size = last - first + 1
    start = _start(gang_id, incarnation, size)
    for k in range(size):
        port = first + (start + k) % size
        if port not in taken:
            return port
    return first + start


def ports_taken_on(node: str, gangs: Iterable[tuple[str, str, int]], *, except_gang: str) -> set[int]:
    """Of ``(gang id, rank-0 node, port)`` for the live gangs a leader knows,
    the ports in use on ``node`` by gangs other than ``except_gang``."""
    return {port for gid, n, port in gangs if n == node and port and gid != except_gang}
