"""A fake OpenTelemetry collector for tests: OTLP/HTTP trace receiver on loopback.

with HTTPCollector() as collector:            # serves http://127.0.0.1:<port>/v1/traces
    ... processes export to collector.url ...
    collector.spans()                         # [(service.name, Span protobuf), ...]
"""

from __future__ import annotations

import http.server
import threading
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


class HTTPCollector(http.server.ThreadingHTTPServer):
    def __init__(self) -> None:
        self.requests: list[tuple[str, trace_service_pb2.ExportTraceServiceRequest]] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with collector.lock:
                    collector.requests.append((self.path, req))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}/v1/traces"

    def __enter__(self) -> HTTPCollector:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()

    def paths(self) -> list[str]:
        with self.lock:
            return [path for path, _ in self.requests]

    def spans(self) -> list[tuple[str, Any]]:
        with self.lock:
            return spans_by_service(req for _, req in self.requests)


def spans_by_service(requests: Any) -> list[tuple[str, Any]]:
    """(service.name, span) for every span of some ExportTraceServiceRequests."""
    out = []
    for req in requests:
        for rs in req.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            service = attrs.get("service.name", "")
            out.extend((service, s) for ss in rs.scope_spans for s in ss.spans)
    return out
