"""A worker's request spans, driven as the engine loop drives them, without a fleet.

The engine thread decides per step whether to read running views for tracing; a request it
admitted must be followed from its first step, even when the event loop has not yet run the
posted `admitted` (the race that once collapsed a chunked prefill into one event).
"""

from __future__ import annotations

from opentelemetry import trace

from llmfleet.engine.request import RequestOutput
from llmfleet.services.worker.request_spans import RequestSpans, RunningView


def output(request_id: str, tokens: list[int], *, finished: bool) -> RequestOutput:
    return RequestOutput(
        request_id, 0, tokens, [None] * len(tokens), finished, "length" if finished else None,
        None, num_prompt_tokens=40, num_cached_tokens=8, num_output_tokens=len(tokens),
    )  # fmt: skip


def test_followed_from_admission_op_to_end(span_exporter):
    spans = RequestSpans("w0")
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("llmfleet.v1.Worker/AddRequest") as rpc:
        assert not spans.following
        spans.expect(rpc)  # the admission op, on the engine thread
        assert spans.following  # the first step reads running views, posted or not
        spans.admitted("r1", rpc, 40, 1, prefill_only=False)  # the post, on the event loop
        assert spans.following
        # Two chunks of 16 after 8 cached tokens, then the last 16 with the first token.
        spans.on_step([RunningView("r1", 0, 8, 24)], 1)
        spans.on_step([RunningView("r1", 0, 8, 40)], 2)
        spans.on_output(output("r1", [5], finished=False), 3)
        spans.on_output(output("r1", [6], finished=True), 4)
    assert not spans.following and len(spans) == 0

    prefill = next(s for s in span_exporter.get_finished_spans() if s.name == "prefill")
    assert prefill.attributes["llmfleet.usage.cached_tokens"] == 8
    chunks = [e.attributes["llmfleet.chunk_tokens"] for e in prefill.events]
    assert chunks == [16, 16]
    decode = next(s for s in span_exporter.get_finished_spans() if s.name == "decode")
    assert decode.attributes["gen_ai.usage.output_tokens"] == 2


def test_nothing_followed_without_a_recording_span():
    spans = RequestSpans("w0")
    quiet = trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)
    spans.expect(quiet)
    spans.admitted("r1", quiet, 40, 1, prefill_only=False)
    assert not spans.following and len(spans) == 0


def test_prefill_span_carries_the_encoder_time_of_its_images(span_exporter):
    spans = RequestSpans("w0")
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("llmfleet.v1.Worker/AddRequest") as rpc:
        spans.expect(rpc)
        spans.admitted("img", rpc, 40, 1, prefill_only=False)
        spans.on_step([RunningView("img", 0, 8, 24, encoder_seconds=0.25)], 1)
        spans.on_step([RunningView("img", 0, 8, 40, encoder_seconds=0.5)], 2)
        spans.on_output(output("img", [5], finished=True), 3)
    prefill = [s for s in span_exporter.get_finished_spans() if s.name == "prefill"][-1]
    assert prefill.attributes["llmfleet.encoder_seconds"] == 0.5
