"""Requests that are not a protobuf message get INVALID_ARGUMENT.

grpc's server decodes a request before any servicer code runs; when the bytes
do not parse it answers UNKNOWN ("Unexpected DecodeError"), which says
nothing about whose fault it is. This interceptor lets the decode fail into
a marker instead, and the method answers INVALID_ARGUMENT naming the error
(docs/limits.md "Malformed messages"). For a method whose requests are a
stream (the agents' Session) the servicer reads a checked stream: the first
message that does not parse ends the call with INVALID_ARGUMENT.
"""

from __future__ import annotations

import inspect
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc


class _Undecodable:
    def __init__(self, why: str):
        self.why = why


def _safe(decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return decode(raw)
        except Exception as exc:  # noqa: BLE001 - any decode failure is the sender's
            return _Undecodable(f"{type(exc).__name__}: {exc}")

    return deserialize


async def _refuse(request: _Undecodable, context: grpc.aio.ServicerContext, method: str) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"request: not a valid {method} message ({request.why[:200]})")


class UndecodableRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method.rsplit("/", 1)[-1]
        if handler.request_streaming:
            if not handler.response_streaming:
                return handler  # no stream-unary method exists; nothing to wrap
            inner_bidi = handler.stream_stream

            async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async def checked() -> AsyncIterator[Any]:
                    async for request in requests:
                        if isinstance(request, _Undecodable):
                            await _refuse(request, context, method)  # raises: the call ends
                        yield request

                async for item in inner_bidi(checked(), context):
                    yield item

            return handler._replace(request_deserializer=_safe(handler.request_deserializer), stream_stream=stream_stream)
        if handler.response_streaming:
            inner_stream = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await _refuse(request, context, method)
                    return
                async for item in inner_stream(request, context):
                    yield item

            async def unary_writes(request: Any, context: grpc.aio.ServicerContext) -> None:
                # A handler that writes with context.write (coordinator/broadcast.py serve).
                if isinstance(request, _Undecodable):
                    await _refuse(request, context, method)
                    return
                await inner_stream(request, context)

            wrapped = unary_stream if inspect.isasyncgenfunction(inner_stream) else unary_writes
            return handler._replace(request_deserializer=_safe(handler.request_deserializer), unary_stream=wrapped)
        inner = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse(request, context, method)
            return await inner(request, context)

        return handler._replace(request_deserializer=_safe(handler.request_deserializer), unary_unary=unary_unary)
