"""Message-size limits, retry pushback and malformed-request handling, the same on every service.

Sizes: a public port takes messages up to its configured limit (the router's
`max_message_bytes`); every internal hop (servers and channels between services) takes up to
`INTERNAL_MAX_MESSAGE_BYTES`, which no public limit may exceed, so a request the public port
accepted never fails on an internal hop for its size. gRPC itself answers a message over a
limit with RESOURCE_EXHAUSTED ("Received message larger than max (N vs. LIMIT)") before reading
it; a retry cannot help, so such an answer carries no pushback.

Overload (RESOURCE_EXHAUSTED from a full queue or a full worker) carries trailing metadata
`grpc-retry-pushback-ms`: gRPC's retry pushback, the time after which a retry may succeed.

A request whose bytes are no valid protobuf gets INVALID_ARGUMENT, not grpc.aio's UNKNOWN:
`DecodeGuard` wraps each method's deserializer so that a decode failure becomes a `Malformed`
value, and the method's handler aborts on it before the servicer sees it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from llmfleet.shared.core.config import INTERNAL_MAX_MESSAGE_BYTES
from llmfleet.shared.wire.grpc_handlers import handler_behavior, rebuild_handler

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
DEFAULT_RETRY_AFTER_S = 1.0


def server_options(max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


# A channel that lost its peer reconnects after a backoff that grows with each failed try
# (gRPC's default: from 1 s up to 120 s). Between services a peer that went away is mostly one
# being restarted, so the backoff stays short: a restarted service is reached again within
# about 2 s, inside the waits of the calls that wait for it (wait_for_ready with a bound).
RECONNECT_BACKOFF_MS = (200, 2000)  # initial, max


def channel_options() -> list[tuple[str, int]]:
    """Options of a channel between llmfleet services (internal hops)."""
    initial, most = RECONNECT_BACKOFF_MS
    return [
        *server_options(INTERNAL_MAX_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", initial),
        ("grpc.min_reconnect_backoff_ms", initial),
        ("grpc.max_reconnect_backoff_ms", most),
    ]


def pushback_metadata(retry_after_s: float) -> tuple[tuple[str, str], ...]:
    return ((RETRY_PUSHBACK_KEY, str(max(0, round(retry_after_s * 1000)))),)


def pushback_s(trailing_metadata: Any) -> float | None:
    """The retry pushback (seconds) in a call's trailing metadata; None if absent or invalid."""
    for key, value in trailing_metadata or ():
        if key == RETRY_PUSHBACK_KEY:
            try:
                ms = int(value)
            except (TypeError, ValueError):
                return None
            return ms / 1000 if ms >= 0 else None
    return None


class Malformed:
    """A request message that did not parse (what a guarded deserializer returns)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Malformed request messages -> INVALID_ARGUMENT naming the method's request type."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _guard(handler, details.method)


def _guard(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer

    def guarded(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as exc:
            return Malformed(str(exc) or type(exc).__name__)

    async def reject(context: grpc.aio.ServicerContext, bad: Malformed) -> None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is malformed: {bad.reason}"
        )

    def unary_request(behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):

            async def stream_out(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, Malformed):
                    await reject(context, request)
                async for item in behavior(request, context):
                    yield item

            return stream_out

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await reject(context, request)
            return await behavior(request, context)

        return call

    def stream_request(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def checked(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Malformed):
                    await reject(context, request)
                yield request

        if inspect.isasyncgenfunction(behavior):

            async def stream_out(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async for item in behavior(checked(requests, context), context):
                    yield item

            return stream_out

        async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(checked(requests, context), context)

        return call

    behavior = handler_behavior(handler)
    if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
        return handler  # a sync handler: left as it is
    wrap = stream_request if handler.request_streaming else unary_request
    return rebuild_handler(handler, wrap(behavior), request_deserializer=guarded)
