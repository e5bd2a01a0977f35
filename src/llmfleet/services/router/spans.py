"""The router's spans and their attributes (OpenTelemetry GenAI conventions plus `llmfleet.*`).

    llm_request (SERVER, the trace's root for one Generate call)
    ├── llmfleet.v1.Tokenizer/Tokenize      (tokenizer: render, tokenize)
    ├── route                                (policy, role, chosen worker, matched prefix)
    ├── kv_lease                             (disaggregated: ReserveKV on D, Prefill on P)
    ├── llmfleet.v1.Worker/AddRequest | StartDecode   (worker: queue, prefill, decode, ...)
    └── detokenize                           (one per completion, open to close)

Spans are made from explicit contexts (`RequestRun.trace`), never attached as the current
context across the Generate stream's yields. Attributes never hold prompt or output text.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from llmfleet.services.router.request import RequestRun
from llmfleet.services.router.routing import RouteDecision
from llmfleet.shared.core.sampling_params import SamplingParams

tracer = trace.get_tracer("llmfleet.services.router")

_OPERATION = {"chat": "chat", "text": "text_completion", "tokens": "text_completion"}


def start_request(request_id: str, parent: Context | None) -> tuple[Span, Context]:
    """The `llm_request` span of one Generate call and the context its children start from."""
    span = tracer.start_span(
        "llm_request", parent, SpanKind.SERVER, attributes={"llmfleet.request_id": request_id}
    )
    return span, trace.set_span_in_context(span, parent)


def set_request(span: Span, kind: str, params: SamplingParams, model_id: str) -> None:
    if not span.is_recording():
        return
    span.set_attributes(
        {
            "gen_ai.operation.name": _OPERATION[kind],
            "gen_ai.request.model": model_id,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
        }
    )
    if params.seed is not None:
        span.set_attribute("gen_ai.request.seed", params.seed)
    if params.n != 1:
        span.set_attribute("gen_ai.request.choice.count", params.n)


def end_request(span: Span, run: RequestRun | None, error: BaseException | None) -> None:
    """Usage, finish reasons, time to first token, workers; error status if it failed."""
    if span.is_recording():
        if run is not None:
            span.set_attributes(
                {
                    "gen_ai.response.finish_reasons": [
                        c.finish_reason or "abort" for c in run.completions
                    ],
                    "gen_ai.usage.input_tokens": len(run.prompt_ids),
                    "gen_ai.usage.output_tokens": run.num_completion_tokens(),
                    "llmfleet.usage.cached_tokens": min(run.num_cached_tokens, len(run.prompt_ids)),
                    "llmfleet.worker_ids": list(run.workers_used),
                    "llmfleet.num_retries": run.num_retries,
                }
            )
            if run.first_token_at is not None:
                ttft = run.first_token_at - run.arrival
                span.set_attribute("llmfleet.time_to_first_token_s", ttft)
        if error is not None:
            span.set_attribute("error.type", type(error).__name__)
            span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()


def set_route(span: Span, decision: RouteDecision) -> None:
    """The decision on its `route` span: policy, outcome, winner, the prefix it counted on, and
    for a predicting policy each candidate's predicted TTFT (parallel lists) and the winner's."""
    if not span.is_recording():
        return
    span.set_attributes(
        {
            "llmfleet.routing.policy": decision.policy,
            "llmfleet.routing.outcome": decision.outcome,
            "llmfleet.worker_id": decision.worker_id,
            "llmfleet.routing.matched_prefix_tokens": decision.matched_prefix_tokens,
        }
    )
    if decision.predicted_ttft_s is not None:
        span.set_attribute("llmfleet.routing.predicted_ttft_ms", decision.predicted_ttft_s * 1e3)
    if decision.predictions:
        workers = [w for w, _ in decision.predictions]
        span.set_attribute("llmfleet.routing.candidates", workers)
        predicted = [t * 1e3 for _, t in decision.predictions]
        span.set_attribute("llmfleet.routing.candidates_predicted_ttft_ms", predicted)
