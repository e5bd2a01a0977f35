"""The gateway's span: one SERVER span per generation request, the root of the request's trace
(or a child of the caller's, when the HTTP request carries a W3C `traceparent` header).

The router's `llm_request` span becomes its child: the gRPC client forwards the current span.
A streamed answer's span ends when the stream does. Health, metrics and model listing make no
spans.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from llmfleet.services.gateway.convert import Call
from llmfleet.shared.wire.tracing import TRACEPARENT, TRACESTATE, context_from_traceparent

tracer = trace.get_tracer("llmfleet.gateway")

_OPERATION = {"chat": "chat", "completions": "text_completion"}


def start_request_span(request: Request, call: Call, model: str) -> Span:
    parent = context_from_traceparent(
        request.headers.get(TRACEPARENT, ""), request.headers.get(TRACESTATE, "")
    )
    path = request.url.path
    return tracer.start_span(
        f"{request.method} {path}",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={
            "http.request.method": request.method,
            "url.path": path,
            "gen_ai.operation.name": _OPERATION.get(call.endpoint, call.endpoint),
            "gen_ai.request.model": model,
            "llmfleet.request_id": call.request_id,
            "llmfleet.stream": call.stream,
        },
    )


def end_request_span(span: Span, status: int) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()


async def ending_with(body: AsyncIterator[str], span: Span, status: int) -> AsyncIterator[str]:
    """`body`, ending `span` once it is exhausted or closed (the client went away)."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        end_request_span(span, status)
