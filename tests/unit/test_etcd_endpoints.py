"""etcd endpoint parsing and the rule that picks the member a Store talks to."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from phalanx.store import Endpoint, EndpointRotation, InvalidEndpoint, parse_endpoint, parse_endpoints

# --- parsing -------------------------------------------------------------------

VALID = {
    "host and port": ("127.0.0.1:2379", Endpoint("127.0.0.1", 2379), "127.0.0.1:2379"),
    "http scheme is dropped": ("http://127.0.0.1:2379", Endpoint("127.0.0.1", 2379), "127.0.0.1:2379"),
    "scheme is case-insensitive": ("HTTP://10.0.0.1:2379", Endpoint("10.0.0.1", 2379), "10.0.0.1:2379"),
    "trailing slash is dropped": ("http://etcd-a.example:2379/", Endpoint("etcd-a.example", 2379), "etcd-a.example:2379"),
    "dns name": ("etcd-0.etcd.phalanx.svc:2379", Endpoint("etcd-0.etcd.phalanx.svc", 2379), "etcd-0.etcd.phalanx.svc:2379"),
    "underscore in a container name": ("etcd_1:2379", Endpoint("etcd_1", 2379), "etcd_1:2379"),
    "surrounding spaces": ("  localhost:2379 ", Endpoint("localhost", 2379), "localhost:2379"),
    "ipv6 loopback in brackets": ("[::1]:2379", Endpoint("::1", 2379), "[::1]:2379"),
    "ipv6 with scheme": ("http://[fd00::a:1]:32379", Endpoint("fd00::a:1", 32379), "[fd00::a:1]:32379"),
}


@pytest.mark.parametrize("text,endpoint,target", VALID.values(), ids=VALID.keys())
def test_parse_endpoint_accepts(text: str, endpoint: Endpoint, target: str) -> None:
    assert parse_endpoint(text) == endpoint
    assert endpoint.target == target


INVALID = {
    "no port": ("localhost", "missing port"),
    "empty port": ("localhost:", "missing port"),
    "port zero": ("localhost:0", "not a number in 1..65535"),
    "port too large": ("localhost:65536", "not a number in 1..65535"),
    "port is a name": ("localhost:etcd", "not a number in 1..65535"),
    "no host": (":2379", "missing host"),
    "tls scheme": ("https://etcd:2379", "scheme 'https' is not supported"),
    "unix socket": ("unix:///run/etcd.sock", "scheme 'unix' is not supported"),
    "path": ("http://etcd:2379/v3", "only host and port"),
    "user info": ("root@etcd:2379", "only host and port"),
    "ipv6 without brackets": ("::1:2379", "needs brackets"),
    "ipv6 without port": ("[::1]", "missing port"),
    "unclosed bracket": ("[::1:2379", "unclosed"),
    "brackets around a name": ("[etcd]:2379", "not an IPv6 address"),
    "space inside": ("etcd a:2379", "not a host name"),
    "empty": ("", "empty"),
}


@pytest.mark.parametrize("text,why", INVALID.values(), ids=INVALID.keys())
def test_parse_endpoint_rejects_naming_the_endpoint(text: str, why: str) -> None:
    with pytest.raises(InvalidEndpoint) as info:
        parse_endpoint(text)
    assert repr(text) in str(info.value)
    assert why in str(info.value)


def test_parse_endpoints_keeps_order_and_takes_a_comma_separated_string() -> None:
    assert parse_endpoints("b:1, http://a:2,[::1]:3,") == (Endpoint("b", 1), Endpoint("a", 2), Endpoint("::1", 3))
    assert parse_endpoints(["a:1", "b:2"]) == (Endpoint("a", 1), Endpoint("b", 2))


def test_parse_endpoints_names_the_bad_one_in_a_list() -> None:
    with pytest.raises(InvalidEndpoint, match="'b:x'"):
        parse_endpoints("a:1,b:x,c:3")


def test_parse_endpoints_rejects_a_member_listed_twice() -> None:
    with pytest.raises(InvalidEndpoint, match="'http://a:1': listed twice"):
        parse_endpoints(["a:1", "http://a:1"])


@pytest.mark.parametrize("value", ["", ",", []], ids=["empty string", "only commas", "empty list"])
def test_parse_endpoints_needs_one(value) -> None:
    with pytest.raises(InvalidEndpoint, match="at least one"):
        parse_endpoints(value)


# --- rotation --------------------------------------------------------------------


@dataclass(frozen=True)
class Failed:
    """A call pinned to ``index`` at ``generation`` failed at ``now``."""

    index: int
    generation: int
    now: float


ROTATION = {
    "a failure of the current member moves to the next": (3, [Failed(0, 0, 0.0)], [True], 1),
    "calls that failed together on one member move it once": (
        3, [Failed(0, 0, 0.0), Failed(0, 0, 0.1), Failed(0, 0, 0.2)], [True, False, False], 1,
    ),
    "a late failure from before the last move moves nothing even after a full cycle": (
        2, [Failed(0, 0, 0.0), Failed(1, 1, 0.1), Failed(0, 0, 0.2)], [True, True, False], 0,
    ),
    "a member that failed recently is skipped": (
        # 0 fails, then 1; a late call pinned to 0 fails again; then 2 fails:
        # 0 is still suspect, 1 is not any more.
        3, [Failed(0, 0, 0.0), Failed(1, 1, 1.0), Failed(0, 0, 15.0), Failed(2, 2, 16.0)], [True, True, False, True], 1,
    ),
    "a member whose failure is older than suspect_s is used again": (
        3, [Failed(0, 0, 0.0), Failed(1, 1, 1.0), Failed(2, 2, 16.0)], [True, True, True], 0,
    ),
    "when every other member failed recently it keeps cycling": (
        3, [Failed(0, 0, 0.0), Failed(1, 1, 1.0), Failed(2, 2, 2.0), Failed(0, 3, 3.0)], [True, True, True, True], 1,
    ),
    "a single member never moves": (1, [Failed(0, 0, 0.0), Failed(0, 0, 1.0)], [False, False], 0),
}


@pytest.mark.parametrize("count,steps,moved,current", ROTATION.values(), ids=ROTATION.keys())
def test_rotation(count: int, steps: list[Failed], moved: list[bool], current: int) -> None:
    r = EndpointRotation(count, suspect_s=10.0)
    assert r.pin() == (0, 0)
    assert [r.failed(s.index, s.generation, s.now) for s in steps] == moved
    assert r.current == current
    assert r.generation == sum(moved)
