"""One request is one trace across every service (all in this process, in-memory exporter).

Aggregated (two unified workers, round robin, shared kvstore) and disaggregated (prefill +
decode worker, KV lease): the spans the design names are there, with the right parents, with
GenAI attributes matching what the client received, and no prompt text anywhere. Health
checks, heartbeats and KV events produce no spans at all.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from opentelemetry.trace import SpanKind
from trace_fleet import InProcessFleet, Trace, text_values, trace_of, until

from llmfleet.models.loader import load_model

CANARY = "zebra-canary-7781"  # in every prompt; must appear in no span
SAMPLING = dict(max_tokens=5, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(make_checkpoint_module):
    return load_model(str(make_checkpoint_module("llama")), dtype=torch.float32, progress=False)


def run(coro, timeout: float = 90.0):
    async def bounded():
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


def check_tree(t: Trace) -> None:
    """One root, every other span's parent in the same trace, no prompt text."""
    roots = [s for s in t.spans if t.parent(s) is None]
    assert [r.name for r in roots] == ["llm_request"], t.names()
    assert roots[0].kind is SpanKind.SERVER
    for span in t.spans:
        assert not any(CANARY in v for v in text_values(span)), span.name


def check_request(t: Trace, result, *, operation: str) -> None:
    req = t.one("llm_request")
    a = req.attributes
    assert a["gen_ai.operation.name"] == operation
    assert a["gen_ai.request.model"]
    assert a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.seed"] == 11
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.usage.input_tokens"] == result.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == result.usage.completion_tokens == 5
    assert a["llmfleet.usage.cached_tokens"] == result.usage.cached_prompt_tokens
    assert a["llmfleet.time_to_first_token_s"] > 0
    assert a["llmfleet.request_id"] == result.request_id
    # The tokenizer: its RPC span under the request, render and tokenize under that.
    tok = t.child(req, "llmfleet.v1.Tokenizer/Tokenize")
    assert tok.kind is SpanKind.SERVER
    assert t.child(tok, "tokenize").attributes["llmfleet.num_tokens"] == result.usage.prompt_tokens
    assert len(t.children(tok, "render")) == (operation == "chat")
    # Detokenize: one span per completion; the tokenizer's stream is shared by every request
    # and belongs to none of their traces.
    detok = t.child(req, "detokenize")
    assert detok.attributes["llmfleet.detokenize.num_tokens"] == 5
    assert not t.named("llmfleet.v1.Tokenizer/Detokenize")


def check_engine_phases(t: Trace, rpc, num_prompt_tokens: int, *, decode: bool) -> None:
    """queue -> prefill (chunk events) [-> decode] under the RPC that admitted the request."""
    queue, prefill = t.child(rpc, "queue"), t.child(rpc, "prefill")
    assert queue.end_time <= prefill.start_time
    chunks = [e for e in prefill.events if e.name == "prefill_chunk"]
    assert chunks, "no prefill_chunk events"
    cached = prefill.attributes["llmfleet.usage.cached_tokens"]
    assert cached + sum(e.attributes["llmfleet.chunk_tokens"] for e in chunks) == num_prompt_tokens
    assert chunks[-1].attributes["llmfleet.computed_tokens"] == num_prompt_tokens
    if num_prompt_tokens - cached > 16:  # max_num_batched_tokens: chunked prefill
        assert len(chunks) > 1
    if decode:
        d = t.child(rpc, "decode")
        assert prefill.end_time <= d.start_time
        assert d.attributes["gen_ai.usage.output_tokens"] == 5
        assert d.attributes["gen_ai.response.finish_reasons"] == ("length",)
    else:
        assert not t.children(rpc, "decode")


def test_aggregated_request_is_one_trace(loaded, span_exporter):
    messages = [{"role": "user", "content": f"tell me about {CANARY} " + "and more " * 6}]

    async def body():
        async with InProcessFleet(
            loaded, mode="aggregated", roles=("unified", "unified"), routing_policy="round_robin"
        ) as fleet:
            # Health checks (even ones carrying a trace context), heartbeats and KV events of
            # an idle fleet make no spans.
            span_exporter.clear()
            await fleet.health_checks(None)
            traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            await fleet.health_checks((("traceparent", traceparent),))
            await asyncio.sleep(0.2)  # a few heartbeats
            assert span_exporter.get_finished_spans() == ()

            first = await fleet.client.generate(messages=messages, **SAMPLING)
            # The prompt's blocks reach the kvstore after the request (a background put).
            await until(lambda: any(trace_of(span_exporter)[0].named("kvstore.serve_put")))
            second = await fleet.client.generate(messages=messages, **SAMPLING)
            await until(lambda: len(trace_of(span_exporter)) == 2)
            return fleet.workers[0].worker_id, fleet.workers[1].worker_id, first, second

    w0, w1, first, second = run(body())
    all_spans = span_exporter.get_finished_spans()
    t1, t2 = trace_of(all_spans)
    # Nothing else was traced: every span belongs to one of the two requests' traces.
    assert len(all_spans) == len(t1.spans) + len(t2.spans)

    for t, result, worker in ((t1, first, w0), (t2, second, w1)):
        check_tree(t)
        check_request(t, result, operation="chat")
        req = t.one("llm_request")
        assert req.attributes["llmfleet.worker_ids"] == (worker,)
        route = t.child(req, "route")
        assert route.attributes["llmfleet.routing.policy"] == "round_robin"
        assert route.attributes["llmfleet.worker_id"] == worker
        assert route.attributes["llmfleet.routing.role"] == "unified"
        assert isinstance(route.attributes["llmfleet.routing.matched_prefix_tokens"], int)
        add = t.child(req, "llmfleet.v1.Worker/AddRequest")
        assert add.kind is SpanKind.SERVER
        assert add.attributes["rpc.system"] == "grpc"
        lookup = t.child(add, "kvstore.lookup")
        t.child(lookup, "llmfleet.v1.KVStore/Lookup")
        check_engine_phases(t, add, result.usage.prompt_tokens, decode=True)

    # The first request put the prompt's full blocks into the kvstore; the second, on the
    # other worker, fetched them from there.
    put = t1.child(t1.one("llmfleet.v1.Worker/AddRequest"), "kvstore.put")
    served_put = t1.child(put, "kvstore.serve_put")
    num_full_blocks = first.usage.prompt_tokens // 4
    assert served_put.attributes["llmfleet.kvstore.found_count"] == num_full_blocks
    get = t2.child(t2.one("llmfleet.v1.Worker/AddRequest"), "kvstore.get")
    assert get.attributes["llmfleet.kv.num_blocks"] == num_full_blocks
    assert get.attributes["llmfleet.kv.bytes"] == put.attributes["llmfleet.kv.bytes"] > 0
    t2.child(get, "kvstore.serve_get")
    assert second.usage.cached_prompt_tokens > 0
    assert not t2.named("kvstore.put")  # the kvstore held every block already


def test_disaggregated_request_is_one_trace(loaded, span_exporter):
    prompt = f"{CANARY} " + "the quick brown fox jumps over the lazy dog " * 2

    async def body():
        async with InProcessFleet(
            loaded, mode="disaggregated", roles=("prefill", "decode"), short_prompt_threshold=8
        ) as fleet:
            span_exporter.clear()
            result = await fleet.client.generate(prompt, raw=True, **SAMPLING)
            await until(lambda: len(trace_of(span_exporter)) == 1)
            await until(lambda: any(trace_of(span_exporter)[0].named("kvstore.serve_put")))
            return fleet.workers[0].worker_id, fleet.workers[1].worker_id, result

    prefill_id, decode_id, result = run(body())
    [t] = trace_of(span_exporter)
    check_tree(t)
    check_request(t, result, operation="text_completion")
    req = t.one("llm_request")
    assert set(req.attributes["llmfleet.worker_ids"]) == {prefill_id, decode_id}
    routes = {s.attributes["llmfleet.routing.role"]: s for s in t.children(req, "route")}
    assert routes["decode"].attributes["llmfleet.worker_id"] == decode_id
    assert routes["decode"].attributes["llmfleet.routing.policy"] == "least_load"
    assert routes["prefill"].attributes["llmfleet.worker_id"] == prefill_id

    # The lease: reserved on D, prefilled on P, which pushes the KV to D.
    lease = t.child(req, "kv_lease")
    assert lease.attributes["llmfleet.decode_worker_id"] == decode_id
    assert lease.attributes["llmfleet.prefill_worker_id"] == prefill_id
    t.child(lease, "llmfleet.v1.Worker/ReserveKV")
    pre = t.child(lease, "llmfleet.v1.Worker/Prefill")
    check_engine_phases(t, pre, result.usage.prompt_tokens, decode=False)
    push = t.child(pre, "kv_push")
    receives = t.children(push, "kv_receive")  # the decode worker's half, linked as children
    num_blocks = -(-result.usage.prompt_tokens // 4)
    assert push.kind is SpanKind.PRODUCER and receives[0].kind is SpanKind.CONSUMER
    assert push.attributes["llmfleet.kv.num_blocks"] == num_blocks
    assert sum(r.attributes["llmfleet.kv.num_blocks"] for r in receives) == num_blocks
    kv_bytes = push.attributes["llmfleet.kv.bytes"]
    assert kv_bytes > 0 and kv_bytes == sum(r.attributes["llmfleet.kv.bytes"] for r in receives)
    assert lease.attributes["llmfleet.kv.bytes"] == kv_bytes
    assert lease.attributes["llmfleet.lease.id"] == receives[0].attributes["llmfleet.lease.id"]
    assert push.attributes["llmfleet.kv.transfer_s"] > 0
    assert push.end_time <= pre.end_time
    # Then D decodes under StartDecode.
    start = t.child(req, "llmfleet.v1.Worker/StartDecode")
    assert start.start_time >= lease.end_time
    decode = t.child(start, "decode")
    assert decode.attributes["llmfleet.worker_id"] == decode_id
    assert decode.attributes["gen_ai.usage.output_tokens"] == 4  # the first came from P
    assert decode.attributes["gen_ai.response.finish_reasons"] == ("length",)
    # P wrote the prompt's blocks to the kvstore under its Prefill span.
    t.child(t.child(pre, "kvstore.put"), "kvstore.serve_put")


def test_stop_string_ends_the_request_spans_on_the_worker(loaded, span_exporter):
    """A stop string the router matches ends the worker's decode span too (the engine
    emits no output for a stopped completion; the Cancel carries the trace)."""
    prompt = "one two three four five six"
    greedy = dict(temperature=0.0, ignore_eos=True)

    async def body():
        async with InProcessFleet(loaded, mode="aggregated", roles=("unified",)) as fleet:
            plain = await fleet.client.generate(prompt, raw=True, max_tokens=8, **greedy)
            stop = plain.completions[0].text[3:5]
            assert len(stop) == 2
            span_exporter.clear()
            result = await fleet.client.generate(
                prompt, raw=True, max_tokens=200, stop=[stop], **greedy
            )
            await until(lambda: any(trace_of(span_exporter)[0].named("decode")))
            return result, len(fleet.workers[0].request_spans)

    result, num_followed = run(body())
    assert result.completions[0].finish_reason == "stop"
    assert num_followed == 0  # the worker forgot the request
    [t] = trace_of(span_exporter)
    check_tree(t)
    req = t.one("llm_request")
    assert req.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    t.child(req, "llmfleet.v1.Worker/Cancel")
    decode = t.child(t.one("llmfleet.v1.Worker/AddRequest"), "decode")
    assert decode.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert decode.attributes["gen_ai.usage.output_tokens"] < 200
    assert t.one("detokenize").attributes["llmfleet.detokenize.stop_string_matched"] is True
