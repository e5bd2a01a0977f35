"""Tracing setup from `OTEL_*` (each case in a fresh process: the provider is process-global),
W3C propagation helpers, and the gRPC server interceptor."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import StatusCode
from otlp_collector import HTTPCollector, spans_by_service

from llmfleet.services.tokenizer.server import start as start_tokenizer
from llmfleet.shared.core.config import TokenizerConfig
from llmfleet.shared.wire import tracing
from llmfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc

# Sets up tracing as a service does, makes one span with a child, prints what it can see.
SCRIPT = """
from opentelemetry import trace
from llmfleet.shared.wire.tracing import metadata, setup_tracing, traceparent
setup_tracing("worker")
tracer = trace.get_tracer("probe")
with tracer.start_as_current_span("probe-span") as span:
    with tracer.start_as_current_span("probe-child"):
        pass
    print("provider", type(trace.get_tracer_provider()).__name__)
    print("recording", span.is_recording())
    print("metadata", metadata())
    print("traceparent", repr(traceparent()))
"""


def run_script(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def test_default_installs_nothing_and_exports_nothing():
    out = run_script().stdout
    assert "provider ProxyTracerProvider" in out
    assert "recording False" in out
    assert "metadata None" in out  # nothing goes on the wire outside a trace
    assert "traceparent ''" in out
    assert "probe-span" not in out


def test_console_exporter_prints_spans_with_the_service_name():
    out = run_script(OTEL_TRACES_EXPORTER="console").stdout
    assert "provider TracerProvider" in out and "recording True" in out
    assert '"name": "probe-span"' in out and '"name": "probe-child"' in out
    assert '"service.name": "llmfleet-worker"' in out
    assert "metadata (('traceparent', '00-" in out

    renamed = run_script(OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="w7").stdout
    assert '"service.name": "w7"' in renamed


def test_sdk_disabled_wins_over_an_exporter():
    out = run_script(OTEL_TRACES_EXPORTER="console", OTEL_SDK_DISABLED="true").stdout
    assert "provider ProxyTracerProvider" in out
    assert "probe-span" not in out


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("OTEL_TRACES_EXPORTER", "zipkin", "OTEL_TRACES_EXPORTER: 'zipkin' is not one of"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    ],
)
def test_bad_values_name_the_variable(monkeypatch, var, value, message):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv(var, value)
    with pytest.raises(tracing.TracingConfigError, match=message):
        tracing.provider_from_env("worker")


def test_none_and_unset_mean_no_provider(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert tracing.provider_from_env("worker") is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.provider_from_env("worker") is None


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_over_grpc_reaches_a_collector():
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        run_script(
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        )
    finally:
        server.stop(0)
    assert {(svc, s.name) for svc, s in spans_by_service(collector.requests)} == {
        ("llmfleet-worker", "probe-span"),
        ("llmfleet-worker", "probe-child"),
    }


def test_otlp_over_http_reaches_a_collector():
    with HTTPCollector() as collector:
        # The traces variable wins over the generic one.
        run_script(
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=collector.url,
        )
        assert collector.paths() == ["/v1/traces"]
        assert {(svc, s.name) for svc, s in collector.spans()} == {
            ("llmfleet-worker", "probe-span"),
            ("llmfleet-worker", "probe-child"),
        }


def test_traceparent_round_trip():
    tracer = TracerProvider().get_tracer("t")  # a local provider: recording, not global
    with tracer.start_as_current_span("s") as span:
        tp = tracing.traceparent()
        md = dict(tracing.metadata())
    sc = span.get_span_context()
    flags = int(sc.trace_flags)
    assert tp == f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{flags:02x}" == md["traceparent"]
    for ctx in (tracing.context_from_traceparent(tp), tracing.context_from_metadata(md.items())):
        got = tracing.trace.get_current_span(ctx).get_span_context()
        assert (got.trace_id, got.span_id, got.is_remote) == (sc.trace_id, sc.span_id, True)
    assert tracing.context_from_traceparent("") is None
    assert tracing.context_from_traceparent("00-nothex-1-01") is None
    assert tracing.context_from_metadata([("other", "x")]) is None
    assert tracing.metadata() is None and tracing.traceparent() == ""


def test_server_spans_only_for_traced_calls_with_the_status(
    span_exporter, make_checkpoint, tmp_path
):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_checkpoint("llama", tmp_path))
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

    async def body():
        svc = await start_tokenizer(TokenizerConfig(metrics_port=None), tokenizer=tok)
        try:
            async with grpc.aio.insecure_channel(svc.address) as channel:
                stub = tokenizer_pb2_grpc.TokenizerStub(channel)
                span_exporter.clear()
                ok = tokenizer_pb2.TokenizeRequest(text="hello")
                await stub.Tokenize(ok)  # no trace context: no span
                assert span_exporter.get_finished_spans() == ()
                await stub.Tokenize(ok, metadata=(("traceparent", parent),))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    bad = tokenizer_pb2.TokenizeRequest(text="")
                    await stub.Tokenize(bad, metadata=(("traceparent", parent),))
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        finally:
            svc.request_stop()
            await svc.wait_for_termination()

    asyncio.run(body())
    rpcs = [s for s in span_exporter.get_finished_spans() if s.name.endswith("/Tokenize")]
    assert [s.attributes["rpc.grpc.status_code"] for s in rpcs] == [0, 3]
    for s in rpcs:
        assert f"{s.parent.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
        assert s.parent.is_remote and s.attributes["rpc.service"] == "llmfleet.v1.Tokenizer"
    assert rpcs[0].status.status_code is StatusCode.UNSET
    assert rpcs[1].status.status_code is StatusCode.ERROR
    assert "INVALID_ARGUMENT" in rpcs[1].status.description
