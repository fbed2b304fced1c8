"""A core's refusal answered over gRPC: the one place where
``peer_auth.Code`` (neutral, so the cores import no gRPC) becomes the gRPC
status of the same name."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from coordinator.core.peer_auth import Code, Refusal


def status(code: Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


async def abort(context: Any, refusal: Refusal) -> NoReturn:
    """End the call with the refusal's status and message (grpc.aio's
    ``abort`` raises)."""
    await context.abort(status(refusal.code), refusal.message)
    raise AssertionError("unreachable: abort raises")
