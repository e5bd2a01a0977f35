"""A real disaggregated fleet (one process per service) exporting over OTLP/HTTP to a collector
in this test: one request is one trace across five processes, each under its own service name,
and the KV transfer's two halves sit in two worker processes, linked parent to child."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from llmfleet.shared.client import GenerationClient
from llmfleet.shared.launcher import Fleet, FleetSpec


class Collector(http.server.ThreadingHTTPServer):
    """OTLP/HTTP trace receiver: every span as (service.name, span)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with collector.lock:
                    for rs in req.resource_spans:
                        attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            collector.spans.extend((attrs["service.name"], s) for s in ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def snapshot(self) -> list[tuple[str, object]]:
        with self.lock:
            return list(self.spans)


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    threading.Thread(target=c.serve_forever, daemon=True).start()
    yield c
    c.shutdown()


def test_one_trace_across_processes(make_checkpoint_module, collector):
    model = str(make_checkpoint_module("llama"))
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{collector.server_port}/v1/traces",
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # export within 50 ms of a span's end
    }
    spec = FleetSpec(
        port=0,
        disaggregated=True,
        model=model,
        env=env,
        extra_args={
            "worker": ["--num-kv-blocks", "64", "--block-size", "4"],
            "scheduler": ["--short-prompt-threshold", "8"],
        },
        startup_timeout_s=240,
    )
    with Fleet(spec) as fleet:
        result = GenerationClient(fleet.endpoint).generate(
            "the quick brown fox jumps over the lazy dog", raw=True, max_tokens=4
        )
        deadline = time.monotonic() + 30
        while not {s.name for _, s in collector.snapshot()} >= {"llm_request", "decode"}:
            assert time.monotonic() < deadline, "spans did not arrive"
            time.sleep(0.1)
    spans = collector.snapshot()  # the fleet has stopped: every exporter flushed at exit
    [root] = [s for _, s in spans if s.name == "llm_request"]
    assert root.attributes  # the collector got attributes over the wire
    trace = [(svc, s) for svc, s in spans if s.trace_id == root.trace_id]
    # Only the request was traced (no heartbeats, registrations, health checks or KV events).
    assert len(trace) == len(spans)
    services = {svc for svc, _ in trace}
    assert services == {
        "llmfleet-scheduler",
        "llmfleet-tokenizer",
        "llmfleet-worker",
        "llmfleet-kvstore",
    }
    by_id = {s.span_id: (svc, s) for svc, s in trace}
    for svc, s in trace:
        if s is not root:
            assert s.parent_span_id in by_id, f"{s.name} ({svc}) has a parent outside the trace"
    # The KV transfer: kv_push in the prefill worker, kv_receive (its child) in the decode one.
    [push] = [s for _, s in trace if s.name == "kv_push"]
    receives = [s for _, s in trace if s.name == "kv_receive"]
    assert receives and all(r.parent_span_id == push.span_id for r in receives)
    worker_of = {
        s.span_id: a.value.string_value
        for _, s in trace
        for a in s.attributes
        if a.key == "llmfleet.worker_id"
    }
    [prefill] = [s for _, s in trace if s.name == "prefill"]
    [decode] = [s for _, s in trace if s.name == "decode"]
    assert worker_of[prefill.span_id] != worker_of[decode.span_id]
    usage = {a.key: a.value.int_value for a in root.attributes if a.key.startswith("gen_ai.usage")}
    assert usage == {
        "gen_ai.usage.input_tokens": result.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": result.usage.completion_tokens,
    }
