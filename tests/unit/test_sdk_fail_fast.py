"""The SDK's ``fail_fast`` (docs/cli.md): a round in which no address can
even be connected to ends the call with "nothing is listening", instead of
retrying until the deadline. The deadline here (an hour) is far beyond the
test's own timeout, so a call that waits it out fails the test. A real
closed port."""

from __future__ import annotations

import socket

import pytest

from phalanx.client import AsyncClient, Client
from phalanx.errors import PhalanxError


pytestmark = pytest.mark.timeout(60)


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_blocking_client_fails_fast() -> None:
    address = closed_port()
    with Client(address, timeout=3600, insecure=True, fail_fast=True) as c:
        with pytest.raises(PhalanxError) as e:
            c.status()
    assert f"nothing is listening at {address}" in str(e.value)


async def test_async_client_fails_fast() -> None:
    address = closed_port()
    c = AsyncClient(address, timeout=3600, insecure=True, fail_fast=True)
    try:
        with pytest.raises(PhalanxError) as e:
            await c.status()
    finally:
        await c.close()
    assert f"nothing is listening at {address}" in str(e.value)
