"""The SDK without a cluster: address and state parsing, local validation
(a bad spec never leaves the client), deadlines against dead and silent
addresses, and the blocking facade."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from phalanx.client import (
    AsyncClient,
    Client,
    TerminalStateReached,
    is_terminal,
    parse_addresses,
    parse_states,
    state_name,
)
from phalanx.errors import PhalanxError, StoreUnavailable
from phalanx.model import GangState
from phalanx.spec import GangSpec, InvalidSpec
from phalanx.v1 import types_pb2 as pb


@pytest.fixture(autouse=True)
def _plaintext_client_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about parsing, deadlines and failover against dead or
    silent addresses, where no TLS handshake happens: plaintext, chosen
    explicitly ($PHALANX_INSECURE) as the client requires, and no config
    file of the machine's user (HOME is empty). Credentials have their own
    tests (test_client_config.py)."""
    for name in ("PHALANX_TLS_DIR", "PHALANX_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PHALANX_INSECURE", "1")
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture
def silent_listener() -> Iterator[tuple[socket.socket, str]]:
    """Accepts TCP connections (kernel backlog) but never speaks gRPC: a hung
    coordinator, as far as a client can tell."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    yield sock, f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def never_contacted(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


@pytest.fixture
def unused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


ADDRESSES: list[tuple[str, Any, tuple[str, ...]]] = [
    ("single", "127.0.0.1:7070", ("127.0.0.1:7070",)),
    ("comma-list", "a:1,b:2", ("a:1", "b:2")),
    ("spaces-and-blanks", " a:1 , ,b:2,", ("a:1", "b:2")),
    ("duplicates-dropped", "a:1,b:2,a:1", ("a:1", "b:2")),
    ("sequence", ["a:1", "b:2,c:3"], ("a:1", "b:2", "c:3")),
    ("scheme-stripped", "http://a:1/,grpc://b:2", ("a:1", "b:2")),
]


@pytest.mark.parametrize("given, expected", [c[1:] for c in ADDRESSES], ids=[c[0] for c in ADDRESSES])
def test_parse_addresses(given: Any, expected: tuple[str, ...]) -> None:
    assert parse_addresses(given) == expected


@pytest.mark.parametrize("given", ["", " , ", []], ids=["empty", "blanks", "empty-list"])
def test_parse_addresses_rejects_nothing(given: Any) -> None:
    with pytest.raises(ValueError):
        parse_addresses(given)


STATES: list[tuple[str, Any, set[GangState]]] = [
    ("enum", GangState.RUNNING, {GangState.RUNNING}),
    ("name-lowercase", "running", {GangState.RUNNING}),
    ("wire-name", "GANG_STATE_FAILED", {GangState.FAILED}),
    ("wire-int", 8, {GangState.CANCELLED}),
    ("mixed-list", ["pending", 5, GangState.FAILED], {GangState.PENDING, GangState.RUNNING, GangState.FAILED}),
    ("none", None, set()),
]


@pytest.mark.parametrize("given, expected", [c[1:] for c in STATES], ids=[c[0] for c in STATES])
def test_parse_states(given: Any, expected: set[GangState]) -> None:
    assert parse_states(given) == expected


@pytest.mark.parametrize("given", ["done", 0, 42, [True], [1.5]], ids=["unknown-name", "unspecified", "unknown-int", "bool", "float"])
def test_parse_states_rejects(given: Any) -> None:
    with pytest.raises(ValueError):
        parse_states(given)


def test_state_helpers() -> None:
    assert state_name(pb.Gang(state=pb.GANG_STATE_RUNNING)) == "RUNNING"
    assert state_name(pb.Gang()) == "UNSPECIFIED"
    assert is_terminal(pb.Gang(state=pb.GANG_STATE_CANCELLED))
    assert not is_terminal(pb.Gang(state=pb.GANG_STATE_RESTARTING))


def test_terminal_state_reached_says_what_happened() -> None:
    gang = pb.Gang(id="g-1", state=pb.GANG_STATE_FAILED, reason="member 3 exited 1")
    exc = TerminalStateReached(gang, {GangState.RUNNING})
    assert exc.state == GangState.FAILED
    assert "g-1" in str(exc) and "FAILED" in str(exc) and "RUNNING" in str(exc) and "member 3" in str(exc)
    assert isinstance(exc, PhalanxError)


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError):
        AsyncClient("a:1", timeout=0)


BAD_SPECS: list[tuple[str, Any, str]] = [
    ("mapping", {"name": "g", "members": -3, "resources": {"gpus": 1}}, "members"),
    ("yaml-text", "name: g\nmembers: 2\nresources: {gpus: 0}\n", "resources.gpus"),
    ("dataclass-built-by-hand", GangSpec(name="g", members=-1), "members"),
    ("protobuf", pb.GangSpec(name="g", members=2, resources=pb.Resources(gpus=1), topology=pb.TopologyConstraint(required=42)), "topology.required"),
    ("wrong-type", 42, "spec"),
]


@pytest.mark.parametrize("spec, field", [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
async def test_submit_validates_locally(spec: Any, field: str, silent_listener: tuple[socket.socket, str]) -> None:
    sock, address = silent_listener
    async with AsyncClient(address, timeout=2) as client:
        with pytest.raises(InvalidSpec) as info:
            await client.submit(spec)
    assert field in [e.field for e in info.value.errors]
    assert never_contacted(sock)


async def test_unreachable_addresses_raise_unavailable_naming_them(unused_address: str) -> None:
    other = "127.0.0.1:1"
    async with AsyncClient([unused_address, other], timeout=1.5) as client:
        with pytest.raises(StoreUnavailable) as info:
            await client.get("g-1")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert unused_address in str(info.value) and other in str(info.value)


async def test_a_hung_server_cannot_outlast_the_deadline(silent_listener: tuple[socket.socket, str], unused_address: str) -> None:
    _, address = silent_listener
    async with AsyncClient(f"{address},{unused_address}", timeout=1.0) as client:
        with pytest.raises(PhalanxError):
            await client.status()
        with pytest.raises(PhalanxError):
            async for _ in client.watch("g-1"):
                pass


async def test_wait_needs_a_state(unused_address: str) -> None:
    async with AsyncClient(unused_address) as client:
        with pytest.raises(ValueError):
            await client.wait("g-1", [], timeout=1)


async def test_closed_client_refuses_calls(unused_address: str) -> None:
    client = AsyncClient(unused_address)
    await client.close()
    with pytest.raises(RuntimeError):
        await client.get("g-1")


def test_blocking_client(unused_address: str, silent_listener: tuple[socket.socket, str]) -> None:
    sock, address = silent_listener
    with Client(address, timeout=1.0) as client:
        with pytest.raises(InvalidSpec):
            client.submit({"name": "g", "members": 0, "resources": {"gpus": 1}})
        assert never_contacted(sock)
    with Client(unused_address, timeout=1.0) as client:
        with pytest.raises(StoreUnavailable):
            client.get("g-1")
        with pytest.raises(StoreUnavailable):
            list(client.watch("g-1"))
    client.close()  # closing twice is harmless


BAD_ADDRESSES: list[tuple[str, str, str]] = [
    ("port-over-65535", "127.0.0.1:99999", "port must be between 1 and 65535"),
    ("port-zero", "h:0", "port must be between 1 and 65535"),
    ("port-with-many-digits", "h:000000000000007070", "port must be between 1 and 65535"),
    ("no-port", "127.0.0.1", "is not host:port"),
    ("no-host", ":7070", "is not host:port"),
    ("space-inside", "my host:7070", "is not host:port"),
    ("path", "h:7070/x", "is not host:port"),
]


@pytest.mark.parametrize("given, words", [c[1:] for c in BAD_ADDRESSES], ids=[c[0] for c in BAD_ADDRESSES])
def test_parse_addresses_names_a_bad_entry(given: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_addresses(f"a:1,{given}")
    assert words in str(info.value) and given.strip() in str(info.value)


def test_parse_addresses_accepts_ipv6_and_names() -> None:
    assert parse_addresses("[::1]:7070, coord-0.az-a.svc:7071") == ("[::1]:7070", "coord-0.az-a.svc:7071")


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), 1e11, 3600.5, "10"], ids=str)
def test_timeout_is_range_checked(timeout: Any) -> None:
    with pytest.raises(ValueError, match="timeout"):
        AsyncClient("a:1", timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        Client("a:1", timeout=timeout)


@pytest.mark.parametrize("limit", [-1, 2**31, 10**20, True, 1.5], ids=str)
async def test_list_limit_is_range_checked_before_sending(limit: Any, silent_listener: tuple[socket.socket, str]) -> None:
    sock, address = silent_listener
    async with AsyncClient(address, timeout=1) as client:
        with pytest.raises(ValueError, match="limit"):
            await client.list(limit=limit)
    assert never_contacted(sock)


def test_address_less_clients_read_phalanx_address(unused_address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.client import ADDRESS_ENV, DEFAULT_ADDRESS

    monkeypatch.setenv(ADDRESS_ENV, f"{unused_address},127.0.0.1:1")
    assert AsyncClient().addresses == (unused_address, "127.0.0.1:1")
    with Client(timeout=1.0) as client:
        assert client.addresses == (unused_address, "127.0.0.1:1")
        with pytest.raises(StoreUnavailable) as info:
            client.get("g-1")
    assert unused_address in str(info.value)
    monkeypatch.delenv(ADDRESS_ENV)
    assert AsyncClient().addresses == (DEFAULT_ADDRESS,)
    monkeypatch.setenv(ADDRESS_ENV, "h:99999")
    with pytest.raises(ValueError, match="port"):
        Client()
