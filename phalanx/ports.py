"""Port ranges of node agents (docs/launcher.md): parsed and checked the same
way by the agent that owns one and the coordinator that picks from it.
Pure; in the shared `phalanx` package because both sides use it."""

from __future__ import annotations

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
