"""The gateway's span is the root of an OpenAI request's trace (or the caller's child, given a
`traceparent` header), with the router's `llm_request` under it; a stream's span ends with
the stream; health checks make no spans. Every service runs in this process."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx2
import openai
import pytest
import torch
from opentelemetry.trace import SpanKind
from trace_fleet import InProcessFleet, trace_of, until

from llmfleet.models.loader import load_model
from llmfleet.shared.core.config import GatewayConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))
from gateway_helpers import gateway_in_thread  # noqa: E402

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module):
    return load_model(str(make_checkpoint_module("llama")), dtype=torch.float32, progress=False)


def test_gateway_span_roots_the_request_trace(loaded, span_exporter):
    def http_calls(router: str) -> tuple[str, str]:
        config = GatewayConfig(port=0, router_address=router)
        with gateway_in_thread(config, loaded.tokenizer) as url:
            assert httpx2.get(url.removesuffix("/v1") + "/health").status_code == 200
            oai = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
            model = oai.models.list().data[0].id
            chat = oai.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            stream = oai.completions.create(
                model=model,
                prompt="once upon a time",
                max_tokens=4,
                stream=True,
                extra_headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
            )
            streamed = [c.id for c in stream]
            return chat.id, streamed[0]

    async def body() -> tuple[str, str]:
        async with InProcessFleet(loaded, mode="aggregated", roles=("unified",)) as fleet:
            span_exporter.clear()
            ids = await asyncio.to_thread(http_calls, fleet.router.address)
            await until(lambda: len(trace_of(span_exporter)) == 2, what="two request traces")
            return ids

    chat_id, completion_id = asyncio.run(asyncio.wait_for(body(), 120))
    chat_trace, completion_trace = trace_of(span_exporter)

    # Non-streamed chat: the gateway's span is the trace's root, llm_request its child.
    root = chat_trace.one("POST /v1/chat/completions")
    assert root.parent is None and root.kind is SpanKind.SERVER
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["llmfleet.request_id"] == chat_id
    req = chat_trace.one("llm_request")
    assert chat_trace.parent(req) is root
    assert req.attributes["llmfleet.request_id"] == chat_id

    # Streamed completion under the caller's span: same trace id, parent the caller's span;
    # the gateway's span lasts until the stream ended (after the request's own span).
    span = completion_trace.one("POST /v1/completions")
    assert f"{span.context.trace_id:032x}" == CALLER_TRACE
    assert f"{span.parent.span_id:016x}" == CALLER_SPAN
    assert span.attributes["gen_ai.operation.name"] == "text_completion"
    assert span.attributes["llmfleet.request_id"] == completion_id
    req = completion_trace.one("llm_request")
    assert completion_trace.parent(req) is span
    assert span.end_time >= req.end_time

    # Health checks and model listings made no spans: every span is in one of the two traces.
    spans = span_exporter.get_finished_spans()
    assert len(spans) == len(chat_trace.spans) + len(completion_trace.spans)
