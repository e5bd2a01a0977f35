"""The router's Prometheus metrics (vLLM names where vLLM has one), created once per process."""

from __future__ import annotations

import prometheus_client as prom

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

REQUEST_SUCCESS = prom.Counter(
    "vllm:request_success", "Finished requests", ["model_name", "finished_reason"]
)
TTFT = prom.Histogram(
    "vllm:time_to_first_token_seconds",
    "Time to first token",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
ITL = prom.Histogram(
    "vllm:inter_token_latency_seconds",
    "Time between a request's engine steps that gave tokens, as they reached the router",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
_itl_children: dict[str, prom.Histogram] = {}


def itl(model_name: str) -> prom.Histogram:
    """ITL's child for `model_name` (observed once per step per request: kept, not looked up)."""
    child = _itl_children.get(model_name)
    if child is None:
        child = _itl_children[model_name] = ITL.labels(model_name)
    return child


E2E = prom.Histogram(
    "vllm:e2e_request_latency_seconds",
    "End-to-end request latency",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
QUEUE_TIME = prom.Histogram(
    "vllm:request_queue_time_seconds",
    "Time from arrival to submission to a worker",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
ROUTING = prom.Counter("llmfleet:routing_decisions", "Routing decisions", ["policy", "outcome"])
PREDICTION_ERROR = prom.Histogram(
    "llmfleet:routing_ttft_prediction_error_seconds",
    "|first token's arrival - routing time - predicted TTFT| of requests a predicting policy "
    "routed",
    ["policy"],
    buckets=_LATENCY_BUCKETS,
)
MIGRATIONS = prom.Counter("llmfleet:migrations", "Requests re-submitted after a worker failure")
LEASES = prom.Counter(
    "llmfleet:lease_outcomes", "KV lease outcomes, as the router sees them", ["outcome"]
)
# Every outcome exported at 0 from the start, so rate() and ratios see the series.
for _outcome in (
    "committed",
    "released",
    "expired",
    "failed",
    "reserve_failed",
    "reserve_waited",
    "lost",
):
    LEASES.labels(_outcome)
