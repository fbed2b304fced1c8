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

# Below Linux's default ephemeral range (32768-60999), so an outgoing
# connection of the node never holds one of them by chance, and clear of the
# privileged ports (< 1024) that need root to bind.
DEFAULT_PORTS: tuple[int, int] = (20000, 29999)
MIN_PORT, MAX_PORT = 1024, 65535


def validate_port_range(first: int, last: int, field: str) -> tuple[int, int]:
    """``(first, last)``, both included; ValueError naming ``field`` and why."""
    if not (MIN_PORT <= first <= MAX_PORT and MIN_PORT <= last <= MAX_PORT):
        raise ValueError(f"{field}: ports must lie in {MIN_PORT}-{MAX_PORT} (below {MIN_PORT} needs root), got {first}-{last}")
    if first > last:
        raise ValueError(f"{field}: the first port {first} is above the last {last}")
    return first, last


def parse_port_range(text: str, field: str) -> tuple[int, int]:
    """``"20000-29999"`` (or one port, ``"29500"``) -> ``(20000, 29999)``."""
    first, sep, last = text.strip().partition("-")
    try:
        lo = int(first)
        hi = int(last) if sep else lo
    except ValueError:
        raise ValueError(f"{field}: expected FIRST-LAST (e.g. 20000-29999), got {text!r}") from None
    return validate_port_range(lo, hi, field)


def split_port_range(first: int, last: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` disjoint consecutive slices of ``first..last``, as equal as
    possible: simulated nodes sharing one host each own one, so two gangs
    whose rank 0 sit on different simulated nodes never get the same port.
    ValueError when there are fewer ports than parts."""
    size = last - first + 1
    if parts < 1:
        raise ValueError(f"parts: at least 1, got {parts}")
    if size < parts:
        raise ValueError(f"{first}-{last} holds {size} ports, fewer than the {parts} nodes that each need one")
    out, lo = [], first
    for i in range(parts):
        n = size // parts + (1 if i < size % parts else 0)
        out.append((lo, lo + n - 1))
        lo += n
    return out


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
