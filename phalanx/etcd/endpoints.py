"""etcd endpoints: parsing ``host:port`` lists (``parse_endpoints``) and
which member the store talks to now (``EndpointRotation``, the failover
rule of docs/design.md §4). Pure."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Sequence


class InvalidEndpoint(ValueError):
    """An etcd endpoint that is not ``host:port``, ``http://host:port`` or
    ``[ipv6]:port``."""


@dataclass(frozen=True)
class Endpoint:
    """One etcd member's client address."""

    host: str  # a DNS name, an IPv4 address, or an IPv6 address without brackets
    port: int

    @property
    def target(self) -> str:
        """The gRPC target: plain ``host:port`` goes through gRPC's default
        (DNS) resolver, which also takes IP literals."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.target


_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_ENDPOINT_FORMS = "expected host:port, http://host:port or [ipv6]:port"


def parse_endpoint(text: str) -> Endpoint:
    """Parse one endpoint; ``InvalidEndpoint`` names it and says what is wrong."""

    def bad(why: str) -> InvalidEndpoint:
        return InvalidEndpoint(f"etcd endpoint {text!r}: {why} ({_ENDPOINT_FORMS})")

    rest = text.strip()
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme.lower() != "http":
            raise bad(f"scheme {scheme!r} is not supported (TLS comes from the etcd client files, "
                      f"--etcd-tls-dir; give host:port)")
    if rest.endswith("/"):
        rest = rest[:-1]
    if not rest:
        raise bad("empty")
    if "/" in rest or "@" in rest or "?" in rest or "#" in rest:
        raise bad("only host and port are allowed")
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise bad("unclosed '['")
        host, after = rest[1:close], rest[close + 1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad(f"{host!r} in brackets is not an IPv6 address") from None
        if not after.startswith(":"):
            raise bad("missing port")
        port_text = after[1:]
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep:
            raise bad("missing port")
        if ":" in host:
            raise bad("an IPv6 address needs brackets")
        if not _HOSTNAME.match(host):
            raise bad(f"{host!r} is not a host name or address" if host else "missing host")
    if not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise bad(f"port {port_text!r} is not a number in 1..65535" if port_text else "missing port")
    return Endpoint(host, int(port_text))


def parse_endpoints(endpoints: str | Sequence[str]) -> tuple[Endpoint, ...]:
    """A comma-separated string or a list of endpoints, in the order given
    (the first is used first: list the nearest member first)."""
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    items = [e for e in endpoints if e.strip()]
    if not items:
        raise InvalidEndpoint("etcd endpoints: at least one host:port is required")
    out = tuple(parse_endpoint(e) for e in items)
    seen: set[Endpoint] = set()
    for text, ep in zip(items, out):
        if ep in seen:
            raise InvalidEndpoint(f"etcd endpoint {text!r}: listed twice ({ep})")
        seen.add(ep)
    return out


@dataclass
class EndpointRotation:
    """Which member the store talks to now, and when to move on. Pure: the
    caller passes ``now``.

    Every call pins ``(current, generation)`` when it starts. A transient
    failure moves ``current`` only if nothing moved it since that call began
    (its generation is still current): ten calls that time out together on a
    dead member move the store once, not ten times around the ring. The move
    goes to the next member in list order that has not failed within
    ``suspect_s``; when every other member has, to the plain next one, so the
    store keeps cycling rather than sticking to a dead member. There is no
    move back: a member that works stays current (as clientv3's pinned
    endpoint does)."""

    count: int
    suspect_s: float = 10.0
    current: int = 0
    generation: int = 0
    failed_at: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.failed_at:
            self.failed_at = [float("-inf")] * self.count

    def pin(self) -> tuple[int, int]:
        return self.current, self.generation

    def failed(self, index: int, generation: int, now: float) -> bool:
        """Record that a call pinned to ``(index, generation)`` failed
        transiently; return whether the store moved to another member."""
        self.failed_at[index] = max(self.failed_at[index], now)
        if generation != self.generation or self.count < 2:
            return False
        nxt = (self.current + 1) % self.count
        for step in range(1, self.count):
            j = (self.current + step) % self.count
            if now - self.failed_at[j] >= self.suspect_s:
                nxt = j
                break
        self.current = nxt
        self.generation += 1
        return True
