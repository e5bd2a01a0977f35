"""Server side of trace propagation over gRPC: one SERVER span per RPC that belongs to a trace.

    server = grpc.aio.server(interceptors=[ServerTracing(own_span=GENERATE)])

An RPC whose metadata carries a W3C `traceparent` gets a span named `<package.Service>/<Method>`
(OpenTelemetry RPC conventions: `rpc.system`, `rpc.service`, `rpc.method`,
`rpc.grpc.status_code`), child of the caller's span. For unary-response RPCs the span is the
current span while the handler runs, so the handler's own spans and outgoing calls nest under
it; streaming-response handlers get the span without it being made current (a context attached
across an async generator's yields could be detached from another task when grpc finalizes the
generator), and make spans of their own from an explicit context if they need to.

RPCs without a traceparent (heartbeats, stats polls, KV snapshots, probes) get no span: work that
is no request's part starts no trace. Health and reflection never get one. Methods listed in
`own_span` are left alone: their servicer makes the SERVER span itself (the router's
`llm_request`). The client side needs no interceptor: callers pass
`metadata=tracing.metadata(ctx)` (one lookup, nothing added outside a trace).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from llmfleet.shared.wire.grpc_handlers import handler_behavior, rebuild_handler
from llmfleet.shared.wire.tracing import context_from_metadata

logger = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

_UNTRACED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def _finish(span: Span, context: grpc.aio.ServicerContext, exc: BaseException | None) -> None:
    code = context.code()  # None unless the handler set or aborted with one
    if not isinstance(code, grpc.StatusCode):
        if exc is None:
            code = grpc.StatusCode.OK
        elif isinstance(exc, asyncio.CancelledError):  # the caller went away
            code = grpc.StatusCode.CANCELLED
        else:
            code = grpc.StatusCode.UNKNOWN
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if exc is not None and not isinstance(exc, grpc.aio.AbortError | asyncio.CancelledError):
        span.record_exception(exc)
    if code is not grpc.StatusCode.OK:
        details = context.details() or (type(exc).__name__ if exc is not None else "")
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))


class ServerTracing(grpc.aio.ServerInterceptor):
    def __init__(self, *, own_span: Collection[str] = ()) -> None:
        self._own_span = frozenset(own_span)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(_UNTRACED_PREFIXES) or method in self._own_span:
            return handler
        parent = context_from_metadata(details.invocation_metadata)
        if parent is None:
            return handler
        service, _, name = method.lstrip("/").partition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        return _wrap(handler, method.lstrip("/"), parent, attributes)


def _wrap(
    handler: grpc.RpcMethodHandler, name: str, parent: Context, attributes: dict[str, str]
) -> grpc.RpcMethodHandler:
    def unary_response(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            span = tracer.start_span(name, parent, SpanKind.SERVER, attributes)
            token = otel_context.attach(trace.set_span_in_context(span, parent))
            exc: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as e:
                exc = e
                raise
            finally:
                otel_context.detach(token)
                _finish(span, context, exc)
                span.end()

        return handle

    def stream_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):  # writes with context.write()
            return unary_response(behavior)

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            span = tracer.start_span(name, parent, SpanKind.SERVER, attributes)
            exc: BaseException | None = None
            try:
                async for item in behavior(request, context):
                    yield item
            except BaseException as e:
                exc = e
                raise
            finally:
                _finish(span, context, exc)
                span.end()

        return handle

    wrap = stream_response if handler.response_streaming else unary_response
    return rebuild_handler(handler, wrap(handler_behavior(handler)))
