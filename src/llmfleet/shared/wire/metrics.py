"""Prometheus metrics that more than one service exports, defined once.

Each service runs in its own process with its own registry, but tests import several
services into one process, so a name may be registered only once. Service-specific metrics
stay in the service's own module.
"""

from __future__ import annotations

import prometheus_client

NUM_REQUESTS_RUNNING = prometheus_client.Gauge(
    "vllm:num_requests_running",
    "Requests running: in the engine (worker), or submitted to a worker (router)",
    ["model_name"],
)
NUM_REQUESTS_WAITING = prometheus_client.Gauge(
    "vllm:num_requests_waiting",
    "Requests waiting: to be scheduled by the engine (worker), or for a worker (router)",
    ["model_name"],
)
