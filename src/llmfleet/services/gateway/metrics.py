"""Prometheus metrics of the gateway's HTTP traffic (the fleet's own metrics live in its
services). A plain ASGI middleware: it must not wrap `receive`, which the disconnect watch reads.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import prometheus_client
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUESTS = prometheus_client.Counter(
    "llmfleet:gateway_requests_total",
    "HTTP requests answered by the gateway, by path and status code",
    ["endpoint", "status"],
)
DURATION = prometheus_client.Histogram(
    "llmfleet:gateway_request_duration_seconds",
    "From a request's arrival to the end of its response (a stream's last event)",
    ["endpoint"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)


class MetricsMiddleware:
    """Counts each HTTP request by path (`other` for unknown paths) and final status."""

    def __init__(self, app: ASGIApp, endpoints: Collection[str]) -> None:
        self.app = app
        self.endpoints = frozenset(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"
        status = 500  # when the app raises before answering
        start = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            REQUESTS.labels(endpoint, str(status)).inc()
            DURATION.labels(endpoint).observe(time.perf_counter() - start)
