"""OpenTelemetry tracing for every llmfleet service: setup from `OTEL_*`, W3C trace context on the
wire, and the small helpers the services use to start spans.

    setup_tracing("worker")                      # once per process (shared/wire/service.py does it)
    with child_span(tracer, "kv_push") as span:  # a no-op outside a trace
        ...
    stub.AddRequest(req, metadata=metadata(ctx)) # gRPC: traceparent in the call's metadata
    header.traceparent = traceparent()           # ZMQ: the header frame's traceparent field
    ctx = context_from_traceparent(header.traceparent)   # receiver side (None: not traced)

Configuration is the standard OpenTelemetry SDK environment:
  - `OTEL_TRACES_EXPORTER`: `otlp`, `console` or `none` (comma-separated list; default `none`:
    no SDK is installed, every span is a non-recording no-op, the overhead is a context lookup);
  - `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`: `grpc` or
    `http/protobuf` (the default, as the specification says);
  - endpoint, headers, timeout, compression, certificates: the exporters read
    `OTEL_EXPORTER_OTLP_[TRACES_]*` themselves; batching reads `OTEL_BSP_*`; sampling reads
    `OTEL_TRACES_SAMPLER[_ARG]`; `OTEL_RESOURCE_ATTRIBUTES` adds resource attributes;
  - `OTEL_SERVICE_NAME`: defaults to `llmfleet-<service>`;
  - `OTEL_SDK_DISABLED=true`: no SDK, whatever the rest says.

Trace context is always W3C `traceparent` (and `tracestate` in gRPC metadata), independent of
`OTEL_PROPAGATORS`: it is part of the wire contract (DESIGN.md §2). Calls outside a trace carry
nothing. Span attributes never hold prompt or completion text.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmfleet.shared.core.errors import ValidationError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
EXPORTERS_VAR = "OTEL_TRACES_EXPORTER"
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_EXPORTERS = ("otlp", "console", "none")
_PROTOCOLS = ("grpc", "http/protobuf")

_W3C = TraceContextTextMapPropagator()
Metadata = tuple[tuple[str, str], ...]


class TracingConfigError(ValidationError):
    """An `OTEL_*` variable holds a value this service cannot use (`field` names it)."""


# ---- setup -------------------------------------------------------------------------------------
def service_name(service: str) -> str:
    return os.environ.get("OTEL_SERVICE_NAME") or f"llmfleet-{service}"


def exporter_names() -> list[str]:
    """The exporters `OTEL_TRACES_EXPORTER` asks for ([] for none or when the SDK is disabled)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    raw = os.environ.get(EXPORTERS_VAR, "none")
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    for name in names:
        if name not in _EXPORTERS:
            raise TracingConfigError(
                EXPORTERS_VAR, f"{name!r} is not one of {', '.join(_EXPORTERS)} (got {raw!r})"
            )
    return [n for n in names if n != "none"]


def otlp_protocol() -> str:
    for var in PROTOCOL_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            if value not in _PROTOCOLS:
                raise TracingConfigError(var, f"{value!r}: must be one of {', '.join(_PROTOCOLS)}")
            return value
    return "http/protobuf"


def _exporter(name: str) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HTTPSpanExporter,
    )

    return HTTPSpanExporter()


def provider_from_env(service: str) -> TracerProvider | None:
    """A tracer provider exporting as `OTEL_*` says, or None when nothing is to be exported.

    Raises TracingConfigError for an unknown exporter or protocol."""
    names = exporter_names()
    if not names:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name(service)}))
    for name in dict.fromkeys(names):  # each once, in order
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    return provider


def setup_tracing(service: str) -> None:
    """Install the `OTEL_*`-configured provider for this process, once.

    A process that already has an SDK provider (a second service in one test process, or an
    application that configured OpenTelemetry itself) keeps it. With nothing to export the
    no-op API stays in place."""
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return
    provider = provider_from_env(service)
    if provider is None:
        return
    trace.set_tracer_provider(provider)  # flushed and shut down at exit by the SDK itself
    what = ", ".join(exporter_names())
    if "otlp" in what:
        what += f" ({otlp_protocol()})"
    logger.info("tracing: exporting spans of %s via %s", service_name(service), what)


# ---- spans -------------------------------------------------------------------------------------
def in_trace(ctx: Context | None = None) -> bool:
    """Whether `ctx` (default: the current context) belongs to a trace."""
    return trace.get_current_span(ctx).get_span_context().is_valid


@contextmanager
def child_span(tracer: Tracer, name: str, **kwargs: Any) -> Iterator[Span]:
    """A span under the current one, made current; outside a trace a no-op (INVALID_SPAN):
    work that is no request's part (probes, polls, direct tool calls) starts no trace."""
    if not in_trace():
        yield trace.INVALID_SPAN
        return
    with tracer.start_as_current_span(name, **kwargs) as span:
        yield span


# ---- propagation -------------------------------------------------------------------------------
def traceparent(ctx: Context | None = None) -> str:
    """The W3C traceparent of the span current in `ctx` (default: the current context); ""
    when there is none, so untraced work puts nothing on the wire."""
    sc = trace.get_current_span(ctx).get_span_context()
    if not sc.is_valid:
        return ""
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def metadata(ctx: Context | None = None) -> Metadata | None:
    """gRPC call metadata carrying the trace context of `ctx` (None outside a trace)."""
    if not in_trace(ctx):
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=ctx)
    return tuple(carrier.items())


def context_from_traceparent(value: str, tracestate: str = "") -> Context | None:
    """The remote parent named by a traceparent (None when empty or malformed)."""
    if not value:
        return None
    carrier = {TRACEPARENT: value}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    ctx = _W3C.extract(carrier)
    return ctx if in_trace(ctx) else None


def context_from_metadata(md: Sequence[tuple[str, str | bytes]] | None) -> Context | None:
    """The remote parent carried in gRPC invocation metadata (None when the call has none)."""
    if not md:
        return None
    parent = state = ""
    for key, value in md:
        if key == TRACEPARENT and isinstance(value, str):
            parent = value
        elif key == TRACESTATE and isinstance(value, str):
            state = value
    return context_from_traceparent(parent, state)
